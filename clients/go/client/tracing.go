package client

import (
	"context"

	"google.golang.org/grpc/metadata"
)

// WithTraceContext returns ctx carrying a W3C trace context for the calls made with it: the server makes its span
// for each request a child of traceparent (tracestate is optional). Pass the current span's values from whatever
// tracer the application uses; the client itself depends on none. An empty traceparent returns ctx unchanged.
func WithTraceContext(ctx context.Context, traceparent, tracestate string) context.Context {
	if traceparent == "" {
		return ctx
	}
	kv := []string{"traceparent", traceparent}
	if tracestate != "" {
		kv = append(kv, "tracestate", tracestate)
	}
	return metadata.AppendToOutgoingContext(ctx, kv...)
}
