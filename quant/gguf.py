"""GGUF weights kept in the file's own blocks: linear layers and embeddings computed from them on CPU.

The GGUF loader names this method in the config it builds (`quantization_config.tensor_types`: HF tensor name ->
GGUF type) and hands each packed tensor over as its uint8 blocks [rows, row_bytes]; nothing is dequantized at load.
A layer whose type has no packed kernel (F16, BF16, Q5_1, Q2_K, Q3_K, ...) arrives dequantized and stays dense.

Per call the kernel is chosen by the number of rows (measured: docs/quantization.md): up to `PACKED_MAX_ROWS` rows
(decode) the packed kernel reads the blocks in place, dequantizing each run of 32 weights in registers and
multiplying it with the fp32 activations (exact up to summation order); where the build has a fast interleaved-rows
kernel for the format, the matrix is first rewritten in place into groups of 16 interleaved rows, which that kernel
reads 2-6x faster (kernels/cpu/packed_grouped.c: Q4_0/Q4_1/Q8_0; packed_grouped_wide.c: Q5_0 and the K formats).
More rows (prefill, large decode batches): where the interleaved kernel's build has a many-row form
(`MANY_ROW_GROUPED_ISAS`: the int16 builds, every tier with AVX2; kernels/cpu/packed_grouped_panel.c) the
packed kernel serves every row count and the layer holds nothing else. Where torch's bf16 GEMM outruns it (AMX
tiles: every format from `gguf_prefill.MIN_ROWS` rows, below `AMX_GROUPED_ROWS` on kernels/cpu/dense_gemm.c's tiles; without AMX, the K formats from 256 rows where the process
timed it faster, as on Zen 5, and Q4_K/Q5_K from 64 or 128 where that timed faster too, as on Zen 4), long bf16 prefill chunks instead expand the matrix per call into a bf16 scratch
for that GEMM (quant/gguf_prefill.py): faster there than the int16 dots, and not held. Elsewhere (the
portable build, a matrix left in the file's layout) with `dense_batches` (the default, `--gguf-weights
auto`) each such layer also holds its weights expanded once at load in the compute dtype (oneDNN-packed); without it
(`--gguf-weights packed`) the matrix is dequantized per call. `--gguf-weights dequantized` expands the whole model
at load: the fastest long prefill on an AMX host (its GEMMs 1.0-2.0x the per-call expansion's at 256-1024 rows, a
512-token prefill ~1.1-1.2x; noisy) for ~3x the resident weights. The rule is the packed library's tier's: a tier
forced below the host's (PAGEDSERVE_CPU_ISA) should cap torch alike (docs/benchmarks.md), or the dense GEMM it is
weighed against is the host's, not the tier's.
The kernel's int8-activation variant (llama.cpp's scheme) measured ~12% faster at one row only, and its rounding
of activations cost top-1 agreement (95.7% vs 97.5% for bf16 against fp32 on the held-out text), so it is off.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.kernels.cpu.packed import (FAST_GROUPED_ISAS, FORMATS, MANY_ROW_GROUPED_ISAS, WIDE_GROUPED_FORMATS,
                                           PackedMatrix, grouped_isa)
from pagedserve.quant import gguf_prefill
from pagedserve.quant.base import LinearMethod, QuantConfig, QuantConfigError
from pagedserve.quant.native_linear import (AVX2_PACKED_NATIVE_MAX_BATCH, DEFAULT_NATIVE_MAX_BATCH,
                                           GROUPED_NATIVE_MAX_BATCH, NativeLinear, grouped_native_max_batch)
from pagedserve.quant.unquantized import UnquantizedLinearMethod

PACKED_MAX_ROWS = 8  # rows the packed kernel serves where its build has no many-row form


def row_bytes(qtype: str, in_features: int) -> int:
    _, per, size = FORMATS[qtype]
    if in_features % per:
        raise QuantConfigError("tensor_types", f"{qtype} rows of {in_features} values are not whole {per}-value blocks")
    return in_features // per * size


class GgufLinearMethod(LinearMethod):
    """One linear layer whose weight is `qtype` blocks, uint8 [out_features, row_bytes] as the file stores it."""

    def __init__(self, qtype: str, dense_batches: bool = False):
        self.qtype = qtype
        self.dense_batches = dense_batches

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        blocks = torch.empty(out_features, row_bytes(self.qtype, in_features), dtype=torch.uint8)
        layer.weight = nn.Parameter(blocks, requires_grad=False)
        layer.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False) if bias else None
        layer.packed = None
        layer.compute_dtype = dtype

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        bias = layer.bias.detach().float().contiguous() if layer.bias is not None else None
        layer.packed = _grouped_where_faster(
            PackedMatrix(self.qtype, layer.weight.data, layer.in_features, bias, row_group=row_group(layer.weight)),
            layer.weight)
        gguf_prefill.settle(layer.packed, layer.compute_dtype)  # its one timing at load, not in a first request
        # Kept out of the module tree (not a submodule): a second copy for many rows, never a checkpoint slot.
        layer.__dict__["dense_copy"] = _dense_companion(layer) if self.dense_batches and not serves_every_row_count(
            layer.packed) else None

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        packed: PackedMatrix = layer.packed
        flat = x.reshape(-1, layer.in_features)
        if gguf_prefill.takes(packed, flat.shape[0], x.dtype):
            rows = flat.shape[0]
            y = gguf_prefill.dequantized_linear(packed, flat.contiguous(), gguf_prefill.grouped(packed, rows))
        elif flat.shape[0] <= PACKED_MAX_ROWS or serves_every_row_count(packed):
            y = packed.matmul(flat.float().contiguous())
        elif (dense := layer.__dict__.get("dense_copy")) is not None:
            return dense(x)
        else:
            dtype = x.dtype if x.dtype == torch.bfloat16 else torch.float32
            y = F.linear(flat.to(dtype), packed.dequantize(dtype=dtype), None if packed.bias is None else packed.bias.to(dtype))
        return y.to(x.dtype).reshape(*x.shape[:-1], layer.out_features)

    def native_linear(self, layer: nn.Module) -> NativeLinear:
        packed: PackedMatrix = layer.packed
        limit = _grouped_native_limit(packed) if packed.row_group else DEFAULT_NATIVE_MAX_BATCH
        return NativeLinear(packed.linear_fn, packed.state_address, packed.in_features, packed.out_features, (packed,),
                            limit)

    def merge(self, layers: list[nn.Module]) -> nn.Module | None:
        """q/k/v or gate/up as one matrix: rows are independent, so concatenating the block rows is exact."""
        from pagedserve.quant.linear import QuantLinear

        methods = [layer.method for layer in layers]
        if not all(isinstance(m, GgufLinearMethod) and m.qtype == self.qtype for m in methods):
            return None
        blocks = torch.cat([layer.weight.data for layer in layers])
        has_bias = any(layer.bias is not None for layer in layers)
        dtype = next((layer.bias.dtype for layer in layers if layer.bias is not None), torch.float32)
        with torch.device("meta"):
            merged = QuantLinear(layers[0].in_features, blocks.shape[0], has_bias,
                                 GgufLinearMethod(self.qtype, self.dense_batches), dtype)
        merged.weight = nn.Parameter(blocks, requires_grad=False)
        merged.compute_dtype = layers[0].compute_dtype
        if has_bias:
            merged.bias = nn.Parameter(torch.cat([
                layer.bias if layer.bias is not None else torch.zeros(layer.out_features, dtype=dtype)
                for layer in layers]), requires_grad=False)
        merged.loaded_tensors = {"weight", "bias"} if has_bias else {"weight"}
        return merged


def serves_every_row_count(packed: PackedMatrix) -> bool:
    """Whether `packed`'s kernel serves prefill-sized calls too (its interleaved layout's build has a many-row form),
    so that its layer needs no dense GEMM, nor a dense copy for one."""
    return bool(packed.row_group) and grouped_isa(packed.lib, packed.qtype) in MANY_ROW_GROUPED_ISAS


def row_group(weight: torch.Tensor) -> int:
    """The layout `weight`'s blocks hold: 0 (the file's) or the row group `_grouped_where_faster` rewrote them to.
    It is marked on the tensor because a tied LM head shares its blocks with the embedding, which reads them too."""
    return getattr(weight, "pagedserve_row_group", 0)


def _grouped_where_faster(packed: PackedMatrix, weight: torch.Tensor) -> PackedMatrix:
    """Rows interleaved in place (kernels/cpu/packed_grouped.c, packed_grouped_wide.c) where the build has that
    layout's AVX-512 or AVX2 kernel for the format (2-2.5x the file layout's at one row with AVX-512, 2-6x with AVX2:
    docs/quantization.md); elsewhere (portable C) the file's layout, whose kernel is then the faster."""
    if packed.row_group or not packed.can_group(packed.qtype, packed.blocks):
        return packed
    if grouped_isa(packed.lib, packed.qtype) not in FAST_GROUPED_ISAS:
        return packed
    grouped = packed.grouped()
    weight.pagedserve_row_group = grouped.row_group
    return grouped


