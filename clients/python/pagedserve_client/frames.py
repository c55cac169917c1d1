"""Frame bookkeeping shared by the sync and asyncio streams: Started/Final/Heartbeat recorded, Deltas passed on."""

from __future__ import annotations

from pagedserve.client.types import Completion, Delta, Final, Started
from pagedserve.v1 import generate_pb2 as pb


class FrameReader:
    def __init__(self) -> None:
        self.started: Started | None = None
        self.completions: dict[int, Completion] = {}
        self.heartbeats = 0

    def read(self, frame: pb.GenerateResponse) -> Delta | None:
        """Records the frame; returns it as a Delta when it is one."""
        kind = frame.WhichOneof("frame")
        if kind == "started":
            self.started = Started.from_proto(frame.started)
        elif kind == "delta":
            delta = Delta.from_proto(frame.index, frame.delta)
            self._completion(frame.index).add(delta)
            return delta
        elif kind == "final":
            self._completion(frame.index).final = Final.from_proto(frame.index, frame.final)
        elif kind == "heartbeat":
            self.heartbeats += 1
        return None

    @property
    def finals(self) -> dict[int, Final]:
        return {i: c.final for i, c in self.completions.items() if c.final is not None}

    def results(self) -> list[Completion]:
        return [self.completions[i] for i in sorted(self.completions)]

    def _completion(self, index: int) -> Completion:
        if index not in self.completions:
            self.completions[index] = Completion(index)
        return self.completions[index]
