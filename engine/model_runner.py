"""Turns a SchedulerOutput into tensors, runs the model over the paged KV cache, returns logits to sample."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from pagedserve.engine.config import EngineConfig
from pagedserve.engine.loading.model_loader import LoadedModel
from pagedserve.engine.lora.layers import StepAdapters, wrap_model
from pagedserve.engine.lora.weights import LoraLayout, model_layout
from pagedserve.engine.models.layers import ForwardContext
from pagedserve.engine.native_step import build_native_step
from pagedserve.engine.scheduler import ScheduledSeq, SchedulerOutput
from pagedserve.engine.sequence import Sequence
from pagedserve.kernels.attention import AttentionMetadata
from pagedserve.kernels.backends import select_attention_impl, select_layer_ops
from pagedserve.kernels.cpu.native import available
from pagedserve.kernels.kv_cache import KVCache, KVCacheSpec, KVDtype
from pagedserve.kernels.kv_scales import setup_kv_scales

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ModelInput:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    attn_meta: AttentionMetadata
    # [R] int64: the last new token of each sequence that samples this step, and each of its draft tokens
    logits_rows: torch.Tensor
    sampling_seqs: tuple[Sequence, ...]  # the sequences, in logits-row order (a speculating one has 1 + drafts rows)


class ModelRunner:
    def __init__(self, loaded: LoadedModel, config: EngineConfig, device: torch.device):
        self.model = loaded.model
        self.device = device
        args = self.model.args
        self.vocab_size = args.vocab_size
        self.max_model_len = min(config.max_model_len or args.max_position_embeddings, args.max_position_embeddings)
        # One attention plan per step for each distinct sliding window (None: full attention).
        self.windows = tuple(dict.fromkeys(args.layer_windows))
        kv_dtype = KVDtype.parse(config.kv_cache_dtype, loaded.dtype)
        self.kv_spec = KVCacheSpec(args.num_layers, args.num_kv_heads, args.head_dim, config.block_size, kv_dtype)
        num_blocks = self.kv_spec.num_blocks_for(config.kv_cache_memory)
        self.kv_cache = KVCache(self.kv_spec, num_blocks, device)
        # FP8 caches get checkpoint k/v scales, or a wrapper that calibrates them on the first prefill.
        self.attn_impl = setup_kv_scales(
            self.kv_cache, loaded.kv_scale_tensors, select_attention_impl(config.attention_backend, device)
        )
        self.layer_ops = select_layer_ops(config.layer_ops_choice, device, loaded.dtype)
        self.native_step = build_native_step(
            self.model, self.kv_cache, self.attn_impl, config.native_step_max_batch, device, config.native_step_max_rows
        )
        # LoRA: the adaptable linears get wrapped after the native step took the bare ones (it serves base steps).
        self.step_adapters = StepAdapters(native=device.type == "cpu" and config.lora is not None and available())
        self.lora_layout: LoraLayout | None = None
        if config.lora is not None:
            self.lora_layout = model_layout(self.model)
            wrap_model(self.model, self.lora_layout, self.step_adapters)
        logger.info(
            "KV cache: %d blocks x %d tokens = %d tokens (%s, %.1f MiB, attention=%s, layer ops=%s)",
            num_blocks, config.block_size, num_blocks * config.block_size, kv_dtype.value,
            num_blocks * self.kv_spec.bytes_per_block / 2**20, type(self.attn_impl).__name__,
            type(self.layer_ops).__name__,
        )

    @property
    def num_blocks(self) -> int:
        return self.kv_cache.num_blocks

    @property
    def kv_window(self) -> int | None:
        """The widest sliding window when every layer has one (a block no window reaches is then dead), else None."""
        return None if None in self.windows else max(self.windows)

    def prepare(self, batch: SchedulerOutput) -> ModelInput:
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        rows: list[int] = []
        sampling: list[Sequence] = []
        adapter_rows: list[tuple[object, int, int]] = []
        block_size = self.kv_spec.block_size
        order = self._in_adapter_order(batch.scheduled)
        for item in order:
            seq, start = item.seq, item.seq.num_computed_tokens
            end = start + item.num_new_tokens
            if seq.lora is not None:
                adapter_rows.append((seq.lora, len(ids), len(ids) + item.num_new_tokens))
            drafts = item.draft_tokens
            ids += seq.token_ids[start : end - len(drafts)]
            ids += drafts
            positions += range(start, end)
            table = seq.block_table
            slots += [table[p // block_size] * block_size + p % block_size for p in range(start, end)]
            query_lens.append(item.num_new_tokens)
            seq_lens.append(end)
            if end - len(drafts) == seq.num_tokens:
                # A speculating sequence samples at its last token and after each draft: 1 + len(drafts) rows.
                rows += range(len(ids) - 1 - len(drafts), len(ids))
                sampling.append(seq)
        width = max(len(item.seq.block_table) for item in order)
        tables = [item.seq.block_table + [0] * (width - len(item.seq.block_table)) for item in order]
        if adapter_rows or self.step_adapters.groups:
            self.step_adapters.set_spans(adapter_rows)
        qsl = [0]
        for q in query_lens:
            qsl.append(qsl[-1] + q)
        meta = AttentionMetadata(
            query_start_loc=self._tensor(qsl, torch.int32),
            seq_lens=self._tensor(seq_lens, torch.int32),
            block_tables=self._tensor(tables, torch.int32),
            slot_mapping=self._tensor(slots, torch.int64),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_lens_host=tuple(query_lens),
            seq_lens_host=tuple(seq_lens),
        )
        return ModelInput(
            input_ids=self._tensor(ids, torch.int64),
            positions=self._tensor(positions, torch.int64),
            attn_meta=meta,
            logits_rows=self._tensor(rows, torch.int64),
            sampling_seqs=tuple(sampling),
        )

    def _in_adapter_order(self, scheduled: tuple[ScheduledSeq, ...]) -> tuple[ScheduledSeq, ...]:
        """With LoRA, the step's sequences grouped by adapter (base first, stable), so each adapter's tokens are one
        span; the logits rows follow this order (execute returns the sequences with them)."""
        if self.lora_layout is None:
            return scheduled
        return tuple(sorted(scheduled, key=lambda item: item.seq.adapter_id))

    def _tensor(self, data: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(data, dtype=dtype, device=self.device)

    @torch.inference_mode()
    def execute(self, batch: SchedulerOutput) -> tuple[torch.Tensor, tuple[Sequence, ...]]:
        """Runs one step; returns fp32 logits [R, vocab] for the sequences that sample now (one row each, 1 + drafts
        rows for a speculating one, consecutive), and those sequences."""
        self.copy_blocks(batch.block_copies)
        if self.native_step is not None and self.native_step.accepts(batch):
            return self.native_step.run(batch, self.kv_spec.block_size)
        model_input = self.prepare(batch)
        meta = model_input.attn_meta
        # Once per step and window, shared by every layer with that window.
        plans = {window: self.attn_impl.plan(meta, self.kv_cache.layers[0], window) for window in self.windows}
        ctx = ForwardContext(meta, self.kv_cache, self.attn_impl, self.layer_ops, plans)
        hidden = self.model(model_input.input_ids, model_input.positions, ctx)
        if not model_input.sampling_seqs:
            return hidden.new_empty((0, self.vocab_size), dtype=torch.float32), ()
        logits = self.model.compute_logits(hidden[model_input.logits_rows])
        return logits, model_input.sampling_seqs

    def copy_blocks(self, copies: tuple[tuple[int, int], ...]) -> None:
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], dtype=torch.long, device=self.device)
        dst = torch.tensor([d for _, d in copies], dtype=torch.long, device=self.device)
        self.kv_cache.copy_blocks(src, dst)