def _grouped_native_limit(packed: PackedMatrix) -> int:
    """The native step's batch limit through `packed`'s interleaved-rows kernel. The wider formats' kernels
    (packed_grouped_wide.c) run 8 lanes in every build: the 16-lane AVX512-VNNI figure was measured for the 4/8-bit
    tiles only, so they keep the 8-lane builds' limit."""
    if packed.qtype in WIDE_GROUPED_FORMATS:
        return GROUPED_NATIVE_MAX_BATCH
    isa = grouped_isa(packed.lib, packed.qtype)
    return AVX2_PACKED_NATIVE_MAX_BATCH if isa == "avx2" else grouped_native_max_batch(isa)


def _dense_companion(layer: nn.Module) -> nn.Module:
    """The layer's weights expanded once into its compute dtype, served by the unquantized method (oneDNN on CPU)."""
    from pagedserve.quant.linear import QuantLinear

    dtype = layer.compute_dtype if layer.compute_dtype in (torch.bfloat16, torch.float16) else torch.float32
    with torch.device("meta"):
        dense = QuantLinear(layer.in_features, layer.out_features, layer.bias is not None, UnquantizedLinearMethod(),
                            dtype)
    dense.weight = nn.Parameter(layer.packed.dequantize(dtype=dtype), requires_grad=False)
    if layer.bias is not None:
        dense.bias = nn.Parameter(layer.bias.detach().to(dtype), requires_grad=False)
    dense.method.process_weights_after_loading(dense)
    return dense


