"""Structured outputs through the scheduler, on tiny random models: preemption and chunked prefill replay without
advancing a matcher twice, a dead end ends only its own sequence, a compile past the time limit is refused by name,
and constrained admission runs off the event loop."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import jsonschema
import pytest

from conftest import make_tiny_model
from pagedserve.engine import LLM, SamplingParams
from pagedserve.engine.constraint import json_schema
from pagedserve.engine.core.sequence import FinishReason
from pagedserve.engine.errors import InvalidRequestError
from structured_fixtures import SCHEMAS, assert_no_blocks_held, choice, regex


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-so"), seed=3)


@pytest.fixture(scope="module")
def tiny(tiny_model) -> LLM:
    return LLM(str(tiny_model), dtype="float32")


def _tiny_requests() -> tuple[list[str], list[SamplingParams]]:
    names = ("person", "nested_order", "array_of_objects", "defs_ref", "sentiment", "address")
    prompts = [f"Record {i}: " + "context words " * (2 + 2 * i) for i in range(len(names))]  # 9 to 29 tokens
    return prompts, [SamplingParams(temperature=0, max_tokens=90, constraint=json_schema(SCHEMAS[n])) for n in names]


def test_preemption_and_chunked_prefill_replay_without_re_advancing(tiny, tiny_model):
    prompts, params = _tiny_requests()
    reference = [o.outputs[0].token_ids for o in tiny.generate(prompts, params)]
    block_bytes = 2 * 2 * 2 * 16 * 8 * 4  # layers x (K, V) x kv heads x head dim x block x fp32
    # 16 blocks of 8 tokens for six requests of up to 9 blocks each: requests admitted with one block to spare each
    # outgrow it as they decode and one is preempted; 16-token steps: every prompt longer than 16 tokens, and
    # those sharing a step, prefill in chunks.
    small = LLM(str(tiny_model), dtype="float32", kv_cache_memory=16 * block_bytes, max_num_batched_tokens=16,
                block_size=8)
    outs = small.generate(prompts, params)
    assert small.engine.stats().num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == reference
    for out, p in zip(outs, params):
        jsonschema.validate(json.loads(out.outputs[0].text), json.loads(p.constraint.spec))
    assert_no_blocks_held(small.engine)


def test_dead_end_ends_only_its_own_sequence(tmp_path):
    # A model whose logits cover only the first 100 token ids: "zzz" needs a token it cannot produce.
    model = make_tiny_model(tmp_path, vocab_size=100, seed=4)
    llm = LLM(str(model), dtype="float32")
    mate = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    solo = llm.generate([[5, 6, 7]], mate)[0].outputs[0].token_ids
    dead, bystander, forked = llm.generate([[5, 6, 7], [5, 6, 7], [8, 9]], [
        SamplingParams(temperature=0, max_tokens=12, constraint=choice("zzz")), mate,
        SamplingParams(temperature=1.0, n=3, seed=2, max_tokens=12, constraint=choice("zzz")),
    ])
    assert dead.outputs[0].finish_reason == FinishReason.CONSTRAINT_DEAD_END.value and not dead.outputs[0].token_ids
    assert dead.error is None
    assert [c.finish_reason for c in forked.outputs] == ["constraint_dead_end"] * 3
    assert bystander.outputs[0].token_ids == solo
    assert_no_blocks_held(llm.engine)


def test_compile_time_limit_refuses_by_name(tiny_model):
    # 7000 alternatives (56 KB, under the size limit) take llguidance about 100 ms to compile: 100x the limit.
    pattern = "(" + "|".join(f"w{i:05d}x" for i in range(7000)) + ")"
    llm = LLM(str(tiny_model), dtype="float32", constraint_compile_timeout_s=0.001)
    with pytest.raises(InvalidRequestError) as info:
        llm.generate(["hi"], SamplingParams(constraint=regex(pattern)))
    assert info.value.field == "constraint.regex" and "did not compile within 0.001 s" in info.value.message
    assert not llm.engine.has_unfinished_requests()


def test_constrained_admission_runs_off_the_event_loop():
    from pagedserve.service.core.admit import admit_off_loop

    async def run() -> tuple[int, int]:
        loop_thread = threading.get_ident()
        return loop_thread, await admit_off_loop(threading.get_ident, text_chars=10, constrained=True)

    loop_thread, admit_thread = asyncio.run(run())
    assert admit_thread != loop_thread


def test_a_matcher_that_raises_fails_only_its_own_request(tiny, monkeypatch):
    """A grammar backend's bug while filling one row's mask (here: raised on the victim's matcher once it decodes)
    ends the victim with "error"; a constrained batch mate and a plain one keep their solo tokens."""
    from pagedserve.engine.structured_output.backend import GrammarState
    from pagedserve.engine.structured_output.llguidance_backend import LLGuidanceMatcher

    prompts = ["Record 1: context words", "Record 2: more context words", "Record 3: plain"]
    params = [SamplingParams(temperature=0, max_tokens=24, constraint=regex("[a-z ]{4,40}")),
              SamplingParams(temperature=0, max_tokens=24, constraint=json_schema(SCHEMAS["person"])),
              SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)]
    solo = [o.outputs[0].token_ids for o in tiny.generate(prompts[1:], params[1:])]
    fill, victims = LLGuidanceMatcher.fill_bitmask, set()

    def failing(self, bitmask, row):
        if id(self) in victims:
            raise RuntimeError("injected")
        fill(self, bitmask, row)

    monkeypatch.setattr(LLGuidanceMatcher, "fill_bitmask", failing)
    engine = tiny.engine
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"g{i}", prompt, p)
    final = {out.request_id: out for out in engine.step() if out.finished}
    victims.add(id(engine.requests["g0"].seqs[0].features[GrammarState].matcher))
    while engine.has_unfinished_requests():
        final.update((out.request_id, out) for out in engine.step() if out.finished)
    assert final["g0"].error is not None and "grammar's mask" in final["g0"].error
    assert final["g0"].outputs[0].finish_reason == "error"
    assert [final[r].outputs[0].token_ids for r in ("g1", "g2")] == solo
    assert final["g1"].error is None and final["g2"].error is None
    assert_no_blocks_held(engine)
