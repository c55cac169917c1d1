"""Structured outputs in the engine on the real model: every constrained sample parses (jsonschema, re.fullmatch,
the choices, a parser), unconstrained batch mates are untouched, and forks, stops, limits, logprobs, refusals and
the compile cache behave as docs/structured-outputs.md says; the bitmask's logit bias is checked bit by bit. One
shared SmolLM2 engine (`llm_fp32`) for the real-model cases."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import pytest

from pagedserve.engine import SamplingParams, StructuredOutputsParams
from pagedserve.engine.constraint import ConstraintKind, OutputConstraint, json_object, json_schema
from pagedserve.engine.errors import InvalidRequestError
from structured_fixtures import SCHEMAS, assert_no_blocks_held, choice, regex

PROMPT = "Reply with a JSON object describing a user:"
TEMPERATURES = (0.0, 0.7, 1.0)


def test_every_schema_validates_greedy_and_sampled(llm_fp32):
    """22 schemas of the shapes services send, at three temperatures, in one batch: 100% validate."""
    names = list(SCHEMAS)
    params = [SamplingParams(temperature=t, seed=7, max_tokens=400, constraint=json_schema(SCHEMAS[n]))
              for t in TEMPERATURES for n in names]
    outputs = llm_fp32.generate([PROMPT] * len(params), params)
    failures = []
    for i, out in enumerate(outputs):
        name, completion = names[i % len(names)], out.outputs[0]
        try:
            assert completion.finish_reason == "stop"
            jsonschema.validate(json.loads(completion.text), SCHEMAS[name])
        except (AssertionError, ValueError, jsonschema.ValidationError) as exc:
            failures.append((name, params[i].temperature, completion.finish_reason, completion.text[:200], str(exc)[:200]))
    assert not failures
    assert_no_blocks_held(llm_fp32.engine)


@pytest.mark.parametrize("pattern", [r"\d{3}-\d{4}", r"(cat|dog)s?", r"[A-Z][a-z]{2,8}", r"[a-z]{1,8}@[a-z]{1,8}\.(com|org)",
                                     r"(yes|no), because [a-z ]{5,30}\."])
def test_regex_outputs_fullmatch(llm_fp32, pattern):
    params = [SamplingParams(temperature=t, seed=3, max_tokens=80, constraint=regex(pattern)) for t in TEMPERATURES]
    for out in llm_fp32.generate(["Answer:"] * len(params), params):
        assert out.outputs[0].finish_reason == "stop"
        assert re.fullmatch(pattern, out.outputs[0].text), out.outputs[0].text


def test_choice_outputs_are_one_of_the_choices(llm_fp32):
    options = ("positive", "negative", "neutral", "mixed feelings")
    outs = llm_fp32.generate(["The review says: great food, slow service. Sentiment:"] * 2, [
        SamplingParams(temperature=0, max_tokens=20, constraint=choice(*options)),
        SamplingParams(temperature=1.0, seed=11, n=4, max_tokens=20, constraint=choice(*options)),
    ])
    texts = [c.text for out in outs for c in out.outputs]
    assert len(texts) == 5 and all(t in options for t in texts), texts
    assert all(c.finish_reason == "stop" for out in outs for c in out.outputs)


def test_vllms_offline_structured_outputs_params_constrain_alike(llm_fp32):
    """vLLM's SamplingParams(structured_outputs=StructuredOutputsParams(...)): the same outputs as the engine's own
    constraint; exactly one member set, and errors name structured_outputs.<member>."""
    schema = SCHEMAS[next(iter(SCHEMAS))]
    vllms = [StructuredOutputsParams(json=schema), StructuredOutputsParams(json=json.dumps(schema)),
             StructuredOutputsParams(choice=["yes", "no"]), StructuredOutputsParams(regex=r"\d{3}")]
    ours = [json_schema(schema), json_schema(schema), choice("yes", "no"), regex(r"\d{3}")]
    params = [SamplingParams(temperature=0, max_tokens=200, structured_outputs=v) for v in vllms]
    assert [p.constraint for p in params] == ours
    expected = llm_fp32.generate([PROMPT] * 4, [SamplingParams(temperature=0, max_tokens=200, constraint=c) for c in ours])
    got = llm_fp32.generate([PROMPT] * 4, params)
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in expected]
    for bad, field in ((StructuredOutputsParams(), "structured_outputs"),
                       (StructuredOutputsParams(regex="a", json_object=True), "structured_outputs"),
                       (StructuredOutputsParams(choice=["a", ""]), "structured_outputs.choice[1]"),
                       (StructuredOutputsParams(json="{not json"), "structured_outputs.json")):
        with pytest.raises(InvalidRequestError) as info:
            SamplingParams(structured_outputs=bad)
        assert info.value.field == field
    with pytest.raises(InvalidRequestError, match="either"):
        SamplingParams(structured_outputs=vllms[2], constraint=ours[0])


def test_json_object_parses_to_a_dict(llm_fp32):
    ask = [{"role": "user", "content": f"Give a JSON object with the {what}. Only JSON."} for what in
           ("name and age of a person", "title and year of a film")]
    prompts = [llm_fp32.tokenizer.apply_chat_template([m]) for m in ask]
    outs = llm_fp32.generate(prompts, SamplingParams(temperature=0, max_tokens=200, constraint=json_object()))
    for out in outs:
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
        assert isinstance(json.loads(out.outputs[0].text), dict)


# Bounded (at most four terms), so every sample completes well inside max_tokens.
ARITHMETIC_GBNF = 'root ::= term (" + " term)? (" + " term)? (" + " term)?\nterm ::= [1-9] [0-9]? [0-9]?'
ARITHMETIC_LARK = 'start: term (" * " term)? (" * " term)? (" * " term)?\nterm: /[1-9][0-9]{0,2}/'


@pytest.mark.parametrize("grammar, op", [(ARITHMETIC_GBNF, "+"), (ARITHMETIC_LARK, "*")])
def test_grammar_outputs_parse(llm_fp32, grammar, op):
    constraint = OutputConstraint(ConstraintKind.GRAMMAR, grammar)
    params = [SamplingParams(temperature=t, seed=5, max_tokens=60, constraint=constraint) for t in TEMPERATURES]
    for out in llm_fp32.generate(["Write a sum: "] * len(params), params):
        text = out.outputs[0].text
        assert out.outputs[0].finish_reason == "stop", text
        # The grammar's own language, parsed independently: one to four numbers 1-999 joined by the operator.
        terms = text.split(f" {op} ")
        assert 1 <= len(terms) <= 4 and all(re.fullmatch(r"[1-9][0-9]{0,2}", t) for t in terms), text


def test_unconstrained_batch_mates_get_their_solo_tokens(llm_fp32):
    prompts = ["The capital of France is", "def fibonacci(n):"]
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    solo = [llm_fp32.generate([p], plain)[0].outputs[0].token_ids for p in prompts]
    constrained = [SamplingParams(temperature=t, seed=1, max_tokens=60, constraint=json_schema(SCHEMAS["person"]))
                   for t in (0.0, 1.0)]
    mixed = llm_fp32.generate([PROMPT, prompts[0], PROMPT, prompts[1]], [constrained[0], plain, constrained[1], plain])
    assert [mixed[1].outputs[0].token_ids, mixed[3].outputs[0].token_ids] == solo
    for out in (mixed[0], mixed[2]):
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMAS["person"])


def test_n_samples_each_follow_their_own_matcher(llm_fp32):
    schema = SCHEMAS["array_of_objects"]
    out = llm_fp32.generate([PROMPT], SamplingParams(temperature=1.0, seed=21, n=4, max_tokens=200,
                                                      constraint=json_schema(schema)))[0]
    assert len(out.outputs) == 4
    for c in out.outputs:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.text), schema)
    assert len({c.text for c in out.outputs}) > 1  # forks sample on their own (one seed, distinct streams)
    assert_no_blocks_held(llm_fp32.engine)


def test_stop_string_and_max_tokens_end_a_constrained_output(llm_fp32):
    stop, length, exact = llm_fp32.generate(["Say it:", PROMPT, "Digit:"], [
        SamplingParams(temperature=0, max_tokens=20, stop=[" "], constraint=choice("hello world")),
        SamplingParams(temperature=0, max_tokens=3, constraint=json_schema(SCHEMAS["ten_fields"])),
        SamplingParams(temperature=0, max_tokens=1, constraint=regex("[0-9]")),  # complete on its last allowed token
    ])
    assert (exact.outputs[0].finish_reason, len(exact.outputs[0].token_ids)) == ("stop", 1)
    assert re.fullmatch("[0-9]", exact.outputs[0].text)
    assert (stop.outputs[0].text, stop.outputs[0].finish_reason, stop.outputs[0].stop_reason) == ("hello", "stop", " ")
    partial = length.outputs[0]
    assert partial.finish_reason == "length" and len(partial.token_ids) == 3 and partial.text.startswith('{"')


def test_min_tokens_holds_the_end_only_while_the_grammar_goes_on(llm_fp32):
    digits, single = llm_fp32.generate(["Number:", "Letter:"], [
        SamplingParams(temperature=0, max_tokens=30, min_tokens=6, constraint=regex(r"[0-9]+")),
        SamplingParams(temperature=0, max_tokens=30, min_tokens=6, constraint=regex(r"[a-z]")),
    ])
    assert len(digits.outputs[0].token_ids) >= 6 and re.fullmatch(r"[0-9]+", digits.outputs[0].text)
    # A complete grammar that allows nothing more ends the sequence (STOP) even before min_tokens.
    assert single.outputs[0].finish_reason == "stop" and re.fullmatch(r"[a-z]", single.outputs[0].text)


def test_logprobs_are_of_the_constrained_distribution(llm_fp32):
    options = ("yes", "no")
    free, constrained = llm_fp32.generate(["Is water wet? Answer:"] * 2, [
        SamplingParams(temperature=0, max_tokens=1, logprobs=5),
        SamplingParams(temperature=0, max_tokens=5, logprobs=5, constraint=choice(*options)),
    ])
    first = constrained.outputs[0].logprobs[0]
    tok = llm_fp32.tokenizer
    for token, logprob in first.top:
        if logprob > float("-inf"):
            assert any(o.startswith(tok.decode([token])) for o in options), tok.decode([token])
    raw = dict(free.outputs[0].logprobs[0].top)
    if first.token_id in raw:  # renormalised over the allowed tokens: at least as likely as unconstrained
        assert first.logprob >= raw[first.token_id]


@pytest.mark.parametrize("constraint, field, reason", [
    (json_schema({"type": "frobnicate"}), "constraint.json_schema", "frobnicate"),
    (json_schema({"type": "string", "format": "no-such-format"}), "constraint.json_schema", "no-such-format"),
    (regex("[a-z]{3"), "constraint.regex", "unclosed"),
    (regex("ab\\"), "constraint.regex", "lone backslash"),
    (OutputConstraint(ConstraintKind.GRAMMAR, 'root ::= "(" missing ")"'), "constraint.grammar", "missing"),
    (OutputConstraint(ConstraintKind.STRUCTURAL_TAG, '{"structures": [], "triggers": []}'), "constraint.structural_tag",
     "structures"),
])
def test_rejected_constraints_name_the_field_with_the_library_reason(llm_fp32, constraint, field, reason):
    with pytest.raises(InvalidRequestError) as info:
        llm_fp32.engine.add_request("bad", "hi", SamplingParams(constraint=constraint))
    assert info.value.field == field and reason in info.value.message
    assert not llm_fp32.engine.has_unfinished_requests()


def test_structural_tag_constrains_the_tagged_json(llm_fp32):
    spec = {"structures": [{"begin": "<function=get_weather>", "schema": SCHEMAS["tool_call"], "end": "</function>"}],
            "triggers": ["<function="]}
    prompt = "Call the weather tool now: <function=get_weather>"
    out = llm_fp32.generate([prompt], SamplingParams(temperature=0, max_tokens=80, constraint=OutputConstraint(
        ConstraintKind.STRUCTURAL_TAG, json.dumps(spec))))[0].outputs[0]
    match = re.search(r"<function=get_weather>(.*?)</function>", out.text, re.S)
    if match:  # the model may never trigger the tag; when it does, the arguments follow the schema
        jsonschema.validate(json.loads(match.group(1)), SCHEMAS["tool_call"])


def test_compiles_are_cached_and_counted(llm_fp32):
    schema = {"type": "object", "properties": {"cache_probe": {"type": "boolean"}}, "required": ["cache_probe"]}
    before = llm_fp32.engine.stats().constraints
    llm_fp32.generate(["x", "y"], SamplingParams(temperature=0, max_tokens=20, constraint=json_schema(schema)))
    after = llm_fp32.engine.stats().constraints
    assert after.cache_misses == before.cache_misses + 1 and after.cache_hits == before.cache_hits + 1
    assert after.num_requests == before.num_requests + 2
    assert sum(after.compile_bucket_counts) == sum(before.compile_bucket_counts) + 1


def test_metrics_export_the_constraint_counters(llm_fp32):
    from prometheus_client import generate_latest

    from pagedserve.service.core.metrics import ServiceMetrics

    llm_fp32.generate(["z"], SamplingParams(temperature=0, max_tokens=5, constraint=choice("a", "b")))
    text = generate_latest(ServiceMetrics("m", llm_fp32.engine.stats).registry).decode()
    stats = llm_fp32.engine.stats().constraints
    assert f'pagedserve:structured_output_requests_total{{model_name="m"}} {float(stats.num_requests)}' in text
    assert f'pagedserve:structured_output_compile_seconds_count{{model_name="m"}} {float(stats.cache_misses)}' in text
    assert 'pagedserve:structured_output_compile_cache_hits_total{model_name="m"}' in text


def test_async_engine_streams_a_constrained_request_beside_a_plain_one(llm_fp32):
    from pagedserve.engine.async_engine import AsyncEngine

    engine = llm_fp32.engine
    plain = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    alone = llm_fp32.generate(["Once upon a time"], plain)[0].outputs[0].token_ids
    constrained = SamplingParams(temperature=0.7, seed=9, max_tokens=200, constraint=json_schema(SCHEMAS["address"]))

    async def last(front: AsyncEngine, request_id: str, prompt: str, params: SamplingParams):
        out = None
        async for out in front.generate(request_id, prompt, params):
            pass
        return out.outputs[0]

    async def scenario():
        front = AsyncEngine(engine.config, engine=engine)
        await front.start()
        try:
            return await asyncio.gather(last(front, "so-json", PROMPT, constrained),
                                        last(front, "so-plain", "Once upon a time", plain))
        finally:
            await front.shutdown()

    shaped, bystander = asyncio.run(scenario())
    jsonschema.validate(json.loads(shaped.text), SCHEMAS["address"])
    assert bystander.token_ids == alone
    assert_no_blocks_held(engine)


def test_bitmask_bias_matches_the_bits():
    import torch

    from pagedserve.engine.structured_output.bitmask import to_bias

    gen = torch.Generator().manual_seed(0)
    words = torch.randint(-2**31, 2**31 - 1, (3, 4), dtype=torch.int32, generator=gen)
    for vocab in (100, 128, 150):  # shorter than, equal to and wider than the bitmask
        expected = [[t < 128 and (int(words[r, t // 32]) >> (t % 32)) & 1 == 1 for t in range(vocab)] for r in range(3)]
        assert (to_bias(words, vocab) == 0).tolist() == expected
        assert set(to_bias(words, vocab).unique().tolist()) <= {0.0, float("-inf")}
