// Package client is a small, idiomatic Go client for the pagedserve GenerationService.
//
//	c, err := client.Dial(ctx, "localhost:50051", client.WithInsecure())
//	stream, err := c.Generate(ctx, &pb.GenerateRequest{Input: &pb.GenerateRequest_Text{Text: "Hi"}})
//	for frame := range stream.Frames() { fmt.Print(frame.GetDelta().GetText()) }
//	if err := stream.Err(); err != nil { ... } // *client.Error with the gRPC status and field name
//
// Cancelling ctx (or calling Stream.Close) aborts the request on the server, which frees its KV cache at once.
package client

import (
	"context"
	"time"

	"google.golang.org/grpc"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	pb "github.com/pagedserve/pagedserve/clients/go/pagedservev1"
)

// Client wraps one gRPC connection; it is safe for concurrent use by many goroutines and streams.
type Client struct {
	conn           *grpc.ClientConn
	owned          bool
	api            pb.GenerationServiceClient
	adapters       pb.AdapterServiceClient
	health         healthpb.HealthClient
	defaultTimeout time.Duration
}

// Dial connects to target: "host:port", "dns:///name:port" (every address the name resolves to, e.g. a
// Kubernetes headless Service), an address list "ipv4:10.0.0.1:50051,10.0.0.2:50051" (or "ipv6:..."), or any
// gRPC target string. Calls are spread round-robin over the resolved addresses unless WithLoadBalancingPolicy
// says otherwise. One transport option is required. The connection is established lazily; the first call
// waits for it within its own deadline.
func Dial(ctx context.Context, target string, opts ...Option) (*Client, error) {
	var o options
	for _, opt := range opts {
		if err := opt(&o); err != nil {
			return nil, err
		}
	}
	dial, err := o.grpcDialOptions()
	if err != nil {
		return nil, err
	}
	target, resolve, err := resolveTarget(target)
	if err != nil {
		return nil, err
	}
	conn, err := grpc.DialContext(ctx, target, append(dial, resolve...)...)
	if err != nil {
		return nil, wrapError(err)
	}
	c := New(conn)
	c.owned = true
	c.defaultTimeout = o.defaultTimeout
	return c, nil
}

// New wraps a connection the caller already manages; Close then leaves it open.
func New(conn *grpc.ClientConn) *Client {
	return &Client{conn: conn, api: pb.NewGenerationServiceClient(conn), adapters: pb.NewAdapterServiceClient(conn),
		health: healthpb.NewHealthClient(conn)}
}

// Close closes the connection when Dial opened it.
func (c *Client) Close() error {
	if !c.owned {
		return nil
	}
	return c.conn.Close()
}

// API exposes the generated stub for calls this package does not wrap.
func (c *Client) API() pb.GenerationServiceClient { return c.api }

// Generate starts a streaming generation. Read it with Recv or range over Frames; the stream ends at the
// last Final frame. Errors (including INVALID_ARGUMENT for a bad request) surface from Recv / Err.
func (c *Client) Generate(ctx context.Context, req *pb.GenerateRequest, opts ...grpc.CallOption) (*Stream, error) {
	ctx, cancel := c.callContext(ctx)
	inner, err := c.api.Generate(ctx, req, opts...)
	if err != nil {
		cancel()
		return nil, wrapError(err)
	}
	return newStream(ctx, cancel, inner), nil
}

// Complete runs Generate to the end and returns every completion's text, tokens and final frame.
func (c *Client) Complete(ctx context.Context, req *pb.GenerateRequest, opts ...grpc.CallOption) (*Result, error) {
	stream, err := c.Generate(ctx, req, opts...)
	if err != nil {
		return nil, err
	}
	defer stream.Close()
	return Collect(stream)
}

// Tokenize runs the server's tokenizer.
func (c *Client) Tokenize(ctx context.Context, req *pb.TokenizeRequest, opts ...grpc.CallOption) (*pb.TokenizeResponse, error) {
	ctx, cancel := c.callContext(ctx)
	defer cancel()
	resp, err := c.api.Tokenize(ctx, req, opts...)
	return resp, wrapError(err)
}

// Embed returns one vector per input, in order, from an embedding model's server (ModelInfo's Runner is
// "pooling"); a server that generates answers codes.Unimplemented.
func (c *Client) Embed(ctx context.Context, req *pb.EmbedRequest, opts ...grpc.CallOption) (*pb.EmbedResponse, error) {
	ctx, cancel := c.callContext(ctx)
	defer cancel()
	resp, err := c.api.Embed(ctx, req, opts...)
	return resp, wrapError(err)
}

// Rerank returns the documents' indices and scores, best first, by the cosine similarity of each document's
// embedding and the query's (TopN of them; 0: all), from an embedding model's server.
func (c *Client) Rerank(ctx context.Context, req *pb.RerankRequest, opts ...grpc.CallOption) (*pb.RerankResponse, error) {
	ctx, cancel := c.callContext(ctx)
	defer cancel()
	resp, err := c.api.Rerank(ctx, req, opts...)
	return resp, wrapError(err)
}

// ModelInfo returns the served model, its limits and live KV-cache / scheduler counts.
func (c *Client) ModelInfo(ctx context.Context, opts ...grpc.CallOption) (*pb.ModelInfoResponse, error) {
	ctx, cancel := c.callContext(ctx)
	defer cancel()
	resp, err := c.api.ModelInfo(ctx, &pb.ModelInfoRequest{}, opts...)
	return resp, wrapError(err)
}

// Health asks the standard grpc.health.v1 service; service "" means the whole server.
func (c *Client) Health(ctx context.Context, service string) (healthpb.HealthCheckResponse_ServingStatus, error) {
	ctx, cancel := c.callContext(ctx)
	defer cancel()
	resp, err := c.health.Check(ctx, &healthpb.HealthCheckRequest{Service: service})
	if err != nil {
		return healthpb.HealthCheckResponse_UNKNOWN, wrapError(err)
	}
	return resp.GetStatus(), nil
}

// callContext applies the default timeout to contexts that carry no deadline of their own.
func (c *Client) callContext(ctx context.Context) (context.Context, context.CancelFunc) {
	if _, has := ctx.Deadline(); has || c.defaultTimeout <= 0 {
		return context.WithCancel(ctx)
	}
	return context.WithTimeout(ctx, c.defaultTimeout)
}
