package main

import (
	"context"

	"google.golang.org/protobuf/encoding/protojson"

	"github.com/pagedserve/pagedserve/clients/go/client"
	pb "github.com/pagedserve/pagedserve/clients/go/pagedservev1"
)

// embed sends the command's EmbedRequest and answers each input's vector and prompt tokens, in order.
func embed(ctx context.Context, c *client.Client, cmd command) map[string]interface{} {
	req := &pb.EmbedRequest{}
	if err := protojson.Unmarshal(cmd.Request, req); err != nil {
		return map[string]interface{}{"error": &errorJSON{Code: "CLIENT", Message: err.Error()}}
	}
	resp, err := c.Embed(ctx, req)
	vectors, tokens := [][]float32{}, []uint32{}
	for _, e := range resp.GetEmbeddings() {
		vectors = append(vectors, e.GetValues())
		tokens = append(tokens, e.GetPromptTokens())
	}
	return map[string]interface{}{"embeddings": vectors, "prompt_tokens": tokens, "error": errorOf(err)}
}

// rerank sends the command's RerankRequest and answers the results' indices and scores, best first.
func rerank(ctx context.Context, c *client.Client, cmd command) map[string]interface{} {
	req := &pb.RerankRequest{}
	if err := protojson.Unmarshal(cmd.Request, req); err != nil {
		return map[string]interface{}{"error": &errorJSON{Code: "CLIENT", Message: err.Error()}}
	}
	resp, err := c.Rerank(ctx, req)
	indices, scores := []uint32{}, []float32{}
	for _, r := range resp.GetResults() {
		indices = append(indices, r.GetIndex())
		scores = append(scores, r.GetRelevanceScore())
	}
	return map[string]interface{}{"indices": indices, "scores": scores, "prompt_tokens": resp.GetPromptTokens(),
		"error": errorOf(err)}
}
