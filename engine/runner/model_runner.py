"""One step: a SchedulerOutput in, each sampling sequence's tokens out (`execute`). The runner prepares the step's
inputs once, runs them on the native C step (CPU; one rule, `NativeDecodeStep.accepts`), a captured CUDA graph
(CUDA decode steps; `engine/runner/cuda_graphs.py`) or the eager torch forward, then verifies drafts and samples
(grammar masks included) itself: logits never leave it."""

from __future__ import annotations

import logging

import torch

from pagedserve.engine.config import FIT_KV_CACHE, MAX_CUDA_GRAPH_SIZE, EngineConfig
from pagedserve.engine.core.scheduler_output import ScheduledSeq, SchedulerOutput
from pagedserve.engine.core.sequence import Sequence
from pagedserve.engine.core.step_output import StepOutput
from pagedserve.engine.loading.model_loader import LoadedModel
from pagedserve.engine.lora.layers import StepAdapters, wrap_model
from pagedserve.engine.lora.weights import LoraLayout, model_layout
from pagedserve.engine.models.layers import ForwardContext
from pagedserve.engine.runner.cuda_graphs import DecodeGraphs, GraphModel
from pagedserve.engine.runner.graph_inputs import capture_sizes
from pagedserve.engine.runner.kv_budget import StepMemory, kv_cache_bytes, profile_cuda_step
from pagedserve.engine.runner.launched_step import DevicePicks, LaunchedStep, PendingFill
from pagedserve.engine.runner.native_capacity import NO_NATIVE_STEP, NativeCapacity
from pagedserve.engine.runner.native_step import build_native_step
from pagedserve.engine.runner.pooled_rows import PooledChunk, pool_hidden
from pagedserve.engine.runner.profile_step import ProfileShape, ProfileTarget
from pagedserve.engine.runner.prompt_logprobs import ScoredPrompt, score_prompt_rows
from pagedserve.engine.runner.sampler import Pending, Sampler
from pagedserve.engine.runner.step_input import StepInput, prepare_step
from pagedserve.engine.spec_decode.verifier import Verifier
from pagedserve.kernels.attention import AttentionMetadata
from pagedserve.kernels.backends import select_attention_impl, select_layer_ops
from pagedserve.kernels.cpu.native import available
from pagedserve.kernels.kv_cache import KVCache, KVCacheSpec, KVDtype
from pagedserve.kernels.kv_scales import setup_kv_scales
from pagedserve.quant.linear import QuantLinear

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, loaded: LoadedModel, config: EngineConfig, device: torch.device, sampler: Sampler):
        self.model = loaded.model
        self.sampler = sampler
        self.verifier = Verifier(sampler)
        self.device = device
        args = self.model.args
        self.vocab_size = args.vocab_size
        given = None if config.max_model_len == FIT_KV_CACHE else config.max_model_len
        self.max_model_len = min(given or args.max_position_embeddings, args.max_position_embeddings)
        # One attention plan per step for each distinct sliding window (None: full attention).
        self.windows = tuple(dict.fromkeys(args.layer_windows))
        rotary = getattr(self.model, "rotary", None)  # LongRoPE's switch length (None: one table), for the engine
        self.long_rope_after: int | None = getattr(rotary, "long_after", None)
        kv_dtype = KVDtype.parse(config.kv_cache_dtype, loaded.dtype)
        self.kv_spec = KVCacheSpec(args.num_layers, args.num_kv_heads, args.head_dim, config.block_size, kv_dtype)
        attn_impl = select_attention_impl(config.attention_backend, device)
        self.layer_ops = select_layer_ops(config.layer_ops_choice, device, loaded.dtype)
        def profile() -> StepMemory:  # only where --gpu-memory-utilization decides the cache's size
            shape = ProfileShape.largest(config.max_num_batched_tokens, self.max_model_len, config.max_num_seqs)
            target = ProfileTarget(self.model, attn_impl, self.layer_ops, self.windows)
            return profile_cuda_step(self.kv_spec, target, shape, self.vocab_size, device)

        num_blocks = self.kv_spec.num_blocks_for(kv_cache_bytes(config, device, profile))
        self.kv_cache = KVCache(self.kv_spec, num_blocks, device)
        # A model whose every layer slides keeps only its window's blocks, so the cache does not bound its length
        if config.max_model_len == FIT_KV_CACHE and self.kv_window is None:
            self.max_model_len = min(self.max_model_len, num_blocks * config.block_size)
            logger.info("max_model_len auto: %d tokens (the model's limit, or what the KV cache holds)",
                        self.max_model_len)
        # FP8 caches get checkpoint k/v scales, or a wrapper that calibrates them on the first prefill.
        self.attn_impl = setup_kv_scales(self.kv_cache, loaded.kv_scale_tensors, attn_impl)
        self.native_step = build_native_step(
            self.model, self.kv_cache, self.attn_impl, config.native_step_max_batch, device, config.native_step_max_rows
        )
        if config.speculative is None:  # no verify step compares rows with one-row steps: faster small calls
            for module in self.model.modules():
                if isinstance(module, QuantLinear):
                    module.method.free_row_bits(module)
        # LoRA: the adaptable linears get wrapped after the native step took the bare ones (it serves base steps).
        self.step_adapters = StepAdapters(native=device.type == "cpu" and config.lora is not None and available())
        self.lora_layout: LoraLayout | None = None
        if config.lora is not None:
            self.lora_layout = model_layout(self.model)
            wrap_model(self.model, self.lora_layout, self.step_adapters)
        self.cuda_graphs = self._decode_graphs(config, device)
        # The prompt tokens the latest step scored (prompt logprobs), beside forward's (logits, sequences): that
        # pair is the seam tests and tools wrap, so the scores do not change its shape.
        self.scored_prompts: tuple[ScoredPrompt, ...] = ()
        self.pooled: tuple[PooledChunk, ...] = ()  # the embedding sequences' chunks the latest step pooled
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

    @property
    def native_capacity(self) -> NativeCapacity:
        """What the native step takes (the drafter sizes drafts by it); nothing without one."""
        return NO_NATIVE_STEP if self.native_step is None else self.native_step.capacity

    def prepare(self, batch: SchedulerOutput) -> StepInput:
        return prepare_step(self._in_adapter_order(batch.scheduled), self.kv_spec.block_size)

    def _in_adapter_order(self, scheduled: tuple[ScheduledSeq, ...]) -> tuple[ScheduledSeq, ...]:
        """With LoRA, the step's sequences grouped by adapter (base first, stable), so each adapter's tokens are one
        span; the logits rows follow this order (execute returns the sequences with them)."""
        if self.lora_layout is None:
            return scheduled
        return tuple(sorted(scheduled, key=lambda item: item.seq.adapter_id))

    def _tensor(self, data: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(data, dtype=dtype, device=self.device)

    @torch.inference_mode()
    def execute(self, batch: SchedulerOutput) -> StepOutput:
        """Runs one step: the sampling sequences' tokens (verified drafts first, then the plainly sampled rows)."""
        self.copy_blocks(batch.block_copies)
        return self._with_rows(self._sample(batch, *self.forward(batch)))

    def _with_rows(self, output: StepOutput) -> StepOutput:
        """The step's output with what its forward read off rows that do not sample (prompt logprobs, pooling)."""
        return output.with_prompt_logprobs(self.scored_prompts).with_pooled(self.pooled)

    @torch.inference_mode()
    def launch(self, batch: SchedulerOutput, inflight: LaunchedStep | None = None) -> LaunchedStep:
        """Async scheduling: starts one step without waiting for its tokens where they are picked on the device
        (nothing on the host decides any row's token: `Sampler.picks_on_device`); otherwise runs and samples it as
        `execute` does.
        `inflight`: the step whose tokens are this one's pending inputs (`ScheduledSeq.input_pending`)."""
        self.copy_blocks(batch.block_copies)
        step = self.prepare(batch)
        device_picks = not any(item.draft_tokens for item in batch.scheduled) and not step.needs_hidden and \
            all(self.sampler.picks_on_device(seq) for seq in step.sampling_seqs)
        fill, pending = None, None
        if step.pending and device_picks and not self._runs_natively(batch):
            fill = PendingFill.of(step, inflight.picks)
            pending = {seq: fill.tokens[i : i + 1] for i, (_, seq) in enumerate(step.pending)}
        elif step.pending:  # a path that takes host ids (the native step has its picks on the host already)
            tokens = dict(zip(inflight.picks.seqs, inflight.picks.read().tokens))
            pending = {seq: torch.tensor([tokens[seq]], device=self.device) for _, seq in step.pending}
            step = step.resolved(tokens)
        logits, seqs = self._forward(batch, step, fill)
        if not device_picks or not seqs:
            return LaunchedStep(batch, output=self._with_rows(self._sample(batch, logits, seqs, pending)))
        return LaunchedStep(batch, picks=DevicePicks.start(seqs, self.sampler.device_picks(logits, seqs, pending)))

    def collect(self, launched: LaunchedStep) -> StepOutput:
        """A launched step's tokens, once they are on the host."""
        if launched.picks is None:
            return launched.output
        return StepOutput(tuple(self.sampler.device_samples(launched.picks.seqs, launched.picks.read())))

    def _sample(self, batch: SchedulerOutput, logits: torch.Tensor, seqs: tuple[Sequence, ...],
                pending: Pending | None = None) -> StepOutput:
        if not seqs:
            return StepOutput.empty()
        drafts = {item.seq: item.draft_tokens for item in batch.scheduled if item.draft_tokens}
        if not drafts:
            return StepOutput(tuple(self.sampler(logits, seqs, pending)))
        verified, plain_rows, plain = [], [], []
        row = 0
        for seq in seqs:
            num_rows = 1 + len(drafts.get(seq, ()))
            if num_rows == 1:
                plain_rows.append(row)
                plain.append(seq)
            else:
                verified.append(self.verifier(logits[row : row + num_rows], seq, drafts[seq]))
            row += num_rows
        sampled = self.sampler(logits[plain_rows], tuple(plain)) if plain else []
        return StepOutput((*verified, *sampled))

    def forward(self, batch: SchedulerOutput) -> tuple[torch.Tensor, tuple[Sequence, ...]]:
        """fp32 logits [R, vocab] for the sequences that sample now (one row each, 1 + drafts rows for a
        speculating one, consecutive), and those sequences."""
        return self._forward(batch, self.prepare(batch))

    def _forward(self, batch: SchedulerOutput, step: StepInput,
                 fill: PendingFill | None = None) -> tuple[torch.Tensor, tuple[Sequence, ...]]:
        self.scored_prompts, self.pooled = (), ()
        if not step.needs_hidden and self._runs_natively(batch):
            return self.native_step.run(step), step.sampling_seqs
        if step.adapter_spans or self.step_adapters.groups:
            self.step_adapters.set_spans(step.adapter_spans)
        hidden = self.cuda_graphs.run(step, fill) if self.cuda_graphs is not None else None
        if hidden is None:
            hidden = self._eager_forward(step, fill)
        if step.prompt_rows:
            self.scored_prompts = score_prompt_rows(hidden, step.prompt_rows, self.model.compute_logits)
        if step.pool_rows:
            self.pooled = pool_hidden(hidden, step.pool_rows)
        if not step.sampling_seqs:
            return hidden.new_empty((0, self.vocab_size), dtype=torch.float32), ()
        return self.model.compute_logits(self._logits_hidden(hidden, step.logits_rows)), step.sampling_seqs

    def _runs_natively(self, batch: SchedulerOutput) -> bool:
        return self.native_step is not None and self.native_step.accepts(batch)

    def _logits_hidden(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """The hidden states of the rows that sample. In a decode step that is every row, in order: then the index
        (a host-to-device copy the host waits for, and a gather kernel) is skipped."""
        if len(rows) == hidden.shape[0] and rows[-1] == len(rows) - 1:  # rows ascend: these are 0 .. n-1
            return hidden
        return hidden[self._tensor(rows, torch.int64)]

    def _eager_forward(self, step: StepInput, fill: PendingFill | None = None) -> torch.Tensor:
        meta = self._metadata(step)
        # Once per step and window, shared by every layer with that window.
        plans = {window: self.attn_impl.plan(meta, self.kv_cache.layers[0], window) for window in self.windows}
        ctx = ForwardContext(meta, self.kv_cache, self.attn_impl, self.layer_ops, plans, step.rope_lengths)
        token_ids = self._tensor(step.token_ids, torch.int64)
        if fill is not None:
            fill.apply(token_ids)
        return self.model(token_ids, self._tensor(step.positions, torch.int64), ctx)

    def _decode_graphs(self, config: EngineConfig, device: torch.device) -> DecodeGraphs | None:
        """CUDA graphs of the decode step (engine/runner/cuda_graphs.py), captured now if the attention allows it
        yet; None on CPU, with enforce_eager, for models that pick RoPE tables by sequence length (LongRoPE: the
        lengths are host data of each step) and for models whose forward reads device values on the host (a
        mixture of experts runs the experts its tokens chose: a module's `host_reads_in_forward`)."""
        long_rope = any(getattr(m, "long_after", None) is not None for m in self.model.modules())
        host_reads = any(getattr(m, "host_reads_in_forward", False) for m in self.model.modules())
        if device.type != "cuda" or config.enforce_eager or long_rope or host_reads:
            return None
        sizes = capture_sizes(config.cuda_graph_sizes, config.max_num_seqs, MAX_CUDA_GRAPH_SIZE)
        target = GraphModel(self.model, self.kv_cache, self.attn_impl, self.layer_ops, self.windows)
        graphs = DecodeGraphs(target, sizes, self.max_model_len, device)
        if self.attn_impl.cuda_graphs():
            graphs.capture()
        return graphs

    def _metadata(self, step: StepInput) -> AttentionMetadata:
        qsl = [0]
        for q in step.query_lens:
            qsl.append(qsl[-1] + q)
        return AttentionMetadata(
            query_start_loc=self._tensor(qsl, torch.int32),
            seq_lens=self._tensor(step.seq_lens, torch.int32),
            block_tables=self._tensor(step.block_tables, torch.int32),
            slot_mapping=self._tensor(step.slots, torch.int64),
            max_query_len=max(step.query_lens),
            max_seq_len=max(step.seq_lens),
            query_lens_host=tuple(step.query_lens),
            seq_lens_host=tuple(step.seq_lens),
        )

    def copy_blocks(self, copies: tuple[tuple[int, int], ...]) -> None:
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], dtype=torch.long, device=self.device)
        dst = torch.tensor([d for _, d in copies], dtype=torch.long, device=self.device)
        self.kv_cache.copy_blocks(src, dst)
