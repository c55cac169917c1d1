package client

import (
	"context"
	"errors"
	"fmt"
	"io"
	"regexp"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// Error is what every Client call returns on failure: the gRPC status plus, for INVALID_ARGUMENT (and NOT_FOUND:
// an unknown LoRA adapter), the request field the server rejected. status.Code(err) and status.FromError(err) work on it unchanged.
type Error struct {
	Code    codes.Code
	Message string
	// Field is the request field path the server named (for example "sampling.temperature"), or "".
	Field string
	// Violations lists every field the server rejected with its reason, when it sent them.
	Violations []FieldViolation
	status     *status.Status
}

// FieldViolation is one rejected request field.
type FieldViolation struct {
	Field       string
	Description string
}

func (e *Error) Error() string {
	if e.Field != "" {
		return fmt.Sprintf("pagedserve: %s (field %s): %s", StatusName(e.Code), e.Field, e.Message)
	}
	return fmt.Sprintf("pagedserve: %s: %s", StatusName(e.Code), e.Message)
}

// GRPCStatus lets grpc's status package see through the wrapper.
func (e *Error) GRPCStatus() *status.Status { return e.status }

// Is makes errors.Is(err, context.Canceled) and errors.Is(err, context.DeadlineExceeded) hold for the
// matching gRPC codes, whichever side ended the call.
func (e *Error) Is(target error) bool {
	switch target {
	case context.Canceled:
		return e.Code == codes.Canceled
	case context.DeadlineExceeded:
		return e.Code == codes.DeadlineExceeded
	}
	return false
}

// AsError returns err as an *Error when it is one (or wraps one).
func AsError(err error) (*Error, bool) {
	var e *Error
	ok := errors.As(err, &e)
	return e, ok
}

// StatusName spells a code the way the gRPC spec and other languages do: INVALID_ARGUMENT, CANCELLED.
func StatusName(c codes.Code) string {
	if name, ok := statusNames[c]; ok {
		return name
	}
	return fmt.Sprintf("CODE(%d)", uint32(c))
}

var statusNames = map[codes.Code]string{
	codes.OK: "OK", codes.Canceled: "CANCELLED", codes.Unknown: "UNKNOWN",
	codes.InvalidArgument: "INVALID_ARGUMENT", codes.DeadlineExceeded: "DEADLINE_EXCEEDED",
	codes.NotFound: "NOT_FOUND", codes.AlreadyExists: "ALREADY_EXISTS", codes.PermissionDenied: "PERMISSION_DENIED",
	codes.ResourceExhausted: "RESOURCE_EXHAUSTED", codes.FailedPrecondition: "FAILED_PRECONDITION",
	codes.Aborted: "ABORTED", codes.OutOfRange: "OUT_OF_RANGE", codes.Unimplemented: "UNIMPLEMENTED",
	codes.Internal: "INTERNAL", codes.Unavailable: "UNAVAILABLE", codes.DataLoss: "DATA_LOSS",
	codes.Unauthenticated: "UNAUTHENTICATED",
}

// wrapError turns any error from a gRPC call into *Error; nil and io.EOF pass through untouched.
func wrapError(err error) error {
	if err == nil || err == io.EOF {
		return err
	}
	if _, ok := AsError(err); ok {
		return err
	}
	st, ok := status.FromError(err)
	if !ok {
		st = status.FromContextError(err)
	}
	e := &Error{Code: st.Code(), Message: st.Message(), status: st}
	for _, d := range st.Details() {
		if br, ok := d.(*errdetails.BadRequest); ok {
			for _, v := range br.GetFieldViolations() {
				e.Violations = append(e.Violations, FieldViolation{Field: v.GetField(), Description: v.GetDescription()})
			}
		}
	}
	if len(e.Violations) == 0 && (e.Code == codes.InvalidArgument || e.Code == codes.NotFound) {
		// Without google.rpc.BadRequest details the server's description starts with "field.path: reason".
		if m := fieldPrefix.FindStringSubmatch(e.Message); m != nil {
			e.Violations = []FieldViolation{{Field: m[1], Description: m[2]}}
		}
	}
	if len(e.Violations) > 0 {
		e.Field = e.Violations[0].Field
	}
	return e
}

// fieldPrefix matches "sampling.top_p: must be in (0, 1]" and "stopping.stop_sequences[2]: too long".
var fieldPrefix = regexp.MustCompile(`(?s)^([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*|\[[0-9]+\])*): (.*)$`)
