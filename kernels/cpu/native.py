"""The native CPU library (decode and prefill attention, KV write, layer ops, dense GEMV, LoRA delta, the whole decode
step) as kernels/cpu/build.py builds it, and the decode attention's and KV write's Python entry points."""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from pagedserve.kernels.cpu.build import LibrarySpec, NativeBuildError, load
from pagedserve.kernels.cpu.structs import NATIVE_STRUCTS, DecodeArgs
from pagedserve.kernels.kv_cache import LayerKVCache

logger = logging.getLogger(__name__)

# The DT_* codes of native.h.
_DTYPE_CODES = {
    torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.float8_e4m3fn: 3, torch.float8_e5m2: 4, torch.int8: 5,
}
# Query, output and activation dtypes the C code computes in (the FP8 and int8 codes are KV-cache storage only).
COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# libgomp's spin counts when GOMP_SPINCOUNT is unset (its env.c): ACTIVE ~5 minutes of polling, unset ~3 ms at its
# own estimate of 100000 polls a millisecond, PASSIVE none.
_POLICY_SPINS = {"ACTIVE": 30_000_000_000, "PASSIVE": 0}
_DEFAULT_SPINS = 300_000
_SPIN_SUFFIXES = {"k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


def spin_count(env: Mapping[str, str]) -> int:
    """How many times a waiting libgomp thread polls before it sleeps, as libgomp derives it from `env` when torch
    loads it: GOMP_SPINCOUNT where it parses (a count with an optional k/M/G/T suffix, or "infinite"), which wins
    over OMP_WAIT_POLICY; else the policy's (ACTIVE: ~forever, PASSIVE: 0, unset: 300000)."""
    raw = env.get("GOMP_SPINCOUNT", "").strip()
    if raw.lower() in ("infinite", "infinity"):
        return _POLICY_SPINS["ACTIVE"]
    scale = _SPIN_SUFFIXES.get(raw[-1:], 1)
    digits = raw[:-1] if scale > 1 else raw
    if digits.isdigit():
        return int(digits) * scale
    return _POLICY_SPINS.get(env.get("OMP_WAIT_POLICY", "").strip().upper(), _DEFAULT_SPINS)


def pool_sleeps(env: Mapping[str, str]) -> bool:
    """Whether libgomp's threads go to sleep as soon as a parallel region ends (PASSIVE, or GOMP_SPINCOUNT=0): then
    each region pays a wake-up (SplitThresholds), and a taken core is left to its other process without the
    engine's thread governor. A pool that polls first, however briefly, counts as spinning."""
    return spin_count(env) == 0


def dtype_code(dtype: torch.dtype) -> int:
    """The C files' DT_* code for a torch dtype."""
    return _DTYPE_CODES[dtype]


def load_library(tier: str | None = None) -> ctypes.CDLL:
    """The compiled library for `tier` (None: PAGEDSERVE_CPU_ISA's when first called, else -march=native; see
    kernels/cpu/isa.py). Raises NativeBuildError."""
    return load(SPEC, tier)


def _declare_signatures(lib: ctypes.CDLL) -> None:
    ptr, i64, f32, c_int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
    lib.pagedserve_decode_attention.argtypes = [ctypes.POINTER(DecodeArgs), i64, i64, c_int]
    lib.pagedserve_decode_key_chunk.restype = i64
    lib.pagedserve_prefill_attention.argtypes = [ctypes.c_void_p, i64, c_int]  # a PrefillArgs (prefill.py)
    lib.pagedserve_prefill_amx.argtypes = [i64]
    lib.pagedserve_write_kv.argtypes = [ptr, i64, ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, i64]
    lib.pagedserve_write_kv_int8.argtypes = [ptr, i64, ptr, i64, c_int, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64]
    lib.pagedserve_write_kv_fp8.argtypes = [ptr, i64, ptr, i64, c_int, c_int, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64]
    lib.pagedserve_gather_kv.argtypes = [ptr, c_int, ptr, ptr, ptr, i64, i64, i64, i64, i64, ptr, c_int, c_int]
    lib.pagedserve_rms_norm.argtypes = [ptr, ptr, ptr, ptr, i64, i64, f32, c_int, c_int]
    lib.pagedserve_silu_and_mul.argtypes = [ptr, ptr, i64, i64, c_int, c_int]
    lib.pagedserve_rope.argtypes = [ptr, i64, ptr, ptr, ptr, i64, i64, i64, c_int, c_int]
    lib.pagedserve_row_max_argmax.argtypes = [ptr, i64, i64, i64, ptr, ptr, c_int]
    lib.pagedserve_decode_step.argtypes = [ptr, ptr, i64, c_int]  # StepModel, StepBatch (engine/runner/native_step.py)
    lib.pagedserve_decode_step.restype = c_int
    # x, x stride, out, out stride, dtype, in, out features, groups, spans, LoraRefs (kernels/cpu/lora.py), threads
    lib.pagedserve_lora_delta.argtypes = [ptr, i64, ptr, i64, c_int, i64, i64, i64, ptr, ptr, c_int]
    lib.pagedserve_lora_delta.restype = c_int
    for name in ("pagedserve_dense_linear", "pagedserve_dense_linear_portable"):  # ps_linear_fn (linear.h)
        getattr(lib, name).argtypes = [ptr, ptr, i64, ptr]
        getattr(lib, name).restype = c_int
    lib.pagedserve_dense_grouped_isa.restype = ctypes.c_char_p
    # state (DenseLinear), x, x dtype, rows, y, y dtype, allow AMX (quant/dense_native.py's dense_gemm)
    lib.pagedserve_dense_gemm.argtypes = [ptr, ptr, c_int, i64, ptr, c_int, c_int]
    lib.pagedserve_dense_gemm.restype = c_int
    # state (a row-major fp32 DenseLinear), x fp32, rows, y fp32 (quant/dense_native.py's dense_rows_gemm)
    lib.pagedserve_dense_rows_gemm.argtypes = [ptr, ptr, i64, ptr]
    lib.pagedserve_dense_rows_gemm.restype = c_int
    lib.pagedserve_dense_gemm_isa.argtypes = [c_int, c_int]
    lib.pagedserve_dense_gemm_isa.restype = ctypes.c_char_p
    lib.pagedserve_isa_tier.restype = ctypes.c_char_p
    for fn in (lib.pagedserve_decode_attention, lib.pagedserve_prefill_attention, lib.pagedserve_write_kv,
               lib.pagedserve_write_kv_int8, lib.pagedserve_write_kv_fp8, lib.pagedserve_gather_kv,
               lib.pagedserve_rms_norm, lib.pagedserve_silu_and_mul, lib.pagedserve_rope, lib.pagedserve_row_max_argmax):
        fn.restype = c_int


SPEC = LibrarySpec(
    name="native",
    sources=tuple(f"{name}.c" for name in ("decode_attention", "decode_tasks", "prefill_attention", "prefill_dpbf16",
                                            "prefill_amx", "layer_ops", "kv_write", "dense_linear", "dense_grouped",
                                            "dense_gemm", "dense_rows", "dense_amx", "decode_step", "lora")),
    structs=NATIVE_STRUCTS,
    declare=_declare_signatures,
)


def available() -> bool:
    """True when the kernels build and load here; logs why once when they don't."""
    try:
        load_library()
    except NativeBuildError as exc:
        _warn_once(str(exc))
        return False
    return True


@functools.cache
def _warn_once(message: str) -> None:
    logger.warning("native CPU kernels unavailable, using torch code: %s", message)


@dataclass(frozen=True, slots=True)
class DecodeBatch:
    """The decode rows of one step, as the native kernel reads them. Built once per step, shared by all layers."""

    rows: torch.Tensor  # [S] int64: each decode sequence's query row
    seq_lens: torch.Tensor  # [S] int32: context length including the new token
    block_tables: torch.Tensor  # [S, B] int32, contiguous; entries before the window may be -1 (freed)
    max_seq_len: int
    window: int | None = None  # sliding window: the row at position p sees keys p - window < k <= p

    def __post_init__(self) -> None:
        n = self.rows.shape[0]
        assert self.rows.dtype == torch.int64 and self.seq_lens.dtype == torch.int32
        assert self.seq_lens.shape == (n,) and self.block_tables.shape[0] == n and self.block_tables.dim() == 2
        assert self.block_tables.dtype == torch.int32 and self.block_tables.is_contiguous()
        assert self.window is None or self.window >= 1


class PagedRows(Protocol):
    """What both kernels read of a DecodeBatch or a PrefillBatch (prefill.py)."""

    rows: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    window: int | None


def attention_fields(
    query: torch.Tensor, out: torch.Tensor, cache: LayerKVCache, batch: PagedRows, scale: float
) -> dict[str, Any]:
    """The DecodeArgs fields both native attention kernels read (PrefillArgs adds query_lens), checked once:
    query, out [T, H, D] CPU tensors of one dtype (query's heads contiguous, out dense); the cache's head-major
    storage [Hkv, num_blocks, block_size, D] and its [Hkv] fp32 scales (int8: and its row scales)."""
    k_storage, v_storage = LayerKVCache.by_head(cache.k), LayerKVCache.by_head(cache.v)
    k_scale, v_scale = cache.k_scale, cache.v_scale
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads, num_blocks, block_size, _ = k_storage.shape
    assert query.stride(2) == 1 and query.stride(1) == head_dim and out.is_contiguous() and out.shape == query.shape
    assert query.dtype in COMPUTE_DTYPES and out.dtype == query.dtype, f"query dtype {query.dtype} unsupported"
    assert k_storage.is_contiguous() and v_storage.is_contiguous() and v_storage.shape == k_storage.shape
    assert k_storage.shape[3] == head_dim and num_heads % num_kv_heads == 0
    assert k_scale.dtype == v_scale.dtype == torch.float32 and k_scale.shape == v_scale.shape == (num_kv_heads,)
    return dict(
        query=query.data_ptr(), q_token_stride=query.stride(0), out=out.data_ptr(), q_dtype=dtype_code(query.dtype),
        k_cache=k_storage.data_ptr(), v_cache=v_storage.data_ptr(), kv_dtype=dtype_code(k_storage.dtype),
        k_scale=k_scale.data_ptr(), v_scale=v_scale.data_ptr(),
        k_row_scale=row_scales_ptr(cache.k_row_scale), v_row_scale=row_scales_ptr(cache.v_row_scale),
        block_tables=batch.block_tables.data_ptr(), block_table_stride=batch.block_tables.stride(0),
        seq_lens=batch.seq_lens.data_ptr(), rows=batch.rows.data_ptr(),
        num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, num_blocks=num_blocks,
        block_size=block_size, scale=scale, window=batch.window or 0,
    )


def row_scales_ptr(row_scale: torch.Tensor | None) -> int | None:
    """The address of an int8 cache's head-major row scales (LayerKVCache.k_row_scale / v_row_scale), None without."""
    return None if row_scale is None else LayerKVCache.scales_by_head(row_scale).data_ptr()


def decode_attention(
    query: torch.Tensor, out: torch.Tensor, cache: LayerKVCache, batch: DecodeBatch, scale: float,
    num_threads: int | None = None,
) -> None:
    """out[rows] = attention(query[rows]) over the paged cache; tensors as `attention_fields` takes them. On torch's
    thread count unless `num_threads` is given (a row's result does not depend on it)."""
    args = DecodeArgs(**attention_fields(query, out, cache, batch, scale))
    threads = torch.get_num_threads() if num_threads is None else num_threads
    status = load_library().pagedserve_decode_attention(
        ctypes.byref(args), batch.rows.shape[0], batch.max_seq_len, threads
    )
    if status != 0:
        raise MemoryError("native decode attention could not allocate its per-thread scratch")


def decode_key_chunk() -> int:
    """The decode attention's key chunk (decode_chunks.h): rows' keys are cut at its multiples."""
    return load_library().pagedserve_decode_key_chunk()


def write_kv(key: torch.Tensor, value: torch.Tensor, k_storage: torch.Tensor, v_storage: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """key, value [T, Hkv, D] (token rows may be strided, heads dense) -> their slots of the head-major storage
    [Hkv, num_blocks, block_size, D] of the same dtype. Raises IndexError for a slot outside the storage."""
    num_kv_heads, num_blocks, block_size, head_dim = k_storage.shape
    for x in (key, value):
        assert x.dtype == k_storage.dtype and x.shape[1:] == (num_kv_heads, head_dim)
        assert x.stride(2) == 1 and x.stride(1) == head_dim
    assert k_storage.is_contiguous() and v_storage.is_contiguous() and v_storage.shape == k_storage.shape
    assert slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous() and slot_mapping.shape == key.shape[:1]
    status = load_library().pagedserve_write_kv(
        key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0), k_storage.data_ptr(), v_storage.data_ptr(),
        slot_mapping.data_ptr(), key.shape[0], num_kv_heads, num_blocks * block_size, head_dim, key.element_size(),
    )
    if status != 0:
        raise IndexError(f"a KV slot is outside the cache's {num_blocks * block_size} slots")


def write_kv_int8(key: torch.Tensor, value: torch.Tensor, cache: LayerKVCache, slot_mapping: torch.Tensor) -> None:
    """key, value [T, Hkv, D] in a compute dtype (token rows may be strided, heads dense) -> their slots of an int8
    cache, each row with its own fp16 scale, byte for byte kv_quant.quantize_rows_int8. Raises IndexError for a slot
    outside the storage."""
    k_storage, v_storage = LayerKVCache.by_head(cache.k), LayerKVCache.by_head(cache.v)
    num_kv_heads, num_blocks, block_size, head_dim = k_storage.shape
    for x in (key, value):
        assert x.dtype in COMPUTE_DTYPES and x.dtype == key.dtype and x.shape[1:] == (num_kv_heads, head_dim)
        assert x.stride(2) == 1 and x.stride(1) == head_dim
    assert k_storage.dtype == torch.int8 and cache.k_row_scale is not None and cache.v_row_scale is not None
    assert slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous() and slot_mapping.shape == key.shape[:1]
    status = load_library().pagedserve_write_kv_int8(
        key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0), dtype_code(key.dtype), k_storage.data_ptr(),
        v_storage.data_ptr(), row_scales_ptr(cache.k_row_scale), row_scales_ptr(cache.v_row_scale),
        slot_mapping.data_ptr(), key.shape[0], num_kv_heads, num_blocks * block_size, head_dim,
    )
    if status == -2:
        raise MemoryError("native int8 KV write could not allocate a row")
    if status != 0:
        raise IndexError(f"a KV slot is outside the cache's {num_blocks * block_size} slots")


