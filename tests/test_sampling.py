"""Sampling through the engine: n-way forks, seeds, stops, penalties and logit bias against transformers' greedy
output, logprobs and non-finite rows. Each option's sampled distribution, and a test that fails when any one option
is ignored, are in tests/test_sampler_distribution.py."""

from __future__ import annotations

import pytest
import torch

from conftest import hf_greedy
from pagedserve.engine import SamplingParams
from pagedserve.engine.errors import InvalidRequestError

PROMPT = "Once upon a time, in a small village,"


def texts(outputs):
    return [c.text for c in outputs.outputs]


def test_n_samples_differ_and_share_prompt_blocks(llm_fp32):
    engine = llm_fp32.engine
    prompt = PROMPT + " there lived an old clockmaker who repaired every clock in town"  # > one full block
    params = SamplingParams(n=4, temperature=1.0, max_tokens=12, seed=7)
    engine.add_request("fork", prompt, params)
    shared_full_block = copied_last_block = False
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out
        state = engine.requests.get("fork")
        if state and len(state.seqs) == 4 and not any(s.is_finished for s in state.seqs):
            tables = [s.block_table for s in state.seqs]
            first = tables[0][0]
            shared_full_block |= all(t[0] == first for t in tables) and engine.block_manager.blocks[first].ref_count == 4
            copied_last_block |= len({t[-1] for t in tables}) == 4  # copy-on-write gave each its own tail
    assert shared_full_block and copied_last_block
    assert [c.index for c in final.outputs] == [0, 1, 2, 3]
    assert len({c.token_ids for c in final.outputs}) > 1
    assert all(len(c.token_ids) == 12 for c in final.outputs)
    assert engine.stats().num_free_kv_blocks == engine.stats().num_kv_blocks


def test_seed_reproducible_regardless_of_batch_mates(llm_fp32):
    params = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=16, seed=1234)
    alone = llm_fp32.generate([PROMPT], params)[0].outputs[0].token_ids
    crowd = llm_fp32.generate(
        ["Hello there", PROMPT, "def f(x):"],
        [SamplingParams(temperature=1.0, max_tokens=20), params, SamplingParams(temperature=0.5, max_tokens=5, seed=1)],
    )
    assert crowd[1].outputs[0].token_ids == alone
    other = llm_fp32.generate([PROMPT], SamplingParams(temperature=0.9, top_p=0.95, max_tokens=16, seed=4321))
    assert other[0].outputs[0].token_ids != alone


def test_stop_string_across_tokens_is_not_emitted(llm_fp32):
    greedy = llm_fp32.generate([PROMPT], SamplingParams(temperature=0, max_tokens=30))[0].outputs[0]
    # A stop string that starts inside one token and ends inside a later one.
    text = greedy.text
    stop = text[5:14]
    assert len(stop.strip()) > 3
    out = llm_fp32.generate([PROMPT], SamplingParams(temperature=0, max_tokens=30, stop=[stop]))[0].outputs[0]
    assert out.text == text[:5]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    kept = llm_fp32.generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=30, stop=[stop], include_stop_str_in_output=True)
    )[0].outputs[0]
    assert kept.text == text[:14]


def test_stop_token_ids_and_min_tokens(llm_fp32):
    greedy = llm_fp32.generate([PROMPT], SamplingParams(temperature=0, max_tokens=10))[0].outputs[0]
    stop_at = greedy.token_ids[3]
    out = llm_fp32.generate([PROMPT], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_at]))[0]
    assert out.outputs[0].token_ids == greedy.token_ids[: greedy.token_ids.index(stop_at) + 1]
    assert out.outputs[0].stop_reason == stop_at
    eos_prompt = "<|im_start|>user\nSay OK.<|im_end|>\n<|im_start|>assistant\n"
    natural = llm_fp32.generate([eos_prompt], SamplingParams(temperature=0, max_tokens=40))[0].outputs[0]
    assert natural.finish_reason == "stop" and natural.token_ids[-1] == 2
    forced = llm_fp32.generate([eos_prompt], SamplingParams(temperature=0, max_tokens=40, min_tokens=len(natural.token_ids) + 3))
    assert 2 not in forced[0].outputs[0].token_ids[: len(natural.token_ids) + 3]


