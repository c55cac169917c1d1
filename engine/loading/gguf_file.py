"""One GGUF file read with the gguf package: its metadata, and its tensors dequantized by gguf's own code."""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pagedserve.engine.errors import ModelLoadError

# The tensor types the loader accepts: each has a test comparing our values with gguf.quants.dequantize's
# (tests/test_gguf_types.py). gguf can dequantize more (IQ*, TQ*, MXFP4); those are refused by name rather than
# served untested.
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                   "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
# Vocabulary arrays are long (262,144 strings for Gemma 3): the metadata keeps their length, and the tokenizer
# is built from the file by transformers (`tokenizer_dir` in engine/loading/gguf_checkpoint.py).
_LONG_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type",
                "tokenizer.ggml.merges")


class GgufFile:
    """Metadata as plain Python values (`tokenizer.ggml.tokens` as its length) and the tensors by GGUF name."""

    def __init__(self, path: Path):
        self.path = path
        try:
            self.reader = gguf_reader(path)
            self.metadata = {key: _value(key, field) for key, field in self.reader.fields.items()}
        except Exception as exc:  # gguf raises ValueError, IndexError, struct errors... for a damaged file
            raise ModelLoadError(f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc})") from None
        self.tensor_names = tuple(t.name for t in self.reader.tensors)

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise ModelLoadError(f"{self.path}: general.architecture is missing")
        return arch

    def type_counts(self) -> Counter[str]:
        return Counter(t.tensor_type.name for t in self.reader.tensors)

    def check_types(self) -> None:
        """Refuses the whole file before any work if one tensor's type is not supported."""
        for tensor in self.reader.tensors:
            if tensor.tensor_type.name not in SUPPORTED_TYPES:
                raise ModelLoadError(
                    f"{self.path}: tensor {tensor.name} has GGUF type {tensor.tensor_type.name}, unsupported; "
                    f"supported: {', '.join(SUPPORTED_TYPES)}")

    def tensor_types(self) -> dict[str, str]:
        """GGUF name -> type name of every matrix (tensors of two dimensions)."""
        return {t.name: t.tensor_type.name for t in self.reader.tensors if len(t.shape) == 2}

    def tensor(self, name: str) -> torch.Tensor:
        """One tensor's float32 values by GGUF name (KeyError when the file has none)."""
        from gguf.quants import dequantize

        for tensor in self.reader.tensors:
            if tensor.name == name:
                return torch.from_numpy(np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32))
        raise KeyError(name)

    def tensors(self, packed: frozenset[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
        """(GGUF name, float32 values in HF layout [out, in]) one tensor at a time, so only one is ever
        dequantized at once; tensors named in `packed` come as their blocks instead, uint8 [rows, row_bytes]."""
        from gguf.quants import dequantize

        for tensor in self.reader.tensors:
            if tensor.name in packed:
                yield tensor.name, _read_only_view(tensor.data)
                continue
            try:
                values = dequantize(tensor.data, tensor.tensor_type)
            except Exception as exc:  # a short file or a broken block surfaces here
                raise ModelLoadError(f"{self.path}: tensor {tensor.name}: cannot dequantize ({exc})") from None
            values = np.asarray(values, dtype=np.float32)
            if not values.flags.writeable:  # F32 comes back as a view of the read-only memory map
                values = values.copy()
            yield tensor.name, torch.from_numpy(values)


def gguf_reader(path: Path) -> Any:
    """gguf's GGUFReader, reading its header from a plain ndarray view of the memory map. gguf 0.19 reads every
    value (each of a 49k-token vocabulary's strings and lengths) as a slice of the np.memmap, and a memmap slice
    costs a Python-level __array_finalize__: 3 s of a 3.5 s open for the default model, paid by every server start.
    The plain view reads the same bytes with the same dtypes and byte order, so fields and tensors are unchanged
    (tests/test_gguf_types.py compares them with the stock reader's); tensor data are then ndarray views of the map
    rather than memmap ones."""
    import numpy.typing as npt
    from gguf.gguf_reader import GGUFReader  # its defining module: a caller may have replaced gguf.GGUFReader

    class PlainViewReader(GGUFReader):
        def _get(self, offset: int, dtype: npt.DTypeLike, count: int = 1,
                 override_order: str | None = None) -> npt.NDArray[Any]:
            plain = self.__dict__.get("_plain")
            if plain is None:  # self.data is set first thing in GGUFReader.__init__, before any _get
                plain = self._plain = self.data.view(np.ndarray)
            dtype, count = np.dtype(dtype), int(count)
            values = plain[offset:offset + dtype.itemsize * count].view(dtype)[:count]
            order = self.byte_order if override_order is None else override_order
            return values if order == "I" else values.view(values.dtype.newbyteorder(order))

    return PlainViewReader(path)


def _read_only_view(blocks: np.ndarray) -> torch.Tensor:
    """The blocks as a tensor over the memory map, no copy: the loader copies them once, into the layer (a
    transient copy here would fragment the heap, which keeps freed memory, by a whole embedding's size)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch warns that the map is read-only; nothing writes to it
        return torch.from_numpy(blocks)


def _value(key: str, field: Any) -> Any:
    if key in _LONG_ARRAYS:
        return len(field.data)
    return field.contents()
