package client

import (
	"context"

	"google.golang.org/grpc"

	pb "github.com/pagedserve/pagedserve/clients/go/pagedservev1"
)

// A request picks a LoRA adapter by name: GenerateRequest.Adapter (empty: the base model). An unknown name is
// NOT_FOUND with Field "adapter".

// ListAdapters returns the LoRA adapters the server holds, and whether it accepts runtime loads.
func (c *Client) ListAdapters(ctx context.Context, opts ...grpc.CallOption) (*pb.ListAdaptersResponse, error) {
	ctx, cancel := c.callContext(ctx)
	defer cancel()
	resp, err := c.adapters.ListAdapters(ctx, &pb.ListAdaptersRequest{}, opts...)
	return resp, wrapError(err)
}

// LoadAdapter loads the PEFT folder path (on the server, inside its --allowed-lora-dirs) under name. Servers
// started without --enable-runtime-lora-updates answer FAILED_PRECONDITION.
func (c *Client) LoadAdapter(ctx context.Context, name, path string, opts ...grpc.CallOption) (*pb.Adapter, error) {
	ctx, cancel := c.callContext(ctx)
	defer cancel()
	resp, err := c.adapters.LoadAdapter(ctx, &pb.LoadAdapterRequest{LoraName: name, LoraPath: path}, opts...)
	if err != nil {
		return nil, wrapError(err)
	}
	return resp.GetAdapter(), nil
}

// UnloadAdapter removes an adapter; FAILED_PRECONDITION while requests using it are unfinished.
func (c *Client) UnloadAdapter(ctx context.Context, name string, opts ...grpc.CallOption) error {
	ctx, cancel := c.callContext(ctx)
	defer cancel()
	_, err := c.adapters.UnloadAdapter(ctx, &pb.UnloadAdapterRequest{LoraName: name}, opts...)
	return wrapError(err)
}
