"""engine/loading/gguf_header.py and GgufFile read what gguf's own GGUFReader reads: every metadata value (the long
vocabulary arrays as their length where the loader only counts them), every tensor's place, shape and bytes; on
written files of both byte orders and on the two shipped models. A damaged file fails by name."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFEndian, GGUFReader, GGUFValueType, GGUFWriter

from gguf_fixtures import add_tensor, finish, quantized
from gguf_plain_reader import gguf_reader
from pagedserve.engine.errors import ModelLoadError
from pagedserve.engine.loading.gguf_file import _LONG_ARRAYS, SUPPORTED_TYPES, GgufFile
from pagedserve.engine.loading.gguf_header import read_header
from pagedserve.engine.loading.model_store import gemma3_270m_gguf, resolve_model


def _write_mixed(path, endianess: GGUFEndian = GGUFEndian.LITTLE, alignment: int | None = None):
    """Every scalar type, strings, arrays of numbers, strings, bools and arrays, a vocabulary, every tensor type."""
    rng = np.random.default_rng(0)
    writer = GGUFWriter(str(path), "llama", endianess=endianess)
    if alignment:
        writer.add_custom_alignment(alignment)
    writer.add_name("mixed ünïcode 日本")
    for name, kind, value in (("u8", GGUFValueType.UINT8, 200), ("i8", GGUFValueType.INT8, -7),
                              ("u16", GGUFValueType.UINT16, 60000), ("i16", GGUFValueType.INT16, -300),
                              ("u32", GGUFValueType.UINT32, 4_000_000_000), ("i32", GGUFValueType.INT32, -5),
                              ("f32", GGUFValueType.FLOAT32, 0.1), ("u64", GGUFValueType.UINT64, 2**63 + 5),
                              ("i64", GGUFValueType.INT64, -(2**40)), ("f64", GGUFValueType.FLOAT64, 0.1),
                              ("yes", GGUFValueType.BOOL, True), ("no", GGUFValueType.BOOL, False),
                              ("empty", GGUFValueType.STRING, "")):
        writer.add_key_value(f"test.{name}", value, kind)
    writer.add_token_list(["<s>", "a", "", "Ġthe", "日本", "x" * 300])
    writer.add_token_scores([0.0, -1.5, -2.25, 3.0, 1e-3, 7.0])
    writer.add_token_types([3, 1, 1, 1, 1, 1])
    writer.add_token_merges(["a b", "Ġ t", "日 本"])
    writer.add_bos_token_id(0)  # a key after the vocabulary: the walk over it ends where the next key starts
    writer.add_array("test.flags", [True, False, True])
    writer.add_array("test.words", ["one", "two"])
    writer.add_array("test.floats", [0.5, -1.25])
    writer.add_key_value("test.nested", [[1, 2], [3, 4, 5]], GGUFValueType.ARRAY)
    writer.add_key_value("test.nested_words", [["a"], ["b", "c"]], GGUFValueType.ARRAY)
    for qtype in (T[name] for name in SUPPORTED_TYPES):
        add_tensor(writer, f"blk.0.{qtype.name.lower()}.weight",
                   quantized(rng.normal(0, 1, (2, 256)).astype(np.float32), qtype, rng), qtype)
    writer.add_tensor("output_norm.weight", rng.normal(0, 1, 64).astype(np.float32))  # one dimension
    finish(writer)
    return path


def _stock_metadata(reader: GGUFReader, counted: frozenset[str]) -> dict[str, object]:
    return {key: len(field.data) if key in counted else field.contents() for key, field in reader.fields.items()}


def _assert_same_tensors(ours: GgufFile, stock: GGUFReader) -> None:
    assert ours.tensor_names == tuple(t.name for t in stock.tensors)
    for info, tensor in zip(ours.infos, stock.tensors, strict=True):
        assert (info.qtype, list(info.dims), info.offset, info.n_bytes) == \
            (tensor.tensor_type, tensor.shape.tolist(), tensor.data_offset, tensor.n_bytes), info.name
        data = ours.data(info.name)
        assert (data.shape, data.dtype) == (tensor.data.shape, tensor.data.dtype), info.name
        assert np.array_equal(data, tensor.data) and not data.flags.writeable, info.name


@pytest.mark.parametrize("endianess", [GGUFEndian.LITTLE, GGUFEndian.BIG])
@pytest.mark.parametrize("alignment", [None, 64])
def test_a_written_file_reads_as_ggufs_reader_reads_it(tmp_path, endianess, alignment):
    path = _write_mixed(tmp_path / "mixed.gguf", endianess, alignment)
    stock = GGUFReader(path)
    assert stock.fields["test.nested"].contents() == [1, 2, 3, 4, 5]  # gguf flattens arrays of arrays
    ours = GgufFile(path)
    assert ours.metadata == _stock_metadata(stock, _LONG_ARRAYS)
    assert ours.metadata["tokenizer.ggml.tokens"] == 6 and ours.metadata["tokenizer.ggml.merges"] == 3
    assert list(ours.metadata) == list(stock.fields)
    full = read_header(memoryview(np.memmap(path, mode="r"))).metadata
    assert full == _stock_metadata(stock, frozenset())
    assert [type(value) for value in full.values()] == [type(f.contents()) for f in stock.fields.values()]
    _assert_same_tensors(ours, stock)


def test_the_plain_view_reader_reads_what_ggufs_own_reader_reads(tmp_path):
    """tests/gguf_plain_reader.py, the tests' stand-in for GGUFReader (transformers' oracle loads through it)."""
    path = _write_mixed(tmp_path / "mixed.gguf")
    plain, stock = gguf_reader(path), GGUFReader(path)
    assert list(plain.fields) == list(stock.fields)
    for name, field in stock.fields.items():
        mine = plain.fields[name]
        assert (mine.offset, mine.data, mine.types) == (field.offset, field.data, field.types), name
        assert [(p.dtype, p.tolist()) for p in mine.parts] == [(p.dtype, p.tolist()) for p in field.parts], name
    assert plain.data_offset == stock.data_offset
    for mine, tensor in zip(plain.tensors, stock.tensors, strict=True):
        assert (mine.name, mine.data_offset, mine.shape.tolist()) == (tensor.name, tensor.data_offset,
                                                                       tensor.shape.tolist())
        assert np.array_equal(mine.data, tensor.data) and not mine.data.flags.writeable


@pytest.mark.parametrize("path_of", [lambda: resolve_model(None).weights, gemma3_270m_gguf], ids=["smollm2", "gemma3"])
def test_the_shipped_models_read_as_ggufs_reader_reads_them(path_of):
    """The real vocabularies (49,152 and 262,144 tokens; merges, scores, token types): counted by the loader, and
    every value when asked."""
    path = path_of()
    stock = gguf_reader(path)  # equal to gguf's stock reader (the test above), seconds faster here
    ours = GgufFile(path)
    assert ours.metadata == _stock_metadata(stock, _LONG_ARRAYS)
    full = read_header(memoryview(np.memmap(path, mode="r"))).metadata
    assert full == _stock_metadata(stock, frozenset())
    _assert_same_tensors(ours, stock)


def test_a_file_cut_anywhere_fails_by_name(tmp_path):
    """Cut inside the header (a key, the vocabulary, the tensor infos) or inside the tensor data."""
    data = _write_mixed(tmp_path / "whole.gguf").read_bytes()
    header = read_header(memoryview(data))
    vocabulary_at = data.index("Ġthe".encode())
    for cut in (0, 3, 7, 30, vocabulary_at, vocabulary_at + 300, header.data_offset - 9, header.data_offset + 1,
                len(data) - 1):
        path = tmp_path / f"cut{cut}.gguf"
        path.write_bytes(data[:cut])
        with pytest.raises(ModelLoadError, match=f"cut{cut}.gguf: not a readable GGUF file"):
            GgufFile(path)


def test_bad_magic_version_count_and_alignment_are_refused(tmp_path):
    data = bytearray(_write_mixed(tmp_path / "whole.gguf").read_bytes())
    with pytest.raises(ValueError, match="magic"):
        read_header(memoryview(b"GGML" + data[4:]))
    with pytest.raises(ValueError, match="version 1 is not supported"):
        read_header(memoryview(data[:4] + (1).to_bytes(4, "little") + data[8:]))
    count_at = data.index(b"tokenizer.ggml.tokens") + len("tokenizer.ggml.tokens") + 8  # after two type fields
    assert int.from_bytes(data[count_at:count_at + 8], "little") == 6
    with pytest.raises(ValueError, match="past the end of the file"):  # a damaged vocabulary length
        read_header(memoryview(data[:count_at] + (2**40).to_bytes(8, "little") + data[count_at + 8:]),
                    frozenset({"tokenizer.ggml.tokens"}))
    writer = GGUFWriter(str(tmp_path / "align.gguf"), "llama")
    writer.add_uint32("general.alignment", 48)
    finish(writer)
    with pytest.raises(ModelLoadError, match="power of two"):
        GgufFile(tmp_path / "align.gguf")
