package client

import (
	"context"
	"io"
	"sync"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "github.com/pagedserve/pagedserve/clients/go/pagedservev1"
)

// Stream is one Generate call in flight. Read it with Recv or with Frames, not both, and from one goroutine.
// Close, Err, Started and RequestID are safe from any goroutine at any time, including while Frames runs.
//
// Documented orders (all tested under the race detector):
//   - range Frames to its end, then Err: nil after a complete stream, else the *Error that ended it;
//   - break out of Frames (or stop calling Recv) early, Close, then Err: CANCELLED;
//   - Recv until io.EOF (Err is nil) or an *Error (Err returns the same error);
//   - Close from another goroutine while Frames runs: the channel closes and Err is CANCELLED.
type Stream struct {
	ctx    context.Context
	cancel context.CancelFunc
	inner  pb.GenerationService_GenerateClient

	mu      sync.Mutex
	started *pb.Started
	err     error // io.EOF after a complete stream, else the *Error that ended it; nil while running

	framesOnce sync.Once
	frames     chan *pb.GenerateResponse
	pumpDone   chan struct{} // closed when the Frames goroutine has exited; nil when Frames was never called
}

func newStream(ctx context.Context, cancel context.CancelFunc, inner pb.GenerationService_GenerateClient) *Stream {
	return &Stream{ctx: ctx, cancel: cancel, inner: inner}
}

// Recv returns the next frame, io.EOF after the last one, or an *Error.
func (s *Stream) Recv() (*pb.GenerateResponse, error) {
	if err := s.end(); err != nil {
		return nil, err
	}
	frame, err := s.inner.Recv()
	if err != nil {
		// Release the context's resources; the call is over either way.
		s.cancel()
		return nil, s.finish(wrapError(err))
	}
	if st := frame.GetStarted(); st != nil {
		s.mu.Lock()
		s.started = st
		s.mu.Unlock()
	}
	return frame, nil
}

// Frames delivers the frames on a channel that is closed when the stream ends; then check Err.
// Breaking out of the range early must be followed by Close, which stops the request on the server.
func (s *Stream) Frames() <-chan *pb.GenerateResponse {
	s.framesOnce.Do(func() {
		s.mu.Lock()
		s.frames = make(chan *pb.GenerateResponse)
		s.pumpDone = make(chan struct{})
		s.mu.Unlock()
		go s.pump()
	})
	return s.frames
}

func (s *Stream) pump() {
	defer close(s.pumpDone)
	defer close(s.frames)
	for {
		frame, err := s.Recv()
		if err != nil {
			return
		}
		select {
		case s.frames <- frame:
		case <-s.ctx.Done():
			// The reader went away (Close, or the caller's context ended); record why and stop.
			s.finish(wrapError(s.ctx.Err()))
			return
		}
	}
}

// Err is the error that ended the stream: nil after a complete stream (or while it is still running), else an
// *Error. After Close on a stream that had not ended, it is CANCELLED.
func (s *Stream) Err() error {
	if err := s.end(); err != io.EOF {
		return err
	}
	return nil
}

// Close cancels the call if it is still running (the server aborts the request and frees its KV blocks) and
// waits for the Frames goroutine, if any, to exit. Calling it more than once, or after the end, is harmless.
func (s *Stream) Close() {
	s.finish(status.Error(codes.Canceled, "pagedserve: stream closed by the client before its end"))
	s.cancel()
	s.mu.Lock()
	done := s.pumpDone
	s.mu.Unlock()
	if done != nil {
		<-done
	}
}

// Started is the stream's Started frame once it has been received, else nil.
func (s *Stream) Started() *pb.Started {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.started
}

// RequestID is the server's id for this request (from the response headers, else the Started frame).
func (s *Stream) RequestID() string {
	if md, err := s.inner.Header(); err == nil {
		if ids := md.Get("x-request-id"); len(ids) > 0 {
			return ids[0]
		}
	}
	return s.Started().GetRequestId()
}

// end is the recorded outcome: nil while the stream runs.
func (s *Stream) end() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.err
}

// finish records the first outcome and returns the one that stands (a later one never overwrites it).
func (s *Stream) finish(err error) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.err == nil {
		s.err = wrapError(err)
	}
	return s.err
}