def test_repetition_penalty_matches_transformers(llm_fp32, hf_reference):
    model, tok = hf_reference
    ids = tok.encode("The list of words: apple, apple, apple, apple,")
    expected = hf_greedy(model, ids, 16, repetition_penalty=1.5)
    params = SamplingParams(temperature=0, max_tokens=16, min_tokens=16, repetition_penalty=1.5)
    ours = llm_fp32.generate([ids], params)[0].outputs[0].token_ids
    plain = llm_fp32.generate([ids], SamplingParams(temperature=0, max_tokens=16, min_tokens=16))[0].outputs[0].token_ids
    assert list(ours) == expected
    assert ours != plain


def test_frequency_and_presence_penalties_reduce_repeats(llm_fp32):
    prompt = "apple apple apple apple apple apple apple"
    plain = llm_fp32.generate([prompt], SamplingParams(temperature=0, max_tokens=24))[0].outputs[0].token_ids
    penal = llm_fp32.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=24, frequency_penalty=2.0, presence_penalty=2.0)
    )[0].outputs[0].token_ids
    max_repeat = lambda ids: max(ids.count(t) for t in set(ids))  # noqa: E731
    assert max_repeat(list(penal)) < max_repeat(list(plain))


def test_logit_bias_and_top_k_one(llm_fp32):
    forced = llm_fp32.generate([PROMPT], SamplingParams(temperature=0, max_tokens=3, logit_bias={1234: 100.0}))
    assert forced[0].outputs[0].token_ids == (1234, 1234, 1234)
    greedy = llm_fp32.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].token_ids
    top1 = llm_fp32.generate([PROMPT], SamplingParams(temperature=1.5, top_k=1, max_tokens=8))[0].outputs[0].token_ids
    assert top1 == greedy


def test_logprobs_match_transformers_log_softmax(llm_fp32, hf_reference):
    model, tok = hf_reference
    ids = tok.encode(PROMPT)
    out = llm_fp32.generate([ids], SamplingParams(temperature=0, max_tokens=6, logprobs=5))[0].outputs[0]
    full = torch.tensor([ids + list(out.token_ids)])
    with torch.inference_mode():
        ref = torch.log_softmax(model(full).logits[0].float(), dim=-1)
    assert len(out.logprobs) == 6
    for step, lp in enumerate(out.logprobs):
        row = ref[len(ids) - 1 + step]
        assert lp.token_id == out.token_ids[step]
        assert abs(lp.logprob - row[lp.token_id].item()) < 1e-4
        best = torch.topk(row, 5)
        assert [t for t, _ in lp.top] == best.indices.tolist()
        assert max(abs(v - r) for (_, v), r in zip(lp.top, best.values.tolist())) < 1e-4


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"stop": 5}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"stop": ["ok", 3]}, "stop"),
        ({"n": 0}, "n"),
        ({"n": 2, "temperature": 0}, "n"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"frequency_penalty": 3}, "frequency_penalty"),
        ({"logprobs": 100}, "logprobs"),
        ({"seed": -1}, "seed"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)
    assert info.value.field == field and field in str(info.value)


def test_top_k_minus_one_is_off_as_in_vllm():
    """vLLM users write top_k=-1 for "off" (its default until 0 became the preferred spelling); it is 0 here."""
    assert SamplingParams(top_k=-1) == SamplingParams(top_k=0) and SamplingParams(top_k=-1).top_k == 0
    with pytest.raises(InvalidRequestError, match=">= -1, got -2"):
        SamplingParams(top_k=-2)


