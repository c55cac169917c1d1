"""One GGUF file: its metadata and tensor infos read by engine/loading/gguf_header.py, its tensors dequantized by
engine/loading/gguf_dequant.py (gguf's own values, faster for the shipped models' types) or handed over as blocks."""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from gguf.constants import GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape

from pagedserve.engine.errors import ModelLoadError
from pagedserve.engine.loading.gguf_dequant import dequantize
from pagedserve.engine.loading.gguf_header import TensorInfo, read_header

# The tensor types the loader accepts: each has a test comparing our values with gguf.quants.dequantize's
# (tests/test_gguf_types.py). gguf can dequantize more (IQ*, TQ*, MXFP4); those are refused by name rather than
# served untested.
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                   "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
# Vocabulary arrays are long (262,144 strings for Gemma 3): the metadata keeps their length (read without decoding
# them), and the tokenizer is built from the file by transformers (`tokenizer_dir` in gguf_checkpoint.py).
_LONG_ARRAYS = frozenset(("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type",
                          "tokenizer.ggml.merges"))


# Tensor types GGUFReader hands over as arrays of their element type; every other type comes as its blocks' bytes.
_ELEMENT_TYPES = {GGMLQuantizationType.F16: "f2", GGMLQuantizationType.F32: "f4", GGMLQuantizationType.F64: "f8",
                  GGMLQuantizationType.I8: "i1", GGMLQuantizationType.I16: "i2", GGMLQuantizationType.I32: "i4",
                  GGMLQuantizationType.I64: "i8"}


class GgufFile:
    """Metadata as plain Python values (`tokenizer.ggml.tokens` as its length) and the tensors by GGUF name."""

    def __init__(self, path: Path):
        self.path = path
        try:
            # A plain ndarray view of the map: slicing an np.memmap costs a Python-level __array_finalize__.
            self._bytes = np.memmap(path, mode="r").view(np.ndarray)
            header = read_header(memoryview(self._bytes), _LONG_ARRAYS)
            # Every tensor's bytes are placed now, so a truncated file fails here, before any work.
            self._data = {info.name: self._view(info, header.byte_order) for info in header.tensors}
        except Exception as exc:  # ValueError, struct.error, UnicodeDecodeError... for a damaged file
            raise ModelLoadError(f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc})") from None
        self.metadata = header.metadata
        self.infos: tuple[TensorInfo, ...] = header.tensors
        self.tensor_names = tuple(info.name for info in self.infos)
        self._types = {info.name: info.qtype for info in self.infos}

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise ModelLoadError(f"{self.path}: general.architecture is missing")
        return arch

    def type_counts(self) -> Counter[str]:
        return Counter(info.qtype.name for info in self.infos)

    def check_types(self) -> None:
        """Refuses the whole file before any work if one tensor's type is not supported."""
        for info in self.infos:
            if info.qtype.name not in SUPPORTED_TYPES:
                raise ModelLoadError(
                    f"{self.path}: tensor {info.name} has GGUF type {info.qtype.name}, unsupported; "
                    f"supported: {', '.join(SUPPORTED_TYPES)}")

    def tensor_types(self) -> dict[str, str]:
        """GGUF name -> type name of every matrix (tensors of two dimensions)."""
        return {info.name: info.qtype.name for info in self.infos if len(info.dims) == 2}

    def data(self, name: str) -> np.ndarray:
        """One tensor's stored data as GGUFReader's `tensor.data`: a read-only view of the map, shaped [rows, ...]
        (quantized types: uint8 [..., row_bytes]). KeyError when the file has none."""
        return self._data[name]

    def tensor(self, name: str) -> torch.Tensor:
        """One tensor's float32 values by GGUF name (KeyError when the file has none)."""
        return self._float32(name, self._types[name])

    def tensors(self, packed: frozenset[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
        """(GGUF name, float32 values in HF layout [out, in]) one tensor at a time, so only one is ever
        dequantized at once; tensors named in `packed` come as their blocks instead, uint8 [rows, row_bytes]."""
        for info in self.infos:
            if info.name in packed:
                yield info.name, _read_only_view(self._data[info.name])
            else:
                yield info.name, self._float32(info.name, info.qtype)

    def _float32(self, name: str, qtype: int) -> torch.Tensor:
        try:
            values = dequantize(self._data[name], qtype)
        except Exception as exc:  # a broken block surfaces here
            raise ModelLoadError(f"{self.path}: tensor {name}: cannot dequantize ({exc})") from None
        values = np.asarray(values, dtype=np.float32)
        if not values.flags.writeable:  # F32 comes back as a view of the read-only memory map
            values = values.copy()
        return torch.from_numpy(values)

    def _view(self, info: TensorInfo, byte_order: str) -> np.ndarray:
        """The tensor's bytes as GGUFReader shapes them: dims reversed (rows first), quantized rows as bytes."""
        shape = tuple(reversed(info.dims))
        element = _ELEMENT_TYPES.get(info.qtype)
        if element is None:
            dtype, shape = np.dtype(np.uint8), quant_shape_to_byte_shape(shape, info.qtype)
        else:
            dtype = np.dtype(byte_order + element)
        if info.offset + info.n_bytes > len(self._bytes):
            raise ValueError(f"tensor {info.name}: its data run past the end of the file")
        return self._bytes[info.offset:info.offset + info.n_bytes].view(dtype).reshape(shape)


def _read_only_view(blocks: np.ndarray) -> torch.Tensor:
    """The blocks as a tensor over the memory map, no copy: the loader copies them once, into the layer (a
    transient copy here would fragment the heap, which keeps freed memory, by a whole embedding's size)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch warns that the map is read-only; nothing writes to it
        return torch.from_numpy(blocks)
