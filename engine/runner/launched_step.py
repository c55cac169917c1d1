"""A step the runner has started (async scheduling, `ModelRunner.launch`): its tokens are either sampled already
(any step the host samples) or picked on the device and still on their way to the host.

A device-picked step keeps its tokens on the device for the next step's inputs (`PendingFill`) and copies them
to pinned host memory without waiting; `ModelRunner.collect` waits for that copy only. On CPU there is nothing to
wait for: the forward and the picks are done when `launch` returns, and the host tensors are the picks themselves.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.engine.core.scheduler_output import SchedulerOutput
from pagedserve.engine.core.sequence import Sequence
from pagedserve.engine.core.step_output import StepOutput
from pagedserve.engine.runner.device_rows import DeviceRows, HostRows
from pagedserve.engine.runner.step_input import StepInput


@dataclass(frozen=True, slots=True)
class DevicePicks:
    seqs: tuple[Sequence, ...]  # the sampling sequences, in row order
    tokens: torch.Tensor  # [R] int64 where the logits are: each row's token (the next step's pending inputs)
    host: DeviceRows  # the rows' host copies (pinned on CUDA; copied without waiting)
    copied: torch.cuda.Event | None  # recorded after the copies (None on CPU)

    @staticmethod
    def start(seqs: tuple[Sequence, ...], rows: DeviceRows) -> DevicePicks:
        host = rows.to_host()
        copied = None
        if rows.tokens.device.type == "cuda":
            copied = torch.cuda.Event()
            copied.record()
        return DevicePicks(seqs, rows.tokens, host, copied)

    def read(self) -> HostRows:
        """The rows on the host: waits for the copies (and so for the step's forward)."""
        if self.copied is not None:
            self.copied.synchronize()
        return self.host.read()


@dataclass(frozen=True, slots=True)
class LaunchedStep:
    batch: SchedulerOutput
    output: StepOutput | None = None  # sampled on the host: complete when launched
    picks: DevicePicks | None = None  # picked on the device

    @property
    def on_device(self) -> bool:
        return self.picks is not None


@dataclass(frozen=True, slots=True)
class PendingFill:
    """Where a step's pending input tokens come from: `rows` of its token ids take `tokens`, both on the device."""

    rows: torch.Tensor  # [P] int64: indices into the step's token ids
    tokens: torch.Tensor  # [P] int64: the step in flight's picks for those sequences

    @staticmethod
    def of(step: StepInput, inflight: DevicePicks) -> PendingFill:
        row_of = {seq: row for row, seq in enumerate(inflight.seqs)}
        device = inflight.tokens.device
        rows = torch.tensor([index for index, _ in step.pending], dtype=torch.int64).to(device, non_blocking=True)
        source = torch.tensor([row_of[seq] for _, seq in step.pending], dtype=torch.int64).to(device, non_blocking=True)
        return PendingFill(rows, inflight.tokens.index_select(0, source))

    def apply(self, token_ids: torch.Tensor) -> None:
        token_ids.index_copy_(0, self.rows, self.tokens)
