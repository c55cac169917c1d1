"""A GPTQ checkpoint whose LM head the tool quantized too (GPTQModel 7.3.6, lm_head=True; fixture
gptq_4bit_g128_lm_head): the head is served from its own packed tensors by the grouped kernel, the token lookup
from the stored fp16 embedding, on the native decode step and on the torch path, within the tolerance of the other
tool fixtures (tests/test_quant_fixtures.py) of the tool's own CPU logits.

GPTQModel refuses lm_head=True on a tied model, so a tied model's quantized head (a config saying
tie_word_embeddings, a checkpoint holding lm_head.qweight...) is covered by the same checkpoint with the flag set:
the stored head is used and the embedding stays the lookup table alone."""

from __future__ import annotations

import pytest
import torch

from pagedserve.engine import LLM, SamplingParams
from pagedserve.quant.cpu_group_kernel import CpuGroupKernel
from pagedserve.quant.gptq import GPTQLinearMethod
from quant_fixtures import checkpoint_tensors, copy_fixture, fixture_dir, rewrite_config, tool_outputs

NAME = "gptq_4bit_g128_lm_head"
LOGITS_ATOL = 1e-2  # as tests/test_quant_fixtures.py: the tools' own fp16 noise at this logit scale
PROMPT = 6  # tokens of the tool's input ids given as the prompt; the rest are forced one decode step at a time


@pytest.fixture(scope="module")
def tied_copy(tmp_path_factory):
    path = copy_fixture(NAME, tmp_path_factory.mktemp("lm-head") / NAME)
    rewrite_config(path, lambda cfg: cfg.update(tie_word_embeddings=True))
    return path


def _forced_decode(llm: LLM, ids: torch.Tensor, native: bool) -> tuple[torch.Tensor, int]:
    """Each row of ids [B, T] as one request: the first PROMPT tokens prefilled, then one decode step per position
    whose greedy pick is forced to the next id (the step's own logits recorded first), so every decode row sees the
    tool's tokens. Returns the recorded logits [B, T - PROMPT, vocab] of those decode rows, and how many steps the
    native decode step ran."""
    runner = llm.engine.runner
    if not native:
        runner.native_step = None
    forward, recorded, native_steps = runner.forward, {}, [0]

    def forcing(batch):
        native_steps[0] += runner.native_step is not None and runner.native_step.accepts(batch)
        logits, seqs = forward(batch)
        forced = logits.clone()
        for row, seq in enumerate(seqs):
            r, position = int(seq.request_id), seq.num_tokens - 1
            if position >= PROMPT:
                recorded[r, position] = logits[row].clone()
            if position + 1 < ids.shape[1]:
                forced[row, ids[r, position + 1]] = 1e9
        return forced, seqs

    runner.forward = forcing
    params = SamplingParams(temperature=0, max_tokens=ids.shape[1] - PROMPT + 1, ignore_eos=True)
    for r in range(ids.shape[0]):
        llm.engine.add_request(str(r), ids[r, :PROMPT].tolist(), params)
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    runner.forward = forward
    rows = [[recorded[r, p] for p in range(PROMPT, ids.shape[1])] for r in range(ids.shape[0])]
    return torch.stack([torch.stack(row) for row in rows]), native_steps[0]


def _engine(path) -> LLM:
    return LLM(str(path), dtype="float32", kv_cache_memory=4 << 20, enable_prefix_caching=False)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("native", [True, False], ids=["native_step", "torch_path"])
def test_quantized_head_matches_the_tools_logits(tied, native, tied_copy):
    path = tied_copy if tied else fixture_dir(NAME)
    outputs = tool_outputs(NAME)
    ids, tool_logits = outputs["input_ids"], outputs["logits"]
    llm = _engine(path)
    ours, native_steps = _forced_decode(llm, ids, native)
    assert (native_steps > 0) == native
    diff = (ours - tool_logits[:, PROMPT:]).abs().max().item()
    assert diff <= LOGITS_ATOL, diff


def test_head_is_packed_and_the_embedding_is_the_stored_table(tied_copy):
    for path in (fixture_dir(NAME), tied_copy):
        model = _engine(path).engine.runner.model
        head, embedding = model.lm_head, model.model.embed_tokens
        assert isinstance(head.method, GPTQLinearMethod) and isinstance(head.qkernel, CpuGroupKernel)
        assert head.method.spec.bits == 8 and head.method.spec.group_size == 32  # the tool's lm_head default
        assert not hasattr(head, "weight") and not hasattr(head, "qweight")  # packed once, not kept twice
        stored = checkpoint_tensors(path)["model.embed_tokens.weight"].float()
        looked_up = embedding(torch.arange(stored.shape[0])).float()
        assert torch.equal(looked_up, stored)
        assert head.qkernel.weight_nbytes() < stored.numel() * 2 * 0.6  # 8-bit g32 against fp16
