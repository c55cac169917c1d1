"""A GGUF file's header (version, metadata key/values, tensor infos) read straight from its bytes.

gguf's GGUFReader builds numpy arrays for every value, two per string: for a vocabulary that is ~150k Python-level
calls per 49k tokens, 0.5 s of each start of the default model and 2.4 s of Gemma 3's (262k tokens). Here scalars are
read with struct, number arrays as one numpy view, and the long arrays the loader only counts are walked without
being decoded. The values equal GGUFReader's `field.contents()` (tests/test_gguf_header.py compares them).
Layout: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
"""

from __future__ import annotations

import struct
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType, GGUFValueType

_VERSIONS = (2, 3)  # gguf's READER_SUPPORTED_VERSIONS: version 1 had 32-bit counts
# struct codes of the scalar value types (numpy reads the same codes for arrays)
_SCALAR_CODES = {
    GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H", GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i", GGUFValueType.FLOAT32: "f", GGUFValueType.UINT64: "Q",
    GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d", GGUFValueType.BOOL: "?",
}


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    qtype: GGMLQuantizationType
    dims: tuple[int, ...]  # GGUF order: the fastest-varying dimension first
    offset: int  # absolute, in the file
    n_bytes: int


@dataclass(frozen=True, slots=True)
class GgufHeader:
    byte_order: str  # "<" or ">": the struct / numpy prefix of every value in the file
    metadata: dict[str, Any]  # key -> value as GGUFReader's contents(), or the length for a counted array
    tensors: tuple[TensorInfo, ...]
    data_offset: int


class _Cursor:
    """A read position in the file's bytes; every read checks the file is long enough (a truncated file fails
    here by name, not with garbage values)."""

    def __init__(self, buf: memoryview, order: str):
        self.buf, self.pos, self.order = buf, 0, order

    def need(self, size: int) -> None:
        if size < 0 or self.pos + size > len(self.buf):
            raise ValueError(f"the header runs past the end of the file (at byte {self.pos}, {size} more wanted)")

    def scalar(self, code: str) -> Any:
        fmt = struct.Struct(self.order + code)
        self.need(fmt.size)
        (value,) = fmt.unpack_from(self.buf, self.pos)
        self.pos += fmt.size
        return value

    def string(self) -> str:
        size = self.scalar("Q")
        self.need(size)
        text = str(self.buf[self.pos:self.pos + size], encoding="utf-8")
        self.pos += size
        return text

    def skip_strings(self, count: int) -> None:
        """Walks `count` strings without decoding them: each length leads to the next (no vectorizing that)."""
        self.need(8 * count)  # a damaged count fails at once, not after a walk to the end of the file
        length, buf, pos = struct.Struct(self.order + "Q").unpack_from, self.buf, self.pos
        for _ in range(count):
            pos += 8 + length(buf, pos)[0]  # struct.error past the end; the check below catches a long last one
        self.need(pos - self.pos)
        self.pos = pos

    def numbers(self, code: str, count: int, counted: bool) -> list[Any] | int:
        dtype = np.dtype(self.order + code)
        self.need(dtype.itemsize * count)
        values = np.frombuffer(self.buf, dtype, count, self.pos)
        self.pos += dtype.itemsize * count
        return count if counted else values.tolist()


def read_header(buf: memoryview, counted: frozenset[str] = frozenset()) -> GgufHeader:
    """The header of the GGUF file in `buf`; arrays under the keys in `counted` come as their length. ValueError
    (or struct.error) for a file that is not a readable GGUF."""
    if len(buf) < 8 or struct.unpack_from("<I", buf)[0] != GGUF_MAGIC:
        raise ValueError("GGUF magic invalid")
    native, swapped = ("<", ">") if sys.byteorder == "little" else (">", "<")
    # A file written for the other byte order reads as a version with its low 16 bits zero (gguf's own test).
    order = swapped if struct.unpack_from(native + "I", buf, 4)[0] & 0xFFFF == 0 else native
    cursor = _Cursor(buf, order)
    cursor.pos = 4
    version = cursor.scalar("I")
    if version not in _VERSIONS:
        raise ValueError(f"GGUF version {version} is not supported (supported: {', '.join(map(str, _VERSIONS))})")
    tensor_count, kv_count = cursor.scalar("Q"), cursor.scalar("Q")
    metadata: dict[str, Any] = {"GGUF.version": version, "GGUF.tensor_count": tensor_count, "GGUF.kv_count": kv_count}
    alignment_type = None
    for _ in range(kv_count):
        key = cursor.string()
        if key in metadata:
            raise ValueError(f"duplicate metadata key {key}")
        value_type = GGUFValueType(cursor.scalar("I"))
        if key == "general.alignment":
            alignment_type = value_type
        metadata[key] = _value(cursor, value_type, key in counted)
    infos = [_tensor_info(cursor) for _ in range(tensor_count)]
    alignment = _alignment(metadata.get("general.alignment"), alignment_type)
    data_offset = -(-cursor.pos // alignment) * alignment
    return GgufHeader(order, metadata, _placed(infos, data_offset), data_offset)


def _value(cursor: _Cursor, value_type: GGUFValueType, counted: bool) -> Any:
    if value_type == GGUFValueType.STRING:
        return cursor.string()
    if value_type in _SCALAR_CODES:
        return cursor.scalar(_SCALAR_CODES[value_type])
    if value_type != GGUFValueType.ARRAY:
        raise ValueError(f"unknown metadata value type {value_type}")
    item_type, count = GGUFValueType(cursor.scalar("I")), cursor.scalar("Q")
    if item_type in _SCALAR_CODES:
        return cursor.numbers(_SCALAR_CODES[item_type], count, counted)
    if item_type == GGUFValueType.STRING and counted:
        cursor.skip_strings(count)
        return count
    # Strings, or arrays of arrays: gguf flattens the latter into one list of their items.
    items: list[Any] = []
    for _ in range(count):
        item = _value(cursor, item_type, False)
        if item_type == GGUFValueType.ARRAY:
            items.extend(item)
        else:
            items.append(item)
    return len(items) if counted else items


def _tensor_info(cursor: _Cursor) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
    name = cursor.string()
    n_dims = cursor.scalar("I")
    dims = tuple(cursor.numbers("Q", n_dims, False))
    return name, dims, GGMLQuantizationType(cursor.scalar("I")), cursor.scalar("Q")


def _alignment(value: Any, value_type: GGUFValueType | None) -> int:
    if value_type is None:
        return GGUF_DEFAULT_ALIGNMENT
    if value_type != GGUFValueType.UINT32:
        raise ValueError("Bad type for general.alignment field")
    if value == 0 or value & (value - 1):
        raise ValueError("Invalid alignment: must be a non-zero power of two")
    return value


def _placed(infos: list[tuple[str, tuple[int, ...], GGMLQuantizationType, int]], data_offset: int
            ) -> tuple[TensorInfo, ...]:
    """The tensor infos with absolute offsets and byte sizes; duplicate names are refused, as gguf does."""
    placed, names = [], set()
    for name, dims, qtype, offset in infos:
        if name in names:
            raise ValueError(f"Found duplicated tensor with name {name}")
        names.add(name)
        block, size = GGML_QUANT_SIZES[qtype]
        elements = int(np.prod(dims, dtype=np.int64)) if dims else 1
        placed.append(TensorInfo(name, qtype, dims, data_offset + offset, elements * size // block))
    return tuple(placed)
