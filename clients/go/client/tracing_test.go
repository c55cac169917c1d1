package client

import (
	"context"
	"testing"

	"google.golang.org/grpc/metadata"
)

func TestWithTraceContextSetsOutgoingMetadata(t *testing.T) {
	const parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
	md, _ := metadata.FromOutgoingContext(WithTraceContext(context.Background(), parent, "vendor=1"))
	if got := md.Get("traceparent"); len(got) != 1 || got[0] != parent {
		t.Fatalf("traceparent = %v", got)
	}
	if got := md.Get("tracestate"); len(got) != 1 || got[0] != "vendor=1" {
		t.Fatalf("tracestate = %v", got)
	}
	if _, ok := metadata.FromOutgoingContext(WithTraceContext(context.Background(), "", "x")); ok {
		t.Fatal("an empty traceparent must leave the context alone")
	}
}