def test_a_row_with_non_finite_logits_fails_only_its_own_request(llm_fp32, monkeypatch):
    """NaN/inf logits for one request (a model overflow) end that request with "error"; its batch mates are
    sampled from their own rows and finish exactly as they would alone, and every block comes back."""
    engine = llm_fp32.engine
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=12, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm_fp32.generate([PROMPT, "The sea is"], [greedy, sampled])]
    forward, steps = engine.runner.forward, []

    def poisoned(batch):
        logits, seqs = forward(batch)
        steps.append(1)
        if len(steps) == 3:  # mid-generation, with both batch mates decoding beside the victim
            row = next(i for i, s in enumerate(seqs) if s.params.n == 2)
            logits = logits.clone()
            logits[row, 7] = float("nan")
        return logits, seqs

    monkeypatch.setattr(engine.runner, "forward", poisoned)
    victim = SamplingParams(n=2, temperature=1.0, seed=9, max_tokens=12)
    outs = llm_fp32.generate([PROMPT, "The sea is", "Hello"], [greedy, sampled, victim])
    assert [o.outputs[0].token_ids for o in outs[:2]] == alone
    assert outs[0].error is None and outs[1].error is None
    assert outs[2].error is not None and "not finite" in outs[2].error
    assert {c.finish_reason for c in outs[2].outputs} == {"error"}
    assert engine.block_manager.num_used_blocks == 0 and not engine.has_unfinished_requests()


def _batch_with_a_victim(llm, victim: SamplingParams) -> tuple[list, list]:
    """Two bystanders (greedy, seeded sampling) alone, then beside `victim`: (their solo tokens, the three outputs)."""
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=12, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate([PROMPT, "The sea is"], [greedy, sampled])]
    return alone, llm.generate([PROMPT, "The sea is", "Hello"], [greedy, sampled, victim])


def _only_the_victim_failed(llm, alone, outs, stage: str) -> None:
    assert [o.outputs[0].token_ids for o in outs[:2]] == alone
    assert outs[0].error is None and outs[1].error is None
    assert outs[2].error is not None and stage in outs[2].error and "internal error" in outs[2].error
    assert {c.finish_reason for c in outs[2].outputs} == {"error"}
    assert llm.engine.block_manager.num_used_blocks == 0 and not llm.engine.has_unfinished_requests()


def test_an_exception_in_one_rows_logits_processing_fails_only_its_request(llm_fp32, monkeypatch):
    """A bug in one request's own rules (here: raised from its penalty pass on its third token) ends that request
    with "error"; without the per-row guard it failed the step, i.e. every request in the batch."""
    from pagedserve.engine.runner.sampler import Sampler

    process_row, calls = Sampler._process_row, []

    def failing(self, row, seq, in_flight):
        if seq.params.repetition_penalty == 1.3:
            calls.append(1)
            if len(calls) == 3:
                raise IndexError("injected")
        return process_row(self, row, seq, in_flight)

    monkeypatch.setattr(Sampler, "_process_row", failing)
    victim = SamplingParams(n=2, temperature=1.0, seed=9, repetition_penalty=1.3, max_tokens=12)
    alone, outs = _batch_with_a_victim(llm_fp32, victim)
    _only_the_victim_failed(llm_fp32, alone, outs, "logits processing")


def test_a_draw_from_a_distribution_with_no_mass_fails_only_its_request(llm_fp32, monkeypatch):
    """The class of bug top_p below fp32's range was (a filter that drops every token): torch.multinomial raises on
    the victim's row, and only the victim ends."""
    from pagedserve.engine.runner.sampler import Sampler

    filtered = Sampler.filtered_probs

    def emptied(logits, row_max, seqs, rows):
        probs, order = filtered(logits, row_max, seqs, rows)
        victims = [i for i, row in enumerate(rows) if seqs[row].params.top_k == 7]
        return probs.index_fill(0, torch.tensor(victims, dtype=torch.long), 0.0), order

    monkeypatch.setattr(Sampler, "filtered_probs", staticmethod(emptied))
    alone, outs = _batch_with_a_victim(llm_fp32, SamplingParams(temperature=1.0, top_k=7, seed=3, max_tokens=12))
    _only_the_victim_failed(llm_fp32, alone, outs, "its draw")


