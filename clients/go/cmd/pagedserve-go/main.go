// Command pagedserve-go streams one completion from a pagedserve server to stdout.
//
//	pagedserve-go -addr localhost:50051 -plaintext -prompt "The capital of France is" -max-new-tokens 32
//
// Ctrl-C cancels the request (the server frees it at once). Errors print their gRPC status and, for
// INVALID_ARGUMENT, the offending request field; the exit status is 1.
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strconv"
	"time"

	"github.com/pagedserve/pagedserve/clients/go/client"
	pb "github.com/pagedserve/pagedserve/clients/go/pagedservev1"
	"google.golang.org/protobuf/proto"
)

type flags struct {
	addr, prompt, temperature, ca, cert, key, serverName string
	maxNewTokens                                         uint
	timeout                                              time.Duration
	plaintext                                            bool
}

func parseFlags() flags {
	var f flags
	flag.StringVar(&f.addr, "addr", "localhost:50051", "server address")
	flag.StringVar(&f.prompt, "prompt", "Hello", "prompt text")
	flag.UintVar(&f.maxNewTokens, "max-new-tokens", 64, "tokens to generate at most")
	flag.StringVar(&f.temperature, "temperature", "", "sampling temperature (0 = greedy; empty = server default)")
	flag.DurationVar(&f.timeout, "timeout", 60*time.Second, "deadline for the whole request")
	flag.BoolVar(&f.plaintext, "plaintext", false, "connect without TLS")
	flag.StringVar(&f.ca, "ca", "", "PEM CA bundle to verify the server (default: system roots)")
	flag.StringVar(&f.cert, "cert", "", "PEM client certificate for mutual TLS")
	flag.StringVar(&f.key, "key", "", "PEM client key for mutual TLS")
	flag.StringVar(&f.serverName, "server-name", "", "TLS server name override")
	flag.Parse()
	return f
}

func buildRequest(f flags) (*pb.GenerateRequest, error) {
	req := &pb.GenerateRequest{
		Input:    &pb.GenerateRequest_Text{Text: f.prompt},
		Stopping: &pb.StoppingOptions{MaxNewTokens: proto.Uint32(uint32(f.maxNewTokens))},
	}
	if f.temperature != "" {
		t, err := strconv.ParseFloat(f.temperature, 32)
		if err != nil {
			return nil, fmt.Errorf("-temperature: %w", err)
		}
		req.Sampling = &pb.SamplingOptions{Temperature: proto.Float32(float32(t))}
	}
	return req, nil
}

func run(ctx context.Context, f flags) error {
	transport := client.WithMTLS(f.ca, f.cert, f.key, f.serverName)
	if f.plaintext {
		transport = client.WithInsecure()
	}
	c, err := client.Dial(ctx, f.addr, transport)
	if err != nil {
		return err
	}
	defer c.Close()
	req, err := buildRequest(f)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, f.timeout)
	defer cancel()
	stream, err := c.Generate(ctx, req)
	if err != nil {
		return err
	}
	defer stream.Close()
	for {
		frame, err := stream.Recv()
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return err
		}
		fmt.Print(frame.GetDelta().GetText())
		if fin := frame.GetFinal(); fin != nil {
			fmt.Fprintf(os.Stderr, "\n[%s, %d prompt + %d generated tokens]\n", fin.GetFinishReason(),
				fin.GetUsage().GetPromptTokens(), fin.GetUsage().GetCompletionTokens())
		}
	}
}

func main() {
	f := parseFlags()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	if err := run(ctx, f); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}
