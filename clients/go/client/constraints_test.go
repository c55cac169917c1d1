package client

import (
	"encoding/json"
	"testing"

	pb "github.com/pagedserve/pagedserve/clients/go/pagedservev1"
	"google.golang.org/protobuf/proto"
)

func TestJSONSchemaTakesTextOrValues(t *testing.T) {
	want := map[string]any{"type": "object", "required": []any{"a"}}
	for _, schema := range []any{`{"type":"object","required":["a"]}`, []byte(`{"required":["a"],"type":"object"}`),
		want} {
		c, err := JSONSchema(schema)
		if err != nil {
			t.Fatal(err)
		}
		var got map[string]any
		if err := json.Unmarshal([]byte(c.GetJsonSchema()), &got); err != nil {
			t.Fatal(err)
		}
		if got["type"] != "object" || len(got["required"].([]any)) != 1 {
			t.Fatalf("schema %v became %q", schema, c.GetJsonSchema())
		}
	}
	if _, err := JSONSchema("{not json"); err == nil {
		t.Fatal("invalid JSON text must be refused before it is sent")
	}
	if _, err := StructuralTag(func() {}); err == nil {
		t.Fatal("a value encoding/json cannot marshal must be refused")
	}
}

func TestConstraintsFillTheOneof(t *testing.T) {
	req := &pb.GenerateRequest{Constraint: Choice("yes", "no")}
	wire, err := proto.Marshal(req)
	if err != nil {
		t.Fatal(err)
	}
	var back pb.GenerateRequest
	if err := proto.Unmarshal(wire, &back); err != nil {
		t.Fatal(err)
	}
	if got := back.GetConstraint().GetChoice().GetChoices(); len(got) != 2 || got[1] != "no" {
		t.Fatalf("choices %v", got)
	}
	if Regex("[a-z]+").GetRegex() != "[a-z]+" || Grammar(`root ::= "a"`).GetGrammar() == "" ||
		JSONObject().GetJsonObject() == nil {
		t.Fatal("a constructor set the wrong member")
	}
}
