package client

import (
	"io"
	"strings"

	pb "github.com/pagedserve/pagedserve/clients/go/pagedservev1"
)

// Completion is one generated sequence (index i of n).
type Completion struct {
	Text string
	// Reasoning is a reasoning model's thought, apart from Text (a server started with --reasoning-parser, chat input).
	Reasoning string
	TokenIDs  []uint32
	Final     *pb.Final
}

// Result is a whole Generate call, collected.
type Result struct {
	Started     *pb.Started
	Completions []Completion
}

// Collect reads a stream to its end.
func Collect(s *Stream) (*Result, error) {
	texts, thoughts := map[uint32]*strings.Builder{}, map[uint32]*strings.Builder{}
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
			thoughts[uint32(len(res.Completions)-1)] = &strings.Builder{}
		}
		if d := frame.GetDelta(); d != nil {
			texts[uint32(i)].WriteString(d.GetText())
			thoughts[uint32(i)].WriteString(d.GetReasoning())
			res.Completions[i].TokenIDs = append(res.Completions[i].TokenIDs, d.GetTokenIds()...)
		}
		if f := frame.GetFinal(); f != nil {
			res.Completions[i].Final = f
		}
	}
	res.Started = s.Started()
	for i := range res.Completions {
		res.Completions[i].Text = texts[uint32(i)].String()
		res.Completions[i].Reasoning = thoughts[uint32(i)].String()
	}
	return res, nil
}