def test_an_exception_applying_one_requests_token_fails_only_that_request(llm_fp32, monkeypatch):
    """Past the sampler: the scheduler applies each sequence's token through the stop rules (and grammars, forks);
    one that raises ends its own request, whose blocks (its forked sibling's too) come back."""
    stop = llm_fp32.engine.scheduler.stop
    append, seen = stop.append, []

    def failing(seq, token, logprob):
        if seq.params.max_tokens == 11:
            seen.append(1)
            if len(seen) == 5:
                raise KeyError("injected")
        return append(seq, token, logprob)

    monkeypatch.setattr(stop, "append", failing)
    alone, outs = _batch_with_a_victim(llm_fp32, SamplingParams(n=2, temperature=1.0, seed=4, max_tokens=11))
    _only_the_victim_failed(llm_fp32, alone, outs, "KeyError")


@pytest.mark.parametrize("temperature", [1e-45, 1e-40, 1e-20])
def test_vanishing_temperatures_sample_the_greedy_token(llm_fp32, temperature):
    greedy = llm_fp32.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].token_ids
    tiny = llm_fp32.generate([PROMPT], SamplingParams(temperature=temperature, seed=2, max_tokens=8))[0]
    assert tiny.outputs[0].token_ids == greedy and tiny.error is None


@pytest.mark.parametrize("kwargs, field", [
    ({"repetition_penalty": 1e-45}, "repetition_penalty"),
    ({"repetition_penalty": 101.0}, "repetition_penalty"),
    ({"logit_bias": {5: 3e38}}, "logit_bias"),
    ({"logit_bias": {5: -100.5}}, "logit_bias"),
])
def test_penalties_and_biases_are_bounded_in_the_offline_api(kwargs, field):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(temperature=0.5, **kwargs)
    assert info.value.field == field and "must be in" in info.value.message


def test_async_engine_fails_only_the_poisoned_stream(llm_fp32, monkeypatch):
    """Through AsyncEngine (what every server front end uses): the victim's stream raises RequestFailedError,
    the bystander's stream yields its solo tokens."""
    import asyncio

    from pagedserve.engine.async_engine import AsyncEngine
    from pagedserve.engine.errors import RequestFailedError

    engine = llm_fp32.engine
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    alone = llm_fp32.generate([PROMPT], greedy)[0].outputs[0].token_ids
    forward = engine.runner.forward

    def poisoned(batch):
        logits, seqs = forward(batch)
        victims = [i for i, s in enumerate(seqs) if s.request_id.startswith("victim")]
        if victims:
            logits = logits.clone()
            logits[victims, :] = float("inf")
        return logits, seqs

    monkeypatch.setattr(engine.runner, "forward", poisoned)

    async def tokens(front: AsyncEngine, request_id: str) -> tuple[int, ...]:
        last = None
        async for out in front.generate(request_id, PROMPT, greedy):
            last = out
        return last.outputs[0].token_ids

    async def scenario():
        front = AsyncEngine(engine.config, engine=engine)
        await front.start()
        try:
            return await asyncio.gather(tokens(front, "bystander"), tokens(front, "victim"), return_exceptions=True)
        finally:
            await front.shutdown()

    bystander, victim = asyncio.run(scenario())
    assert bystander == alone
    assert isinstance(victim, RequestFailedError) and "not finite" in str(victim)
    assert engine.block_manager.num_used_blocks == 0 and not engine.has_unfinished_requests()


@pytest.mark.parametrize("vocab", [7, 1024, 1500, 49152, 50257])
def test_first_argmax_equals_torch_argmax_with_ties_and_masked_rows(vocab):
    from pagedserve.engine.runner.row_argmax import first_argmax

    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(9, vocab, generator=g)
    logits[1] = logits[1].round()  # many ties: the first maximum must win
    logits[2, :-1] = float("-inf")  # only the last id allowed (a constrained row)
    logits[3] = 0.0  # all tied
    logits[4, vocab // 2:] = logits[4].max() + 1  # tie across the chunk boundary
    logits[5, ::3] = float("-inf")
    assert torch.equal(first_argmax(logits), logits.argmax(dim=-1))
    assert torch.equal(first_argmax(logits[::2]), logits[::2].argmax(dim=-1))  # rows that are not contiguous
