"""Which decode steps a CUDA graph serves and how their inputs are padded to a captured size: pure functions of the
prepared step (`StepInput`), so the padding rules are tested on CPU; the capture and replay are
`engine/runner/cuda_graphs.py`'s.

A step qualifies when every scheduled sequence computes exactly one token (decode, or a one-token chunk) and no
LoRA adapter has rows in it (the graphs hold the base model's path only); speculative drafts give a sequence more
than one token, so a step with drafts never qualifies. Its rows are padded to the smallest captured size that
holds them: a padded row reads token 0 at position 0 with a context of one key in block 0 (read, never written),
and its KV slot is PAD_SLOT, which the KV write skips, so padding never touches a live block.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.engine.runner.step_input import StepInput

PAD_SLOT = -1  # the KV write skips negative slots (kernels/triton_kv_write.py)
_SMALL_SIZES = (1, 2, 4)  # then multiples of 8: vLLM's capture list
_STRIDE = 8


def capture_sizes(requested: tuple[int, ...], max_num_seqs: int, largest: int) -> tuple[int, ...]:
    """The batch sizes to capture, ascending. `requested` as vLLM's --cuda-graph-sizes reads it: () the default
    (one value: max_num_seqs rounded up to a multiple of 8, at most `largest`), one value N: 1, 2, 4 and the
    multiples of 8 up to N, several: exactly those. A decode batch never has more than max_num_seqs rows, so sizes
    past the first one that holds it are dropped."""
    if not requested:
        requested = (min(-(-max_num_seqs // _STRIDE) * _STRIDE, largest),)
    if len(requested) == 1:
        sizes = sorted({*_SMALL_SIZES, *range(_STRIDE, requested[0] + 1, _STRIDE)})
    else:
        sizes = sorted(set(requested))
    enough = next((s for s in sizes if s >= max_num_seqs), sizes[-1])
    return tuple(s for s in sizes if s <= enough)


def padded_size(rows: int, sizes: tuple[int, ...]) -> int | None:
    """The smallest captured size that holds `rows` (None: more rows than the largest; they run eagerly)."""
    return next((s for s in sizes if s >= rows), None)


@dataclass(frozen=True, slots=True)
class PaddedDecode:
    """One qualifying step's inputs padded to a captured size, as the static buffers take them."""

    size: int  # the captured batch size that replays
    num_rows: int  # the real rows: the first num_rows of every field
    token_ids: list[int]  # [size]
    positions: list[int]  # [size]
    slots: list[int]  # [size]: PAD_SLOT for padded rows
    seq_lens: list[int]  # [size]: a padded row's context is 1 (position 0)
    block_tables: list[list[int]]  # [size][width]: the step's tables (width: the longest), padded rows all 0

    @property
    def width(self) -> int:
        return len(self.block_tables[0])


def qualifies(step: StepInput) -> bool:
    """One token per sequence and no adapter rows: the shape every captured graph has."""
    return bool(step.query_lens) and not step.adapter_spans and all(q == 1 for q in step.query_lens)


def pad_decode(step: StepInput, sizes: tuple[int, ...], max_blocks: int) -> PaddedDecode | None:
    """`step` padded to the smallest captured size that holds it; None when it runs eagerly (it does not qualify,
    has more rows than the largest size, or a block table wider than the static one, `max_blocks`)."""
    if not sizes or not qualifies(step):
        return None
    rows = len(step.query_lens)
    size = padded_size(rows, sizes)
    width = len(step.block_tables[0])
    if size is None or width > max_blocks:
        return None
    pad = size - rows
    return PaddedDecode(
        size=size, num_rows=rows,
        token_ids=step.token_ids + [0] * pad,
        positions=step.positions + [0] * pad,
        slots=step.slots + [PAD_SLOT] * pad,
        seq_lens=step.seq_lens + [1] * pad,
        block_tables=step.block_tables + [[0] * width for _ in range(pad)],
    )
