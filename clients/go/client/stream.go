package client

import (
	"context"
	"io"
	"strings"
	"sync"

	pb "github.com/pagedserve/pagedserve/clients/go/pagedservev1"
)

// Stream is one Generate call in flight. Use either Recv or Frames, not both.
type Stream struct {
	ctx    context.Context
	cancel context.CancelFunc
	inner  pb.GenerationService_GenerateClient

	started   *pb.Started
	err       error
	frames    chan *pb.GenerateResponse
	framesRun sync.Once
}

func newStream(ctx context.Context, cancel context.CancelFunc, inner pb.GenerationService_GenerateClient) *Stream {
	return &Stream{ctx: ctx, cancel: cancel, inner: inner}
}

// Recv returns the next frame, io.EOF after the last one, or an *Error.
func (s *Stream) Recv() (*pb.GenerateResponse, error) {
	if s.err != nil {
		return nil, s.err
	}
	frame, err := s.inner.Recv()
	if err != nil {
		// Release the context's resources; the call is over either way.
		s.cancel()
		s.err = wrapError(err)
		return nil, s.err
	}
	if st := frame.GetStarted(); st != nil {
		s.started = st
	}
	return frame, nil
}

// Frames delivers the frames on a channel that is closed when the stream ends; then check Err.
// Breaking out of the range early must be followed by Close, which stops the request on the server.
func (s *Stream) Frames() <-chan *pb.GenerateResponse {
	s.framesRun.Do(func() {
		s.frames = make(chan *pb.GenerateResponse)
		go s.pump()
	})
	return s.frames
}

func (s *Stream) pump() {
	defer close(s.frames)
	for {
		frame, err := s.Recv()
		if err != nil {
			return
		}
		select {
		case s.frames <- frame:
		case <-s.ctx.Done():
			// The reader went away (Close or ctx cancelled); record why and stop.
			s.err = wrapError(s.ctx.Err())
			return
		}
	}
}

// Err is the error that ended the stream: nil after a normal end, else an *Error.
func (s *Stream) Err() error {
	if s.err == io.EOF {
		return nil
	}
	return s.err
}

// Close cancels the call if it is still running; the server aborts the request and frees its KV blocks.
func (s *Stream) Close() { s.cancel() }

// Started is the stream's Started frame once it has been received, else nil.
func (s *Stream) Started() *pb.Started { return s.started }

// RequestID is the server's id for this request (from the response headers, else the Started frame).
func (s *Stream) RequestID() string {
	if md, err := s.inner.Header(); err == nil {
		if ids := md.Get("x-request-id"); len(ids) > 0 {
			return ids[0]
		}
	}
	return s.started.GetRequestId()
}

// Completion is one generated sequence (index i of n).
type Completion struct {
	Text     string
	TokenIDs []uint32
	Final    *pb.Final
}

// Result is a whole Generate call, collected.
type Result struct {
	Started     *pb.Started
	Completions []Completion
}

// Collect reads a stream to its end.
func Collect(s *Stream) (*Result, error) {
	texts := map[uint32]*strings.Builder{}
	res := &Result{}
	for {
		frame, err := s.Recv()
		if err == io.EOF {
			break
		}
		if err != nil {
			return nil, err
		}
		i := int(frame.GetIndex())
		for len(res.Completions) <= i {
			res.Completions = append(res.Completions, Completion{})
			texts[uint32(len(res.Completions)-1)] = &strings.Builder{}
		}
		if d := frame.GetDelta(); d != nil {
			texts[uint32(i)].WriteString(d.GetText())
			res.Completions[i].TokenIDs = append(res.Completions[i].TokenIDs, d.GetTokenIds()...)
		}
		if f := frame.GetFinal(); f != nil {
			res.Completions[i].Final = f
		}
	}
	res.Started = s.Started()
	for i := range res.Completions {
		res.Completions[i].Text = texts[uint32(i)].String()
	}
	return res, nil
}