def write_kv_fp8(key: torch.Tensor, value: torch.Tensor, cache: LayerKVCache, slot_mapping: torch.Tensor) -> None:
    """key, value [T, Hkv, D] in a compute dtype (token rows may be strided, heads dense) -> their slots of an FP8
    cache, byte for byte kv_quant.store_kv (divided by the head's scale, clamped, rounded to nearest even). Raises
    IndexError for a slot outside the storage."""
    k_storage, v_storage = LayerKVCache.by_head(cache.k), LayerKVCache.by_head(cache.v)
    num_kv_heads, num_blocks, block_size, head_dim = k_storage.shape
    for x in (key, value):
        assert x.dtype in COMPUTE_DTYPES and x.dtype == key.dtype and x.shape[1:] == (num_kv_heads, head_dim)
        assert x.stride(2) == 1 and x.stride(1) == head_dim
    assert cache.dtype.is_fp8
    assert slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous() and slot_mapping.shape == key.shape[:1]
    k_scale, v_scale = (s.to(torch.float32).contiguous() for s in (cache.k_scale, cache.v_scale))
    status = load_library().pagedserve_write_kv_fp8(
        key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0), dtype_code(key.dtype),
        dtype_code(k_storage.dtype), k_storage.data_ptr(), v_storage.data_ptr(), k_scale.data_ptr(),
        v_scale.data_ptr(), slot_mapping.data_ptr(), key.shape[0], num_kv_heads, num_blocks * block_size, head_dim,
    )
    if status != 0:
        raise IndexError(f"a KV slot is outside the cache's {num_blocks * block_size} slots")


