package client

import (
	"context"
	"errors"
	"io"
	"net"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/test/bufconn"

	pb "github.com/pagedserve/pagedserve/clients/go/pagedservev1"
)

// fakeService streams a Started frame, then `deltas` deltas and a Final frame; with deltas < 0 it sends
// Started and one delta, then holds the stream open until the client cancels. It runs on a real (in-memory)
// gRPC transport, so cancellation and status codes travel exactly as they do over TCP.
type fakeService struct {
	pb.UnimplementedGenerationServiceServer
	deltas     int
	cancelled  chan struct{} // closed when the first held-open stream sees the client's cancel
	cancelOnce sync.Once
}

func (f *fakeService) Generate(req *pb.GenerateRequest, out pb.GenerationService_GenerateServer) error {
	send := func(frame *pb.GenerateResponse) error { return out.Send(frame) }
	started := &pb.Started{RequestId: "fake-1"}
	if err := send(&pb.GenerateResponse{Frame: &pb.GenerateResponse_Started{Started: started}}); err != nil {
		return err
	}
	n := f.deltas
	if n < 0 {
		n = 1
	}
	for i := 0; i < n; i++ {
		delta := &pb.Delta{Text: "x", TokenIds: []uint32{uint32(i)}}
		if i == 0 {
			delta.Reasoning = "thought " // as a server with --reasoning-parser sends a chat answer's thought
		}
		if err := send(&pb.GenerateResponse{Frame: &pb.GenerateResponse_Delta{Delta: delta}}); err != nil {
			return err
		}
	}
	if f.deltas < 0 {
		<-out.Context().Done()
		f.cancelOnce.Do(func() { close(f.cancelled) })
		return status.Error(codes.Canceled, "client went away")
	}
	final := &pb.Final{FinishReason: pb.FinishReason_FINISH_REASON_MAX_TOKENS}
	return send(&pb.GenerateResponse{Frame: &pb.GenerateResponse_Final{Final: final}})
}

func fakeClient(t *testing.T, deltas int) (*Client, *fakeService) {
	t.Helper()
	lis := bufconn.Listen(1 << 20)
	srv := grpc.NewServer()
	svc := &fakeService{deltas: deltas, cancelled: make(chan struct{})}
	pb.RegisterGenerationServiceServer(srv, svc)
	go srv.Serve(lis) //nolint:errcheck // ends with Stop below
	dialer := func(ctx context.Context, _ string) (net.Conn, error) { return lis.Dial() }
	c, err := Dial(context.Background(), "bufnet", WithInsecure(), WithDialOptions(grpc.WithContextDialer(dialer)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close(); srv.Stop() })
	return c, svc
}

func generate(t *testing.T, c *Client) *Stream {
	t.Helper()
	s, err := c.Generate(context.Background(), &pb.GenerateRequest{Input: &pb.GenerateRequest_Text{Text: "hi"}})
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func wantCode(t *testing.T, err error, code codes.Code) {
	t.Helper()
	if e, ok := AsError(err); !ok || e.Code != code {
		t.Fatalf("want %s, got %v", StatusName(code), err)
	}
}

func TestFramesToTheEndThenErrIsNil(t *testing.T) {
	c, _ := fakeClient(t, 5)
	s := generate(t, c)
	n := 0
	for range s.Frames() {
		n++
	}
	if n != 7 || s.Err() != nil || s.Started().GetRequestId() != "fake-1" {
		t.Fatalf("frames=%d err=%v started=%v", n, s.Err(), s.Started())
	}
	s.Close()
	if s.Err() != nil {
		t.Fatalf("Close after a complete stream must not turn it into an error: %v", s.Err())
	}
}

func TestBreakOutOfFramesThenCloseThenErrIsCancelled(t *testing.T) {
	c, svc := fakeClient(t, -1)
	s := generate(t, c)
	for frame := range s.Frames() {
		if frame.GetDelta() != nil {
			break
		}
	}
	s.Close()
	wantCode(t, s.Err(), codes.Canceled)
	if !errors.Is(s.Err(), context.Canceled) || s.Started().GetRequestId() != "fake-1" {
		t.Fatalf("err=%v started=%v", s.Err(), s.Started())
	}
	select {
	case <-svc.cancelled:
	case <-time.After(30 * time.Second):
		t.Fatal("the server never saw the cancel")
	}
}

func TestCloseFromAnotherGoroutineEndsFrames(t *testing.T) {
	c, _ := fakeClient(t, -1)
	s := generate(t, c)
	var wg sync.WaitGroup
	frames := s.Frames()
	<-frames // Started
	wg.Add(2)
	go func() { defer wg.Done(); s.Close() }()
	go func() { defer wg.Done(); _ = s.Started(); _ = s.Err(); _ = s.RequestID() }()
	for range frames {
	}
	wg.Wait()
	wantCode(t, s.Err(), codes.Canceled)
}

func TestRecvToEOFAndRecvThenClose(t *testing.T) {
	c, _ := fakeClient(t, 3)
	s := generate(t, c)
	res, err := Collect(s)
	if err != nil || len(res.Completions) != 1 || res.Completions[0].Text != "xxx" || s.Err() != nil {
		t.Fatalf("res=%+v err=%v streamErr=%v", res, err, s.Err())
	}
	if _, err := s.Recv(); err != io.EOF {
		t.Fatalf("Recv after the end: %v", err)
	}

	c2, _ := fakeClient(t, -1)
	s2 := generate(t, c2)
	if _, err := s2.Recv(); err != nil {
		t.Fatal(err)
	}
	s2.Close()
	s2.Close()
	wantCode(t, s2.Err(), codes.Canceled)
	_, err = s2.Recv()
	wantCode(t, err, codes.Canceled)
}

func TestCloseBeforeReadingAndCallerCancel(t *testing.T) {
	c, _ := fakeClient(t, -1)
	s := generate(t, c)
	s.Close()
	if _, ok := <-s.Frames(); ok {
		t.Fatal("Frames after Close must be closed at once")
	}
	wantCode(t, s.Err(), codes.Canceled)
	if s.Started() != nil {
		t.Fatal("no Started frame was read")
	}

	ctx, cancel := context.WithCancel(context.Background())
	s2, err := c.Generate(ctx, &pb.GenerateRequest{Input: &pb.GenerateRequest_Text{Text: "hi"}})
	if err != nil {
		t.Fatal(err)
	}
	frames := s2.Frames()
	<-frames
	cancel()
	for range frames {
	}
	wantCode(t, s2.Err(), codes.Canceled)
	s2.Close()
}

func TestCollectKeepsTheThoughtApartFromTheText(t *testing.T) {
	c, _ := fakeClient(t, 3)
	res, err := Collect(generate(t, c))
	if err != nil {
		t.Fatal(err)
	}
	got := res.Completions[0]
	if got.Text != "xxx" || got.Reasoning != "thought " || len(got.TokenIDs) != 3 || got.Final == nil {
		t.Fatalf("collected %+v", got)
	}
}
