package client

import (
	"encoding/json"
	"errors"
	"fmt"

	pb "github.com/pagedserve/pagedserve/clients/go/pagedservev1"
)

// Structured outputs: set GenerateRequest.Constraint to one of these and the completion's text follows it. The
// server compiles the spec; one it cannot compile is INVALID_ARGUMENT naming `constraint.<kind>` (Error.Field).

// JSONSchema constrains the output to one JSON value valid against schema: JSON text (string, []byte or
// json.RawMessage) or any value encoding/json marshals (a map, a struct with json tags).
func JSONSchema(schema any) (*pb.Constraint, error) {
	text, err := jsonText(schema)
	if err != nil {
		return nil, fmt.Errorf("pagedserve: JSON schema: %w", err)
	}
	return &pb.Constraint{Kind: &pb.Constraint_JsonSchema{JsonSchema: text}}, nil
}

// JSONObject constrains the output to any JSON object.
func JSONObject() *pb.Constraint {
	return &pb.Constraint{Kind: &pb.Constraint_JsonObject{JsonObject: &pb.JsonObject{}}}
}

// Regex constrains the whole output to match pattern.
func Regex(pattern string) *pb.Constraint {
	return &pb.Constraint{Kind: &pb.Constraint_Regex{Regex: pattern}}
}

// Grammar constrains the output to a sentence of a grammar: Lark (its start rule) or GBNF (root ::= ...).
func Grammar(ebnf string) *pb.Constraint {
	return &pb.Constraint{Kind: &pb.Constraint_Grammar{Grammar: ebnf}}
}

// Choice constrains the output to exactly one of choices.
func Choice(choices ...string) *pb.Constraint {
	return &pb.Constraint{Kind: &pb.Constraint_Choice{Choice: &pb.Choices{Choices: choices}}}
}

// StructuralTag allows free text until a trigger, then a tagged JSON segment: vLLM's format
// {"structures": [{"begin", "schema", "end"}], "triggers": [...]}, as JSON text or a value encoding/json marshals.
func StructuralTag(tag any) (*pb.Constraint, error) {
	text, err := jsonText(tag)
	if err != nil {
		return nil, fmt.Errorf("pagedserve: structural tag: %w", err)
	}
	return &pb.Constraint{Kind: &pb.Constraint_StructuralTag{StructuralTag: text}}, nil
}

func jsonText(value any) (string, error) {
	var text []byte
	switch v := value.(type) {
	case string:
		text = []byte(v)
	case []byte:
		text = v
	case json.RawMessage:
		text = v
	default:
		encoded, err := json.Marshal(v)
		if err != nil {
			return "", err
		}
		text = encoded
	}
	if !json.Valid(text) {
		return "", errors.New("not valid JSON")
	}
	return string(text), nil
}
