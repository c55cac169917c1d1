"""The native small-batch decode step: a decode-only step of at most `max_batch` sequences runs the model's whole
layer stack and LM head in one C call (kernels/cpu/decode_step.c) instead of ~15 torch ops per layer.

Taken at step time from the SchedulerOutput: every scheduled sequence computes exactly its one newest token (and its
speculative drafts, if any, verified in the same call), the batch is at most `EngineConfig.native_step_max_batch`
sequences (a step with drafts: any number of sequences within `native_step_max_rows` rows), FP8 scales are
calibrated and no row uses a LoRA adapter. Anything else (a prefill or chunk in the step, a larger batch, an adapter)
runs the torch path, which shares the same KV cache. Built only when the model describes its stack
(`decoder_stack()`: the Llama family and Gemma 3), attention is the native CPU implementation, and every linear, the
LM head included, has a native kernel (`LinearMethod.native_linear`); otherwise the engine logs why and keeps the
torch path for every step.
"""

from __future__ import annotations

import ctypes
import logging

import torch

from pagedserve.engine.models.decoder_stack import ACTIVATIONS, DecoderStack, UnsupportedStack
from pagedserve.engine.core.scheduler_output import SchedulerOutput
from pagedserve.engine.runner.native_capacity import NativeCapacity
from pagedserve.engine.runner.step_input import StepInput
from pagedserve.kernels.attention import AttentionImpl
from pagedserve.kernels.cpu.build import check_struct_sizes
from pagedserve.kernels.cpu.native import dtype_code, load_library, row_scales_ptr
from pagedserve.kernels.kv_cache import KVCache, LayerKVCache
from pagedserve.kernels.kv_scales import CalibratingAttention
from pagedserve.kernels.native_attention import NativeCpuAttention
from pagedserve.quant.native_linear import NativeLinear, PsLinear

logger = logging.getLogger(__name__)

_p, _i64, _f32, _int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int


class StepLayer(ctypes.Structure):
    # Field order and types mirror StepLayer in kernels/cpu/decode_step.c.
    _fields_ = [("qkv", PsLinear * 3), ("n_qkv", _i64), ("o", PsLinear), ("gate_up", PsLinear * 2),
                ("n_gate_up", _i64), ("down", PsLinear), ("input_norm", _p), ("post_norm", _p), ("k_cache", _p),
                ("v_cache", _p), ("k_scale", _p), ("v_scale", _p), ("k_row_scale", _p), ("v_row_scale", _p),
                ("k_rotation", _p), ("k_offset", _p), ("window", _i64), ("q_norm", _p), ("k_norm", _p),
                ("attn_out_norm", _p), ("mlp_out_norm", _p), ("cos", _p), ("signed_sin", _p)]


class StepModel(ctypes.Structure):
    _fields_ = [(name, _i64) for name in ("num_layers", "hidden", "intermediate", "num_heads", "num_kv_heads",
                                          "head_dim", "num_blocks", "block_size", "vocab", "max_positions")] + [
        ("eps", _f32), ("attn_scale", _f32), ("logit_softcap", _f32), ("norm_dtype", _int),
        ("kv_dtype", _int), ("activation", _int), ("cos", _p), ("signed_sin", _p), ("final_norm", _p), ("layers", _p),
        ("lm_head", PsLinear)]


class StepBatch(ctypes.Structure):
    _fields_ = [("token_ids", _p), ("positions", _p), ("slots", _p), ("rows", _p), ("seq_lens", _p),
                ("block_tables", _p), ("block_table_stride", _i64), ("max_seq_len", _i64), ("embed_rows", _p), ("logits", _p)]


class NativeStepUnavailable(Exception):
    """Why this model or engine keeps the torch path for every step (logged, never raised to the user)."""


def _linears(parts: tuple) -> tuple[NativeLinear, ...]:
    natives = tuple(part.method.native_linear(part) for part in parts)
    if any(n is None for n in natives):
        raise NativeStepUnavailable(f"{type(parts[0].method).__name__} has no native linear kernel")
    return natives


def _struct_array(natives: tuple[NativeLinear, ...], size: int):
    return (PsLinear * size)(*(n.as_struct() for n in natives))


