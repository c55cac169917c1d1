package client

import (
	"context"
	"errors"
	"io"
	"testing"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

func TestFieldFromBadRequestDetails(t *testing.T) {
	st, err := status.New(codes.InvalidArgument, "bad request").WithDetails(&errdetails.BadRequest{
		FieldViolations: []*errdetails.BadRequest_FieldViolation{
			{Field: "sampling.top_p", Description: "must be in (0, 1]"},
			{Field: "stopping.max_new_tokens", Description: "too many"},
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	e, ok := AsError(wrapError(st.Err()))
	if !ok {
		t.Fatal("wrapError did not return *Error")
	}
	if e.Field != "sampling.top_p" || len(e.Violations) != 2 || e.Violations[1].Field != "stopping.max_new_tokens" {
		t.Fatalf("violations not read from details: %+v", e)
	}
}

func TestFieldFromDescriptionPrefix(t *testing.T) {
	cases := map[string]string{
		"sampling.temperature: must be >= 0, got -1": "sampling.temperature",
		"stopping.stop_sequences[2]: too long":       "stopping.stop_sequences[2]",
		"request_id: 'a' is already in flight":       "request_id",
		"the prompt is empty":                        "",
		"text: line one\nline two":                   "text",
	}
	for msg, want := range cases {
		e, _ := AsError(wrapError(status.Error(codes.InvalidArgument, msg)))
		if e.Field != want {
			t.Errorf("%q: field %q, want %q", msg, e.Field, want)
		}
	}
	// Only INVALID_ARGUMENT descriptions name a request field.
	e, _ := AsError(wrapError(status.Error(codes.Internal, "engine: crashed")))
	if e.Field != "" {
		t.Errorf("INTERNAL error got field %q", e.Field)
	}
}

func TestErrorKeepsStatusAndContextSemantics(t *testing.T) {
	err := wrapError(status.Error(codes.DeadlineExceeded, "deadline"))
	if status.Code(err) != codes.DeadlineExceeded {
		t.Fatalf("status.Code saw %v", status.Code(err))
	}
	if !errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled) {
		t.Fatal("errors.Is does not map DEADLINE_EXCEEDED to context.DeadlineExceeded")
	}
	if wrapError(io.EOF) != io.EOF || wrapError(nil) != nil {
		t.Fatal("io.EOF and nil must pass through")
	}
	for code, want := range map[codes.Code]string{codes.InvalidArgument: "INVALID_ARGUMENT",
		codes.Canceled: "CANCELLED", codes.Code(99): "CODE(99)"} {
		if got := StatusName(code); got != want {
			t.Errorf("StatusName(%d) = %q, want %q", code, got, want)
		}
	}
}