class PackedEmbedding(nn.Module):
    """A token embedding kept in `qtype` blocks; a lookup dequantizes only the rows it reads."""

    def __init__(self, qtype: str, num_embeddings: int, embedding_dim: int, dtype: torch.dtype,
                 dense_batches: bool = False):
        super().__init__()
        self.qtype, self.dtype, self.dense_batches = qtype, dtype, dense_batches
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        blocks = torch.empty(num_embeddings, row_bytes(qtype, embedding_dim), dtype=torch.uint8)
        self.weight = nn.Parameter(blocks, requires_grad=False)
        self._packed: PackedMatrix | None = None

    def packed(self) -> PackedMatrix:
        layout = row_group(self.weight)  # the tied head may have grouped the shared blocks since
        if self._packed is None or (self._packed.blocks.data_ptr(), self._packed.row_group) != (
                self.weight.data_ptr(), layout):
            self._packed = PackedMatrix(self.qtype, self.weight.data, self.embedding_dim, row_group=layout)
        return self._packed

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.packed().dequantize(ids.reshape(-1), self.dtype)
        return rows.reshape(*ids.shape, self.embedding_dim)

    def as_linear(self) -> nn.Module:
        """The tied LM head: a linear layer over the same blocks (shared, not copied)."""
        from pagedserve.quant.linear import QuantLinear

        method = GgufLinearMethod(self.qtype, self.dense_batches)
        with torch.device("meta"):
            head = QuantLinear(self.embedding_dim, self.num_embeddings, False, method, self.dtype)
        head.weight = self.weight
        head.compute_dtype = self.dtype
        method.process_weights_after_loading(head)
        return head


@dataclass(frozen=True, slots=True)
class GgufConfig(QuantConfig):
    """`tensor_types`: HF tensor name (`model.layers.0.self_attn.q_proj.weight`) -> GGUF type, for the tensors the
    loader hands over packed."""

    tensor_types: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    dense_batches: bool = False  # also keep each matrix expanded for many-row calls (see the module docstring)
    name = "gguf"

    def __post_init__(self) -> None:
        for tensor, qtype in self.tensor_types.items():
            if qtype not in FORMATS:
                raise QuantConfigError(f"tensor_types.{tensor}", f"{qtype!r} has no packed kernel; "
                                       f"supported: {', '.join(FORMATS)}")

    @classmethod
    def from_hf(cls, quantization_config: dict[str, Any]) -> "GgufConfig":
        types = quantization_config.get("tensor_types", {})
        if not isinstance(types, dict):
            raise QuantConfigError("tensor_types", f"expected an object, got {type(types).__name__}")
        dense = quantization_config.get("dense_batches", False)
        if not isinstance(dense, bool):
            raise QuantConfigError("dense_batches", f"expected true or false, got {dense!r}")
        return cls(MappingProxyType(dict(types)), dense)

    def linear_method(self, prefix: str) -> LinearMethod:
        qtype = self.tensor_types.get(f"{prefix}.weight")
        return GgufLinearMethod(qtype, self.dense_batches) if qtype is not None else UnquantizedLinearMethod()

    def embedding(self, prefix: str, num_embeddings: int, embedding_dim: int, dtype: torch.dtype) -> nn.Module:
        qtype = self.tensor_types.get(f"{prefix}.weight")
        if qtype is None:
            # QuantConfig's, named: zero-argument super() fails in a slotted dataclass (a class rebuilt by @dataclass)
            return QuantConfig.embedding(self, prefix, num_embeddings, embedding_dim, dtype)
        return PackedEmbedding(qtype, num_embeddings, embedding_dim, dtype, self.dense_batches)

    def describe(self) -> str:
        kinds = sorted(set(self.tensor_types.values()))
        return f"gguf (packed {', '.join(kinds)})" if kinds else "gguf"
