package client

import (
	"context"
	"net"
	"sync/atomic"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/test/bufconn"

	pb "github.com/pagedserve/pagedserve/clients/go/pagedservev1"
)

// countingService answers every Generate with a Final frame and counts the calls it served.
type countingService struct {
	pb.UnimplementedGenerationServiceServer
	calls int32
}

func (c *countingService) Generate(req *pb.GenerateRequest, out pb.GenerationService_GenerateServer) error {
	atomic.AddInt32(&c.calls, 1)
	return out.Send(&pb.GenerateResponse{Frame: &pb.GenerateResponse_Final{Final: &pb.Final{}}})
}

func TestAddressListSpreadsCallsRoundRobin(t *testing.T) {
	listeners := map[string]*bufconn.Listener{}
	services := map[string]*countingService{}
	for _, addr := range []string{"10.0.0.1:50051", "10.0.0.2:50051"} {
		lis, svc, srv := bufconn.Listen(1<<20), &countingService{}, grpc.NewServer()
		pb.RegisterGenerationServiceServer(srv, svc)
		go srv.Serve(lis) //nolint:errcheck // ends with Stop below
		t.Cleanup(srv.Stop)
		listeners[addr], services[addr] = lis, svc
	}
	dialer := func(ctx context.Context, addr string) (net.Conn, error) { return listeners[addr].Dial() }
	c, err := Dial(context.Background(), "ipv4:10.0.0.1:50051,10.0.0.2:50051", WithInsecure(),
		WithDialOptions(grpc.WithContextDialer(dialer), grpc.WithBlock()))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	for i := 0; i < 32; i++ {
		if _, err := c.Complete(context.Background(), &pb.GenerateRequest{}); err != nil {
			t.Fatal(err)
		}
	}
	for addr, svc := range services {
		// Both connections are up after the first few calls; round_robin then alternates strictly.
		if n := atomic.LoadInt32(&svc.calls); n < 8 {
			t.Errorf("%s served %d of 32 calls", addr, n)
		}
	}
}

func TestAddressListRejectsEmptyEntriesAndPolicyNames(t *testing.T) {
	if _, err := Dial(context.Background(), "ipv4:10.0.0.1:1,", WithInsecure()); err == nil {
		t.Error("an empty address must be an error")
	}
	if _, err := Dial(context.Background(), "x:1", WithInsecure(), WithLoadBalancingPolicy("random")); err == nil {
		t.Error("an unknown policy must be an error")
	}
}
