package main

import (
	"context"
	"io"
	"strings"
	"sync"
	"time"

	"google.golang.org/protobuf/encoding/protojson"

	"github.com/pagedserve/pagedserve/clients/go/client"
	pb "github.com/pagedserve/pagedserve/clients/go/pagedservev1"
)

type streamResult struct {
	Text           string     `json:"text"`
	TokenIDs       []uint32   `json:"token_ids"`
	TokensReceived int        `json:"tokens_received"`
	FinishReason   string     `json:"finish_reason"`
	RequestID      string     `json:"request_id"`
	Cancelled      bool       `json:"cancelled"`
	Error          *errorJSON `json:"error"`
}

func parseRequest(raw []byte) (*pb.GenerateRequest, error) {
	req := &pb.GenerateRequest{}
	return req, protojson.Unmarshal(raw, req)
}

func withTimeout(ctx context.Context, ms int64) (context.Context, context.CancelFunc) {
	if ms > 0 {
		return context.WithTimeout(ctx, time.Duration(ms)*time.Millisecond)
	}
	return context.WithCancel(ctx)
}

// generate reads with Recv; with cancel_after_tokens it cancels the context after that many tokens
// while keeping the connection open, so the test can watch the server free the request.
func generate(ctx context.Context, c *client.Client, cmd command) streamResult {
	req, err := parseRequest(cmd.Request)
	if err != nil {
		return streamResult{Error: errorOf(err)}
	}
	ctx, cancel := withTimeout(client.WithTraceContext(ctx, cmd.Traceparent, cmd.Tracestate), cmd.TimeoutMs)
	defer cancel()
	var res streamResult
	var text strings.Builder
	stream, err := c.Generate(ctx, req)
	if err != nil {
		return streamResult{Error: errorOf(err)}
	}
	for {
		frame, err := stream.Recv()
		if err != nil {
			if err != io.EOF {
				res.Error = errorOf(err)
			}
			break
		}
		res.record(frame, &text)
		if cmd.CancelAfterTokens > 0 && !res.Cancelled && res.TokensReceived >= cmd.CancelAfterTokens {
			cancel()
			res.Cancelled = true
		}
	}
	res.Text = text.String()
	res.RequestID = stream.RequestID()
	return res
}

func (r *streamResult) record(frame *pb.GenerateResponse, text *strings.Builder) {
	if d := frame.GetDelta(); d != nil {
		text.WriteString(d.GetText())
		r.TokenIDs = append(r.TokenIDs, d.GetTokenIds()...)
		r.TokensReceived += len(d.GetTokenIds())
	}
	if f := frame.GetFinal(); f != nil {
		r.FinishReason = f.GetFinishReason().String()
	}
}

// generateMany runs count streams of the same request at once on the one connection, reading each by
// ranging over Frames.
func generateMany(ctx context.Context, c *client.Client, cmd command) map[string]interface{} {
	req, err := parseRequest(cmd.Request)
	if err != nil {
		return map[string]interface{}{"error": errorOf(err)}
	}
	results := make([]streamResult, cmd.Count)
	var wg sync.WaitGroup
	for i := range results {
		wg.Add(1)
		go func(r *streamResult) {
			defer wg.Done()
			ctx, cancel := withTimeout(ctx, cmd.TimeoutMs)
			defer cancel()
			stream, err := c.Generate(ctx, req)
			if err != nil {
				r.Error = errorOf(err)
				return
			}
			var text strings.Builder
			for frame := range stream.Frames() {
				r.record(frame, &text)
			}
			r.Text, r.RequestID, r.Error = text.String(), stream.RequestID(), errorOf(stream.Err())
		}(&results[i])
	}
	wg.Wait()
	return map[string]interface{}{"results": results}
}