class NativeDecodeStep:
    def __init__(self, stack: DecoderStack, cache: KVCache, attn: AttentionImpl, max_batch: int | None,
                 max_rows: int = 0):
        self._attn = attn
        self._keep: list[object] = []  # NativeLinears and tensors whose addresses the C structs hold
        rotation = cache.layers[0].k_rotation  # one matrix for every layer (KVCache.set_k_rotation)
        self._rotation = None if rotation is None else rotation.to(torch.float32).contiguous()
        self._layers = (StepLayer * len(stack.layers))(*(
            self._layer(layer, entry) for layer, entry in zip(stack.layers, cache.layers, strict=True)
        ))
        head = _linears((stack.lm_head,))[0]
        self._keep.append(head)
        # None: as many sequences as every linear's kernel still wins at (NativeLinear.native_max_batch)
        self.capacity = NativeCapacity(max_batch if max_batch is not None else min(
            n.native_max_batch for n in self._keep if isinstance(n, NativeLinear)), max_rows)
        spec = cache.spec
        self.vocab = stack.vocab_size
        self._embedding = stack.embedding
        self._model = StepModel(
            len(stack.layers), stack.hidden_size, stack.intermediate_size, stack.num_heads, stack.num_kv_heads,
            stack.head_dim, cache.num_blocks, spec.block_size, self.vocab, stack.cos.shape[0],
            stack.eps, stack.head_dim**-0.5 if stack.attn_scale is None else stack.attn_scale,
            stack.logit_softcap or 0.0, dtype_code(stack.final_norm.dtype), dtype_code(spec.dtype.torch_dtype),
            ACTIVATIONS.index(stack.activation), stack.cos.data_ptr(), stack.signed_sin.data_ptr(),
            stack.final_norm.data_ptr(), ctypes.addressof(self._layers), head.as_struct(),
        )
        self._keep += [stack]
        self._stack = stack
        self._cache = cache
        self._offsets_bound = False
        self._lib = load_library()
        check_struct_sizes(self._lib, (("step_layer", StepLayer), ("step_model", StepModel), ("step_batch", StepBatch)))

    def _bind_k_offsets(self) -> None:
        """FP8 K offsets exist only once calibration has run (the first prefill, before any native step)."""
        for struct, entry in zip(self._layers, self._cache.layers, strict=True):
            if entry.k_offset is not None:
                offset = entry.k_offset.to(torch.float32).contiguous()
                self._keep.append(offset)
                struct.k_offset = offset.data_ptr()
        self._offsets_bound = True

    def _layer(self, layer, entry: LayerKVCache) -> StepLayer:
        qkv, gate_up = _linears(layer.qkv), _linears(layer.gate_up)
        (o, down) = _linears((layer.o, layer.down))
        self._keep += [*qkv, *gate_up, o, down]
        k, v = LayerKVCache.by_head(entry.k), LayerKVCache.by_head(entry.v)
        optional = (layer.q_norm, layer.k_norm, layer.attn_out_norm, layer.mlp_out_norm, layer.cos, layer.signed_sin)
        if any(not t.is_contiguous() for t in (layer.input_norm, layer.post_norm, *optional) if t is not None):
            raise NativeStepUnavailable("RMSNorm weights or RoPE tables are not contiguous")
        return StepLayer(
            _struct_array(qkv, 3), len(qkv), o.as_struct(), _struct_array(gate_up, 2), len(gate_up), down.as_struct(),
            layer.input_norm.data_ptr(), layer.post_norm.data_ptr(), k.data_ptr(), v.data_ptr(),
            entry.k_scale.data_ptr(), entry.v_scale.data_ptr(),
            row_scales_ptr(entry.k_row_scale), row_scales_ptr(entry.v_row_scale),
            None if self._rotation is None else self._rotation.data_ptr(), None, layer.window or 0,
            *(None if t is None else t.data_ptr() for t in optional),
        )

    def accepts(self, batch: SchedulerOutput) -> bool:
        """Whether this step runs natively (the runner's one rule): decode rows only (a speculating sequence's drafts
        included: each draft is one more row over the same block table), a size `capacity` serves (the drafter trims
        drafts to fit it), FP8 scales settled, no LoRA adapter (the C step has no adapter deltas: a step with any
        adapter row runs on torch)."""
        items = batch.scheduled
        if not items or any(i.seq.adapter is not None for i in items):
            return False
        drafts = any(i.draft_tokens for i in items)
        if not self.capacity.serves(len(items), sum(i.num_new_tokens for i in items) if drafts else len(items), drafts):
            return False
        if isinstance(self._attn, CalibratingAttention) and not self._attn.calibrated:
            return False
        # A row whose input token is still pending (async scheduling) decodes the sequence's next position too.
        return all(i.num_new_tokens == 1 + len(i.draft_tokens)
                   and i.seq.num_computed_tokens + 1 == i.seq.num_tokens + i.input_pending for i in items)

    def run(self, step: StepInput) -> torch.Tensor:
        """fp32 logits [rows, vocab] of the step's sequences (every one samples), in schedule order: one row per
        sequence, 1 + drafts consecutive rows for a speculating one. A draft row is a decode row of its own over the
        sequence's block table, its context ending at its position: the C step writes every row's K/V before any
        row's attention in each layer, so each draft sees the rows before it, as a causal forward does."""
        if not self._offsets_bound:
            self._bind_k_offsets()
        n = len(step.token_ids)
        width = len(step.block_tables[0])
        tables = torch.tensor(step.row_block_tables, dtype=torch.int32)
        longs = torch.tensor([step.token_ids, self._rope_rows(step), step.slots, list(range(n))], dtype=torch.int64)
        seq_lens = torch.tensor(step.positions, dtype=torch.int32) + 1
        logits = torch.empty(n, self.vocab, dtype=torch.float32)
        # One torch call: the embedding reads its own storage (a packed one dequantizes only these rows).
        with torch.no_grad():
            embed_rows = self._embedding(longs[0])
            if self._stack.embed_scale is not None:  # in the rows' dtype, as the torch path scales them
                embed_rows = embed_rows * self._stack.embed_scale
            embed_rows = embed_rows.to(torch.float32).contiguous()
        args = StepBatch(longs[0].data_ptr(), longs[1].data_ptr(), longs[2].data_ptr(), longs[3].data_ptr(),
                         seq_lens.data_ptr(), tables.data_ptr(), width, max(step.seq_lens), embed_rows.data_ptr(),
                         logits.data_ptr())
        status = self._lib.pagedserve_decode_step(ctypes.byref(self._model), ctypes.byref(args), n,
                                                  torch.get_num_threads())
        if status != 0:
            raise RuntimeError(f"native decode step failed (status {status}: -2 out of memory, -10 token id, "
                               f"-11 position, -12 KV slot out of range; other: a linear's own error)")
        return logits

    def _rope_rows(self, step: StepInput) -> list[int]:
        """The cos/sin table row of every token: its position, shifted into LongRoPE's long table past the switch."""
        if self._stack.long_rope_after is None:
            return step.positions  # one table: the row is the position, no per-token work on the decode path
        lengths = [n for n, count in zip(step.rope_lengths, step.query_lens) for _ in range(count)]
        return [self._stack.rope_row(p, n) for p, n in zip(step.positions, lengths)]


def build_native_step(model: torch.nn.Module, cache: KVCache, attn: AttentionImpl, max_batch: int | None,
                      device: torch.device, max_rows: int = 0) -> NativeDecodeStep | None:
    """The native step for this engine, or None (logging why) where the torch path must serve every step;
    max_batch None: chosen from the linears' kernels."""
    if (max_batch is not None and max_batch < 1) or device.type != "cpu":
        return None
    try:
        inner = attn.inner if isinstance(attn, CalibratingAttention) else attn
        if not isinstance(inner, NativeCpuAttention):
            raise NativeStepUnavailable(f"attention is {type(inner).__name__}, not the native CPU implementation")
        describe = getattr(model, "decoder_stack", None)
        if describe is None:
            raise NativeStepUnavailable(f"{type(model).__name__} has no native layer stack (its layer math differs)")
        step = NativeDecodeStep(describe(), cache, attn, max_batch, max_rows)
    except (NativeStepUnavailable, UnsupportedStack) as why:
        logger.info("native decode step off, every step on the torch path: %s", why)
        return None
    logger.info("native decode step on for decode-only steps of up to %d sequences", step.capacity.max_batch)
    return step
