"""gguf's GGUFReader over a plain ndarray view of the memory map: the reader the tests hand transformers (its GGUF
loader, the oracle of the GGUF tests, takes a GGUFReader) and compare real files with.

gguf 0.19 reads every value (each of a vocabulary's strings and lengths) as a slice of the np.memmap, and a memmap
slice costs a Python-level __array_finalize__: 3 s for the default model's 49k-token vocabulary, where this view
takes 0.5 s (2.5 s for Gemma 3's 262k). It reads the same bytes with the same dtypes and byte order, so its
fields and tensors equal the stock reader's (tests/test_gguf_header.py checks that); tensor data are ndarray views of
the map rather than memmap ones. The engine reads headers with engine/loading/gguf_header.py instead.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
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


def gguf_reader(path: Path | str) -> GGUFReader:
    return PlainViewReader(path)
