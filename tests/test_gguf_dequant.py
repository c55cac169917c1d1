"""engine/loading/gguf_dequant.py's whole-tensor dequantization is gguf.quants.dequantize's, bit for bit: on every
block of the types the shipped models use (both files, whole), on random blocks of any bytes, across chunk
boundaries, and for types it leaves to gguf."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize as gguf_dequantize

from gguf_fixtures import quantized
from pagedserve.engine.loading import gguf_dequant
from pagedserve.engine.loading.gguf_dequant import dequantize
from pagedserve.engine.loading.gguf_file import GgufFile
from pagedserve.engine.loading.model_store import gemma3_270m_gguf, resolve_model

FAST = tuple(gguf_dequant._BLOCK_FORMULAS)


def _assert_same_bits(ours: np.ndarray, expected: np.ndarray) -> None:
    """Equal bit patterns; NaNs (from random fp16 scales) only need to be NaN in both: x86 may pass either
    operand's payload through a multiply."""
    assert ours.dtype == np.float32 and ours.shape == expected.shape
    nan = np.isnan(expected)
    assert np.array_equal(np.isnan(ours), nan)
    assert np.array_equal(ours.view(np.uint32)[~nan], expected.view(np.uint32)[~nan])


def test_the_fast_types_are_the_shipped_models():
    assert set(FAST) == {T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q4_K, T.Q6_K}


@pytest.mark.parametrize("path_of", [lambda: resolve_model(None).weights, gemma3_270m_gguf], ids=["smollm2", "gemma3"])
def test_every_tensor_of_the_shipped_models(path_of):
    """Every tensor of both files (the embeddings' first 4096 rows: Gemma 3's 262k rows take gguf 1-3 s): what
    every fp32 load reads."""
    file = GgufFile(path_of())
    seen = set()
    for info in file.infos:
        data = file.data(info.name)[:4096]
        ours = dequantize(data, info.qtype)
        _assert_same_bits(np.asarray(ours), gguf_dequantize(data, info.qtype).astype(np.float32))
        seen.add(info.qtype)
    assert seen & set(FAST) == ({T.Q4_1, T.Q8_0} if "SmolLM2" in file.path.name else {T.Q5_0, T.Q4_K, T.Q6_K, T.Q8_0})


@pytest.mark.parametrize("qtype", FAST, ids=lambda t: t.name)
def test_random_bytes(qtype):
    """Any byte pattern, scales included (inf, NaN, subnormal fp16), over blocks that end mid-chunk."""
    block, size = GGML_QUANT_SIZES[qtype]
    step = gguf_dequant._CHUNK_VALUES // block
    rng = np.random.default_rng(qtype.value)
    data = rng.integers(0, 256, (2 * step + 3, size), dtype=np.uint8)
    with np.errstate(invalid="ignore", over="ignore"):  # inf scales times zero
        _assert_same_bits(dequantize(data, qtype), gguf_dequantize(data, qtype))


@pytest.mark.parametrize("qtype", FAST, ids=lambda t: t.name)
def test_quantized_rows_keep_their_shape(qtype):
    """A 3-D tensor's rows of blocks as a file stores them (finite values): the shape is gguf's too."""
    rng = np.random.default_rng(1)
    stored = quantized(rng.normal(0, 1, (6, 512)).astype(np.float32), qtype, rng).reshape(2, 3, -1)
    ours = dequantize(stored, qtype)
    assert ours.shape == (2, 3, 512) and np.isfinite(ours).all()
    _assert_same_bits(ours, gguf_dequantize(stored, qtype))


def test_other_types_go_to_gguf():
    rng = np.random.default_rng(2)
    stored = quantized(rng.normal(0, 1, (2, 256)).astype(np.float32), T.Q5_1, rng)
    assert T.Q5_1 not in FAST
    _assert_same_bits(dequantize(stored, T.Q5_1), gguf_dequantize(stored, T.Q5_1))


def test_a_row_of_partial_blocks_is_refused():
    with pytest.raises(ValueError, match="Q4_1 row of 30 bytes"):
        dequantize(np.zeros((2, 30), np.uint8), T.Q4_1)