def gather_kv_8bit(cache: LayerKVCache, tiles: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_quant.gather_kv for an 8-bit cache (int8 or FP8; head_dim a multiple of 16), in one native pass per tensor:
    the same values, bit for bit. tiles: [Hkv * N] int64 (kv_quant.head_tiles)."""
    assert cache.dtype.is_8bit, "16-bit caches gather with index_select"
    assert dtype in COMPUTE_DTYPES and tiles.dtype == torch.int64 and tiles.is_contiguous()
    out = []
    for tensor, head_scale, row_scale in ((cache.k, cache.k_scale, cache.k_row_scale),
                                          (cache.v, cache.v_scale, cache.v_row_scale)):
        storage = LayerKVCache.by_head(tensor)
        num_kv_heads, num_blocks, block_size, head_dim = storage.shape
        assert head_dim % 16 == 0 and tiles.shape[0] % num_kv_heads == 0
        per_head = tiles.shape[0] // num_kv_heads
        result = torch.empty(num_kv_heads, per_head * block_size, head_dim, dtype=dtype)
        head_scale = head_scale.to(torch.float32).contiguous()
        status = load_library().pagedserve_gather_kv(
            storage.data_ptr(), dtype_code(storage.dtype), row_scales_ptr(row_scale), head_scale.data_ptr(),
            tiles.data_ptr(), per_head, num_kv_heads, num_kv_heads * num_blocks, block_size, head_dim,
            result.data_ptr(), dtype_code(dtype), torch.get_num_threads(),
        )
        if status != 0:
            raise IndexError(f"a KV tile is outside the cache's {num_kv_heads * num_blocks} tiles")
        out.append(result)
    return out[0], out[1]
