"""The ctypes mirrors of the kernels' C structures, in one place: field order and types follow the C definitions
named beside each, and kernels/cpu/build.py checks every one against the C `sizeof` when its library loads
(engine/runner/native_step.py checks its own StepLayer/StepModel/StepBatch the same way)."""

from __future__ import annotations

import ctypes

_p, _i32, _i64, _f32, _int = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_float, ctypes.c_int


class DecodeArgs(ctypes.Structure):
    # DecodeArgs in decode_attention.h.
    _fields_ = [
        ("query", _p), ("q_token_stride", _i64), ("out", _p), ("q_dtype", _int),
        ("k_cache", _p), ("v_cache", _p), ("kv_dtype", _int), ("k_scale", _p), ("v_scale", _p),
        ("k_row_scale", _p), ("v_row_scale", _p), ("block_tables", _p), ("block_table_stride", _i64), ("seq_lens", _p), ("rows", _p),
        ("num_heads", _i64), ("num_kv_heads", _i64), ("head_dim", _i64), ("num_blocks", _i64), ("block_size", _i64),
        ("scale", _f32), ("window", _i64),
    ]


def _prefill_fields() -> list[tuple[str, type]]:
    """PrefillArgs in prefill_attention.c is DecodeArgs with each chunk's query_lens after rows."""
    fields = list(DecodeArgs._fields_)
    fields.insert([name for name, _ in fields].index("rows") + 1, ("query_lens", _p))
    return fields


class PrefillArgs(ctypes.Structure):
    _fields_ = _prefill_fields()


class PsLinear(ctypes.Structure):
    # ps_linear in linear.h.
    _fields_ = [("fn", _p), ("state", _p), ("in_features", _i64), ("out_features", _i64)]


class DenseLinearState(ctypes.Structure):
    # DenseLinear in dense_linear.h.
    _fields_ = [("weight", _p), ("bias", _p), ("w_dtype", _int), ("bias_dtype", _int), ("in_features", _i64),
                ("out_features", _i64), ("row_group", _i32), ("x_fp32", _i32)]


class PackedState(ctypes.Structure):
    # ps_packed_state in packed_blocks.h.
    _fields_ = [("format", _i32), ("num_threads", _i32), ("in_features", _i64), ("out_features", _i64),
                ("data", _p), ("row_bytes", _i64), ("bias", _p), ("int8_max_rows", _i32), ("row_group", _i32)]


class GroupState(ctypes.Structure):
    # ps_group_state in group_state.h.
    _fields_ = [("bits", _i32), ("num_threads", _i32), ("in_features", _i64), ("out_features", _i64),
                ("groups", _i64), ("codes", _p), ("scales", _p), ("scale_f16", _i32), ("row_group", _i32),
                ("zeros", _p), ("run_group", _p), ("perm", _p), ("bias", _p)]


# C name (ps_sizeof_<name>) -> mirror, per library.
NATIVE_STRUCTS = (("decode_args", DecodeArgs), ("prefill_args", PrefillArgs), ("linear", PsLinear),
                  ("dense_linear", DenseLinearState))
PACKED_STRUCTS = (("packed_state", PackedState), ("group_state", GroupState))
