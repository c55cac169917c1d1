"""The CUDA-graph decode step's CPU-testable half: which sizes are captured (vLLM's rule), which steps replay, how
their inputs are padded, and that a padded step run over the static buffers (what a capture records) gives the eager
step's hidden states for the real rows while padded rows write nothing to the KV cache (Triton's interpreter). The
capture and replay themselves need CUDA: tests/gpu/e2e_check.py's cuda_graphs cases compare them with
enforce_eager on the device."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from conftest import make_tiny_model

from pagedserve.engine.config import MAX_CUDA_GRAPH_SIZE, EngineConfig
from pagedserve.engine.errors import ConfigError
from pagedserve.engine.runner.cuda_graphs import DecodeGraphs, GraphModel
from pagedserve.engine.runner.device_rows import DeviceRows
from pagedserve.engine.runner.launched_step import DevicePicks, PendingFill
from pagedserve.engine.runner.graph_inputs import PAD_SLOT, PaddedDecode, capture_sizes, pad_decode, padded_size
from pagedserve.engine.runner.step_input import StepInput
from pagedserve.kernels.backends import ATTENTION_IMPLS
from pagedserve.service.cli import build_parser, engine_config


def test_capture_sizes_follow_vllms_rule():
    assert capture_sizes((), 256, MAX_CUDA_GRAPH_SIZE) == (1, 2, 4, *range(8, 257, 8))
    assert capture_sizes((), 13, MAX_CUDA_GRAPH_SIZE) == (1, 2, 4, 8, 16)  # max_num_seqs rounded up to 8s
    assert capture_sizes((), 1, MAX_CUDA_GRAPH_SIZE) == (1,)
    assert capture_sizes((), 4096, MAX_CUDA_GRAPH_SIZE)[-1] == MAX_CUDA_GRAPH_SIZE
    assert capture_sizes((3,), 256, MAX_CUDA_GRAPH_SIZE) == (1, 2, 4)  # one value: the pattern up to it
    assert capture_sizes((24,), 256, MAX_CUDA_GRAPH_SIZE) == (1, 2, 4, 8, 16, 24)
    assert capture_sizes((100, 1, 3), 256, MAX_CUDA_GRAPH_SIZE) == (1, 3, 100)  # several: exactly those
    assert capture_sizes((1, 8, 32, 64), 20, MAX_CUDA_GRAPH_SIZE) == (1, 8, 32)  # none past the one holding 20
    assert [padded_size(n, (1, 2, 4, 8)) for n in (1, 3, 5, 8, 9)] == [1, 4, 8, 8, None]


def _step(query_lens: list[int], tables: list[list[int]], adapter_spans: list | None = None) -> StepInput:
    rows = sum(query_lens)
    return StepInput(token_ids=list(range(10, 10 + rows)), positions=list(range(20, 20 + rows)),
                     slots=list(range(100, 100 + rows)), query_lens=query_lens, seq_lens=[21 + i for i in
                                                                                          range(len(query_lens))],
                     block_tables=tables, logits_rows=list(range(rows)), sampling_seqs=(),
                     adapter_spans=adapter_spans or [], rope_lengths=[21] * len(query_lens))


def test_a_decode_step_pads_to_the_next_size_with_rows_that_touch_nothing():
    step = _step([1, 1, 1], [[5, 6], [7, 0], [8, 9]])
    padded = pad_decode(step, (1, 2, 4, 8), max_blocks=4)
    assert (padded.size, padded.num_rows, padded.width) == (4, 3, 2)
    assert padded.token_ids == [10, 11, 12, 0] and padded.positions == [20, 21, 22, 0]
    assert padded.slots == [100, 101, 102, PAD_SLOT] and padded.seq_lens == [21, 22, 23, 1]
    assert padded.block_tables == [[5, 6], [7, 0], [8, 9], [0, 0]]
    assert pad_decode(_step([1, 1], [[1], [2]]), (2, 4), 4).slots == [100, 101]  # an exact size: no padding


@pytest.mark.parametrize(("step", "sizes", "max_blocks"), [
    (_step([2, 1], [[1], [2]]), (1, 2, 4), 4),  # a prefill chunk (or a sequence with drafts)
    (_step([1, 1], [[1], [2]], adapter_spans=[(object(), 1, 2)]), (1, 2, 4), 4),  # a LoRA adapter's row
    (_step([1] * 5, [[1]] * 5), (1, 2, 4), 4),  # more rows than the largest size
    (_step([1], [[1, 2, 3, 4, 5]]), (1, 2, 4), 4),  # a table wider than the static one
    (_step([1], [[1]]), (), 4),  # nothing captured
], ids=["prefill", "lora", "too-many-rows", "too-wide", "no-sizes"])
def test_other_steps_run_eagerly(step, sizes, max_blocks):
    assert pad_decode(step, sizes, max_blocks) is None


def test_config_checks_the_graph_fields_and_the_cli_reads_vllms_flags():
    assert EngineConfig(cuda_graph_sizes=[8, 1]).cuda_graph_sizes == (8, 1)  # a list becomes a tuple
    for bad in ((0,), (1, 1), (MAX_CUDA_GRAPH_SIZE + 1,), (True,), "8", (2.0,)):
        with pytest.raises(ConfigError) as err:
            EngineConfig(cuda_graph_sizes=bad)
        assert err.value.field == "cuda_graph_sizes"
    with pytest.raises(ConfigError) as err:
        EngineConfig(enforce_eager="yes")
    assert err.value.field == "enforce_eager"
    config = engine_config(build_parser().parse_args(["serve", "--enforce-eager", "--cuda-graph-sizes", "1", "2",
                                                      "8"]))
    assert config.enforce_eager is True and config.cuda_graph_sizes == (1, 2, 8)


@pytest.fixture(scope="module")
def triton_llm(tmp_path_factory):
    from pagedserve.engine import LLM

    if "triton" not in ATTENTION_IMPLS:
        pytest.skip("triton is not installed")
    model = make_tiny_model(tmp_path_factory.mktemp("graph-llama"), max_position_embeddings=256,
                            initializer_range=0.1)
    return LLM(str(model), device="cpu", attention_backend="triton", dtype="float32", kv_cache_memory=1 << 22,
               max_num_seqs=4, cuda_graph_sizes=(1, 2, 4))


def test_padded_step_over_the_static_buffers_gives_the_eager_rows(triton_llm):
    from pagedserve.engine import SamplingParams

    engine, runner = triton_llm.engine, triton_llm.engine.runner
    assert runner.cuda_graphs is None  # CPU: the graph fields have no effect
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for i, length in enumerate((5, 19, 40)):  # tables of 1, 2 and 3 blocks of 16
        engine.add_request(str(i), list(range(3, 3 + length)), params)
    engine.step()  # the prompts
    step = runner.prepare(engine.scheduler.schedule())  # a decode step of 3 sequences
    layers = runner.kv_cache.layers
    graphs = DecodeGraphs(GraphModel(runner.model, runner.kv_cache, runner.attn_impl, runner.layer_ops,
                                     runner.windows), (1, 2, 4), runner.max_model_len, torch.device("cpu"))
    padded = pad_decode(step, graphs.sizes, graphs.max_blocks)
    assert (padded.size, padded.num_rows, padded.width) == (4, 3, 3)
    with torch.inference_mode():
        eager = runner._eager_forward(step)
        before = [(layer.k.clone(), layer.v.clone()) for layer in layers]
        padded_out = graphs.forward_eagerly(padded)
    assert padded_out.shape[0] == 4 and torch.isfinite(padded_out).all()
    torch.testing.assert_close(padded_out[:3], eager, rtol=1e-5, atol=1e-5)
    flat = lambda t: t.permute(2, 0, 1, 3).reshape(t.shape[2], -1, t.shape[3])  # noqa: E731  [Hkv, slots, D]
    real = torch.tensor(step.slots)
    for (k0, v0), layer in zip(before, layers):
        for old, new in ((k0, layer.k), (v0, layer.v)):
            untouched = torch.ones(flat(old).shape[1], dtype=torch.bool)
            untouched[real] = False
            assert torch.equal(flat(old)[:, untouched], flat(new)[:, untouched])  # padded rows wrote nothing
            torch.testing.assert_close(flat(old)[:, real], flat(new)[:, real], rtol=1e-5, atol=1e-5)


def test_pending_input_tokens_are_copied_into_the_static_buffer(triton_llm):
    """Async scheduling: a step launched before the step in flight's tokens are read takes them on the device
    (`PendingFill`), in the static buffer a graph replays; the rows equal the step with those tokens known."""
    from pagedserve.engine import SamplingParams

    engine, runner = triton_llm.engine, triton_llm.engine.runner
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for request_id in list(engine.requests):  # an earlier test's decode step, left scheduled
        engine.abort_request(request_id)
    for i, length in enumerate((7, 23, 12)):
        engine.add_request(f"fill{i}", list(range(5, 5 + length)), params)
    engine.step()
    known = runner.prepare(engine.scheduler.schedule())
    seqs = list(known.sampling_seqs)
    pending = replace(known, token_ids=[0, known.token_ids[1], 0], pending=((0, seqs[0]), (2, seqs[2])))
    picks = torch.tensor([99, 98, known.token_ids[2], known.token_ids[0]])  # the step in flight's rows, any order
    inflight = DevicePicks((seqs[1], object(), seqs[2], seqs[0]), picks,
                           DeviceRows(picks, torch.ones(4, dtype=torch.bool)), None)
    graphs = DecodeGraphs(GraphModel(runner.model, runner.kv_cache, runner.attn_impl, runner.layer_ops,
                                     runner.windows), (1, 2, 4), runner.max_model_len, torch.device("cpu"))
    with torch.inference_mode():
        expected = graphs.forward_eagerly(pad_decode(known, graphs.sizes, graphs.max_blocks))[:3]
        filled = graphs.forward_eagerly(pad_decode(pending, graphs.sizes, graphs.max_blocks),
                                        PendingFill.of(pending, inflight))[:3]
    assert graphs.input_ids[:3].tolist() == known.token_ids
    torch.testing.assert_close(filled, expected, rtol=0, atol=0)
    assert pending.resolved({seqs[0]: known.token_ids[0], seqs[2]: known.token_ids[2]}).token_ids == known.token_ids
    for i in range(3):
        engine.abort_request(f"fill{i}")


def test_static_tables_keep_no_stale_block_ids(triton_llm):
    runner = triton_llm.engine.runner
    graphs = DecodeGraphs(GraphModel(runner.model, runner.kv_cache, runner.attn_impl, runner.layer_ops,
                                     runner.windows), (1, 2, 4), runner.max_model_len, torch.device("cpu"))

    def padded(tables: list[list[int]]) -> PaddedDecode:
        rows = len(tables)
        return PaddedDecode(4, rows, [0] * 4, [0] * 4, [PAD_SLOT] * 4, [1] * 4, tables + [[0] * len(tables[0])] *
                            (4 - rows))

    graphs._load(padded([[3, 4, 5], [6, 7, 8]]))
    assert graphs.block_tables[:2, :3].tolist() == [[3, 4, 5], [6, 7, 8]]
    graphs._load(padded([[9]]))
    assert graphs.block_tables[0, 0] == 9 and int(graphs.block_tables.count_nonzero()) == 1


def test_a_capture_that_fails_leaves_every_step_eager(triton_llm):
    """Here the capture fails for want of CUDA; on a GPU an op that cannot be captured would: the engine keeps
    serving eagerly and says why."""
    runner = triton_llm.engine.runner
    graphs = DecodeGraphs(GraphModel(runner.model, runner.kv_cache, runner.attn_impl, runner.layer_ops,
                                     runner.windows), (1, 2, 4), runner.max_model_len, torch.device("cpu"))
    assert graphs.capture() is None and graphs.error and not graphs.captured
    assert graphs.run(_step([1], [[1]])) is None and not graphs.replays
