// Command pagedserve-conformance drives the client package from the cross-language tests
// (tests/test_clients_go_java.py); the Java client has the same driver with the same protocol.
//
// It holds one client (plaintext, or TLS / mutual TLS with -ca [-cert -key]) (one connection) and reads one JSON command per stdin line, answering one JSON line
// on stdout. Requests arrive as protobuf JSON, so every language sends byte-for-byte the same request.
//
//	{"op":"generate","request":{...},"timeout_ms":500,"cancel_after_tokens":3}
//	{"op":"generate_many","request":{...},"count":16}
//	{"op":"health","service":""}
//	{"op":"list_adapters"} / {"op":"load_adapter","name":"a","path":"/dir/a"} / {"op":"unload_adapter","name":"a"}
//	{"op":"embed","request":{...}} (an EmbedRequest: each input's vector and prompt tokens)
//	{"op":"rerank","request":{...}} (a RerankRequest: the results' indices and scores, best first)
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"

	"github.com/pagedserve/pagedserve/clients/go/client"
)

type command struct {
	Op                string          `json:"op"`
	Request           json.RawMessage `json:"request"`
	TimeoutMs         int64           `json:"timeout_ms"`
	CancelAfterTokens int             `json:"cancel_after_tokens"`
	Count             int             `json:"count"`
	Service           string          `json:"service"`
	Name              string          `json:"name"`
	Path              string          `json:"path"`
	Traceparent       string          `json:"traceparent"`
	Tracestate        string          `json:"tracestate"`
}

type errorJSON struct {
	Code    string `json:"code"`
	Message string `json:"message"`
	Field   string `json:"field"`
}

func errorOf(err error) *errorJSON {
	if err == nil {
		return nil
	}
	if e, ok := client.AsError(err); ok {
		return &errorJSON{Code: client.StatusName(e.Code), Message: e.Message, Field: e.Field}
	}
	return &errorJSON{Code: "CLIENT", Message: err.Error()}
}

func handle(ctx context.Context, c *client.Client, cmd command) interface{} {
	switch cmd.Op {
	case "generate":
		return generate(ctx, c, cmd)
	case "generate_many":
		return generateMany(ctx, c, cmd)
	case "health":
		status, err := c.Health(ctx, cmd.Service)
		return map[string]interface{}{"status": status.String(), "error": errorOf(err)}
	case "list_adapters":
		resp, err := c.ListAdapters(ctx)
		names := []string{}
		for _, a := range resp.GetAdapters() {
			names = append(names, a.GetName())
		}
		return map[string]interface{}{"adapters": names, "runtime_updates": resp.GetRuntimeUpdates(),
			"error": errorOf(err)}
	case "load_adapter":
		a, err := c.LoadAdapter(ctx, cmd.Name, cmd.Path)
		return map[string]interface{}{"name": a.GetName(), "rank": a.GetRank(), "error": errorOf(err)}
	case "unload_adapter":
		return map[string]interface{}{"error": errorOf(c.UnloadAdapter(ctx, cmd.Name))}
	case "embed":
		return embed(ctx, c, cmd)
	case "rerank":
		return rerank(ctx, c, cmd)
	default:
		return map[string]interface{}{"error": &errorJSON{Code: "CLIENT", Message: "unknown op " + cmd.Op}}
	}
}

func main() {
	addr := flag.String("addr", "localhost:50051", "server address")
	ca := flag.String("ca", "", "PEM CA bundle; set to use TLS instead of plaintext")
	cert := flag.String("cert", "", "PEM client certificate (mutual TLS)")
	key := flag.String("key", "", "PEM client key (mutual TLS)")
	flag.Parse()
	transport := client.WithInsecure()
	if *ca != "" {
		transport = client.WithMTLS(*ca, *cert, *key, "")
	}
	ctx := context.Background()
	c, err := client.Dial(ctx, *addr, transport)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	defer c.Close()
	in := bufio.NewScanner(os.Stdin)
	in.Buffer(make([]byte, 1<<20), 1<<26)
	out := json.NewEncoder(os.Stdout)
	for in.Scan() {
		var cmd command
		var reply interface{}
		if err := json.Unmarshal(in.Bytes(), &cmd); err != nil {
			reply = map[string]interface{}{"error": &errorJSON{Code: "CLIENT", Message: err.Error()}}
		} else if cmd.Op == "quit" {
			return
		} else {
			reply = handle(ctx, c, cmd)
		}
		if err := out.Encode(reply); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
	}
}
