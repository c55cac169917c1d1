"""The CUDA decode step as CUDA graphs, as vLLM runs it: the model's forward (embedding to final norm) captured once
per batch size of `capture_sizes`, into one memory pool, over static input buffers; a qualifying step
(`graph_inputs.pad_decode`: one token per sequence, no adapter rows) copies its padded inputs into the buffers and
replays the graph of its padded size, and every other step runs eagerly. Logits, sampling and grammar masks stay
outside the graph, on the real rows only.

Capture runs when the attention implementation allows it (`AttentionImpl.cuda_graphs`): at engine start, or, for an
FP8 cache whose scales are calibrated on the first prefill, at the first qualifying step after that. Each size is
run eagerly first (Triton compiles its kernels, cuBLAS its workspace: neither may happen inside a capture); the
warm-up and capture runs write nothing to the cache (every slot is PAD_SLOT) and only read block 0.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass

import torch
from torch import nn

from pagedserve.engine.models.layers import ForwardContext
from pagedserve.engine.runner.graph_inputs import PAD_SLOT, PaddedDecode, pad_decode
from pagedserve.engine.runner.launched_step import PendingFill
from pagedserve.engine.runner.step_input import StepInput
from pagedserve.kernels.attention import AttentionImpl, AttentionMetadata
from pagedserve.kernels.kv_cache import KVCache
from pagedserve.kernels.layer_ops import LayerOps

logger = logging.getLogger(__name__)

_WARMUP_RUNS = 2


@dataclass(frozen=True, slots=True)
class CaptureStats:
    sizes: tuple[int, ...]
    seconds: float
    memory_bytes: int  # what the device's free memory shrank by (the pool, buffers, cuBLAS workspaces)


@dataclass(frozen=True, slots=True)
class GraphModel:
    """What a captured forward runs: the model and the attention it calls, as the eager path has them."""

    model: nn.Module
    kv_cache: KVCache
    attn_impl: AttentionImpl
    layer_ops: LayerOps
    windows: tuple[int | None, ...]  # one plan per distinct sliding window


class DecodeGraphs:
    def __init__(self, target: GraphModel, sizes: tuple[int, ...], max_model_len: int, device: torch.device):
        self.target, self.sizes, self.device = target, sizes, device
        self.max_model_len = max_model_len
        self.max_blocks = -(-max_model_len // target.kv_cache.spec.block_size)
        largest = sizes[-1]
        i64, i32 = dict(dtype=torch.int64, device=device), dict(dtype=torch.int32, device=device)
        self.input_ids = torch.zeros(largest, **i64)
        self.positions = torch.zeros(largest, **i64)
        self.slots = torch.full((largest,), PAD_SLOT, **i64)
        self.seq_lens = torch.ones(largest, **i32)
        self.block_tables = torch.zeros(largest, self.max_blocks, **i32)
        self.query_start_loc = torch.arange(largest + 1, **i32)  # one token a row, padded rows included
        self._table_width = 0  # columns of block_tables that may hold an earlier step's entries
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.replays: Counter[tuple[int, int]] = Counter()  # (real rows, size) -> replays
        self.stats: CaptureStats | None = None
        self.error: str | None = None  # why capture failed (every step then runs eagerly)

    @property
    def captured(self) -> bool:
        return bool(self.graphs)

    def _metadata(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: size + 1], seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size], slot_mapping=self.slots[:size], max_query_len=1,
            max_seq_len=self.max_model_len, query_lens_host=(1,) * size, seq_lens_host=(self.max_model_len,) * size,
        )

    def _forward(self, size: int) -> torch.Tensor:
        t = self.target
        meta = self._metadata(size)
        plans = {window: t.attn_impl.plan(meta, t.kv_cache.layers[0], window) for window in t.windows}
        ctx = ForwardContext(meta, t.kv_cache, t.attn_impl, t.layer_ops, plans)
        return t.model(self.input_ids[:size], self.positions[:size], ctx)

    @torch.inference_mode()
    def capture(self) -> CaptureStats | None:
        """Every size, largest first (smaller graphs reuse the pool's blocks), into one pool. A failure is logged
        with its cause and leaves every step eager (`error` says why), rather than stopping the engine."""
        try:
            with torch.cuda.device(self.device):  # the capture stream is the current device's
                return self._capture()
        except Exception as exc:  # noqa: BLE001  any op that cannot be captured: eager still serves
            self.graphs.clear()
            self.outputs.clear()
            self.error = f"{type(exc).__name__}: {exc}"
            logger.exception("CUDA graph capture failed; every step runs eagerly")
            return None

    def _capture(self) -> CaptureStats:
        torch.cuda.synchronize(self.device)
        free_before = torch.cuda.mem_get_info(self.device)[0]
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            for _ in range(_WARMUP_RUNS):
                self._forward(size)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            # thread_local: another thread's CUDA calls (a server's) cannot invalidate this capture
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                self.outputs[size] = self._forward(size)
            self.graphs[size] = graph
        torch.cuda.synchronize(self.device)
        self.stats = CaptureStats(self.sizes, time.perf_counter() - start,
                                  free_before - torch.cuda.mem_get_info(self.device)[0])
        logger.info("CUDA graphs: %d decode batch sizes (%s) captured in %.2f s, %.1f MiB of device memory",
                    len(self.sizes), ", ".join(map(str, self.sizes)), self.stats.seconds,
                    self.stats.memory_bytes / 2**20)
        return self.stats

    def run(self, step: StepInput, fill: PendingFill | None = None) -> torch.Tensor | None:
        """The final hidden states [rows, hidden] of a qualifying step, by replay; None: run it eagerly. Captures
        first if that had to wait for the attention implementation. `fill`: input tokens the step in flight is
        picking (async scheduling), copied into the static buffer on the device."""
        if not self.captured and (self.error is not None or not self.target.attn_impl.cuda_graphs()):
            return None
        padded = pad_decode(step, self.sizes, self.max_blocks)
        if padded is None:
            return None
        if not self.captured and self.capture() is None:
            return None
        self._load(padded, fill)
        self.graphs[padded.size].replay()
        self.replays[(padded.num_rows, padded.size)] += 1
        return self.outputs[padded.size][: padded.num_rows]

    def forward_eagerly(self, padded: PaddedDecode, fill: PendingFill | None = None) -> torch.Tensor:
        """`padded` through the model without a graph, over the static buffers: the computation a capture records
        (tests run it on CPU under Triton's interpreter). All `padded.size` rows."""
        self._load(padded, fill)
        return self._forward(padded.size)

    def _load(self, padded: PaddedDecode, fill: PendingFill | None = None) -> None:
        size, width = padded.size, padded.width
        for buffer, values in ((self.input_ids, padded.token_ids), (self.positions, padded.positions),
                               (self.slots, padded.slots)):
            buffer[:size].copy_(torch.tensor(values, dtype=torch.int64), non_blocking=True)
        self.seq_lens[:size].copy_(torch.tensor(padded.seq_lens, dtype=torch.int32), non_blocking=True)
        self.block_tables[:size, :width].copy_(torch.tensor(padded.block_tables, dtype=torch.int32),
                                               non_blocking=True)
        if width < self._table_width:  # columns an earlier, longer step wrote: no stale block id stays behind
            self.block_tables[:, width : self._table_width].zero_()
        self._table_width = width
        if fill is not None:  # input tokens the step in flight is still picking, copied on the device
            fill.apply(self.input_ids)
