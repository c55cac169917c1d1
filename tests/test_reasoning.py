"""Reasoning models' thoughts (`--reasoning-parser`, engine/reasoning.py) in the engine: a constrained request's
grammar waits until the output closes the thought, unless the prompt closed it; and the text split into thought and
content, whole or streamed.

The model is the real default one (SmolLM2-135M-Instruct): given a few answers that think in `<think>...</think>`
first, it writes its own thought and closes it, greedy, so the grammar's start is seen where the model put it."""

from __future__ import annotations

import random
import re

import pytest
from pagedserve.engine import LLMEngine, SamplingParams
from pagedserve.engine.config import EngineConfig
from pagedserve.engine.core.sequence import FinishReason
from pagedserve.engine.errors import ConfigError, InvalidRequestError
from pagedserve.engine.loading.chat_template import ChatMessage, ChatOptions
from pagedserve.engine.reasoning import REASONING_FORMATS, ReasoningFormat
from pagedserve.engine.requests import ChatPrompt, GenerationRequest, TextPrompt, TokensPrompt
from pagedserve.service.core.thought_reader import ThoughtReader
from pagedserve.service.openai.openai_reasoning import reasoning_plan
from structured_fixtures import assert_no_blocks_held, regex

R1 = REASONING_FORMATS.get("deepseek_r1")
SHOTS = (("What is 2+2?", "<think>2 plus 2 makes 4.</think>The answer is 4."),
         ("What color is the sky?", "<think>The sky looks blue in daylight.</think>The sky is blue."),
         ("What is the capital of Italy?", "<think>Italy's capital city is Rome.</think>The capital of Italy is Rome."))
QUESTIONS = ("What is the capital of France?", "What is 3+5?", "Name a fruit that is yellow.")
YES_NO = "(yes|no)"


def few_shot(question: str) -> tuple[ChatMessage, ...]:
    messages = [ChatMessage("system", "Think inside <think></think> first, then answer.")]
    for user, answer in SHOTS:
        messages += [ChatMessage("user", user), ChatMessage("assistant", answer)]
    return (*messages, ChatMessage("user", question))


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(EngineConfig(max_model_len=1024, kv_cache_memory=64 << 20, reasoning_parser="deepseek_r1"))


def run(engine: LLMEngine, prompt, params: SamplingParams, request_id: str = "r"):
    admitted = engine.admission.admit(GenerationRequest(prompt, params))
    engine.submit(request_id, admitted)
    finished = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished = out
    return admitted, finished


def greedy(max_tokens: int = 64, constraint=None) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, constraint=constraint)


@pytest.mark.parametrize("question", QUESTIONS)
def test_the_grammar_applies_from_the_token_after_the_thought_closes(engine, question):
    prompt = ChatPrompt(few_shot(question))
    admitted, free = run(engine, prompt, greedy())
    assert admitted.thought_closed is False  # the examples' closed thoughts are earlier turns, not this one
    free_ids = free.outputs[0].token_ids
    closes = next(k for k in range(1, len(free_ids) + 1) if "</think>" in engine.tokenizer.decode(list(free_ids[:k])))
    _, held = run(engine, prompt, greedy(constraint=regex(YES_NO)))
    out = held.outputs[0]
    # Unmasked (the model's own tokens) up to the one that closes the thought, then only what the grammar allows.
    assert out.token_ids[:closes] == free_ids[:closes]
    thought, _, answer = out.text.partition("</think>")
    assert re.fullmatch(YES_NO, answer), out.text
    assert out.finish_reason == FinishReason.STOP and thought.startswith("<think>")
    assert_no_blocks_held(engine)


def test_a_prompt_that_closed_the_thought_is_constrained_from_the_first_token(engine):
    text = engine.tokenizer.render_chat(few_shot(QUESTIONS[0]), ChatOptions()) + "<think>\n\n</think>\n\n"
    admitted, out = run(engine, TextPrompt(text, add_special_tokens=False), greedy(constraint=regex(YES_NO)))
    assert admitted.thought_closed is True and admitted.grammar_waits_for is None
    assert re.fullmatch(YES_NO, out.outputs[0].text)


def test_a_thought_that_never_closes_leaves_the_output_unconstrained(engine):
    """As vLLM: the grammar waits for the end marker; an output cut by max_tokens inside the thought is the model's."""
    prompt = TextPrompt("<think>Let me count slowly: one, two, three,", add_special_tokens=True)
    _, free = run(engine, prompt, greedy(12))
    admitted, held = run(engine, prompt, greedy(12, regex(YES_NO)))
    assert "</think>" not in free.outputs[0].text and admitted.grammar_waits_for is not None
    assert held.outputs[0].token_ids == free.outputs[0].token_ids
    assert held.outputs[0].finish_reason == FinishReason.LENGTH


def test_samples_forked_while_the_grammar_waits_each_wait_on_their_own(engine):
    params = SamplingParams(temperature=0.7, seed=3, n=3, max_tokens=64, constraint=regex(YES_NO))
    _, out = run(engine, ChatPrompt(few_shot(QUESTIONS[1])), params)
    closed = 0
    for sample in out.outputs:
        thought, marker, answer = sample.text.partition("</think>")
        if marker:
            closed += 1
            assert re.fullmatch(YES_NO, answer), sample.text
        else:
            assert sample.finish_reason == FinishReason.LENGTH
    assert closed >= 1
    assert_no_blocks_held(engine)


def test_the_prompt_is_read_in_the_turn_being_answered(engine):
    admit = engine.admission.admit
    messages = few_shot(QUESTIONS[0])
    rendered = engine.tokenizer.render_chat(messages, ChatOptions())
    # The same text as a plain prompt has no turns: its last marker closes a thought (vLLM's whole-prompt reading).
    assert admit(GenerationRequest(TextPrompt(rendered, False), greedy())).thought_closed is True
    ids = tuple(engine.tokenizer.encode(rendered, False))
    constrained = admit(GenerationRequest(TokensPrompt(ids), greedy(constraint=regex(YES_NO))))
    assert constrained.thought_closed is True and constrained.grammar_waits_for is None
    # Token ids are decoded and read only when something depends on it (a constraint, a budget)
    assert admit(GenerationRequest(TokensPrompt(ids), greedy())).thought_closed is None
    continued = (*messages, ChatMessage("assistant", "<think>Paris, surely.</think>The"))
    options = ChatOptions(add_generation_prompt=False, continue_final_message=True)
    assert admit(GenerationRequest(ChatPrompt(continued, options), greedy())).thought_closed is True
    opened = (*messages, ChatMessage("assistant", "<think>Paris"))
    assert admit(GenerationRequest(ChatPrompt(opened, options), greedy())).thought_closed is False


def test_an_engine_without_a_parser_reads_no_thought(llm_fp32):
    admitted = llm_fp32.engine.admission.admit(GenerationRequest(TextPrompt("<think>a</think>"), greedy()))
    assert admitted.thought_closed is None and admitted.grammar_waits_for is None


def test_unknown_parser_is_refused_listing_the_known():
    with pytest.raises(ConfigError, match="reasoning_parser.*supported: deepseek_r1, qwen3"):
        from pagedserve.engine.build import check_backends
        check_backends(EngineConfig(reasoning_parser="granite"))


def test_reasoning_on_a_user_turn_is_refused_naming_it(engine):
    bad = (ChatMessage("user", "hi", reasoning="no"),)
    with pytest.raises(InvalidRequestError, match=r"chat\[0\]\.reasoning|messages\[0\]\.reasoning"):
        engine.admission.admit(GenerationRequest(ChatPrompt(bad), greedy()))


# --- the text read as thought and content ---------------------------------------------------------------------

TEXTS = [
    ("<think>abc</think>xyz", "abc", "xyz"),
    ("abc</think>xyz", "abc", "xyz"),  # the prompt opened the thought
    ("  <think>\nabc</think>", "\nabc", None),
    ("<think>cut short", "cut short", None),  # deepseek_r1: an unclosed text is a thought cut by max_tokens
    ("</think>only content", None, "only content"),
    ("a </ b </think> c </think> d", "a </ b ", " c </think> d"),
]


@pytest.mark.parametrize(("text", "reasoning", "content"), TEXTS)
def test_whole_text(text, reasoning, content):
    assert ThoughtReader(R1).whole(text) == (reasoning, content or "")


@pytest.mark.parametrize(("text", "reasoning", "content"), TEXTS)
def test_any_split_streams_the_same_and_no_marker_piece_leaks(text, reasoning, content):
    rng = random.Random(text)
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, min(6, len(text) - 1))))
        reader, thought, answer = ThoughtReader(R1), "", ""
        for end in [*cuts, len(text)]:
            new, so_far = reader.advance(text[:end], final=end == len(text))
            thought, answer = thought + new, answer + reader.new_content(so_far)
            assert "<th" not in thought + answer.replace("</think> d", "")
        assert (thought or None, answer) == (reasoning, content or "")


def test_unclosed_text_is_content_when_the_request_turned_thinking_off():
    qwen3 = REASONING_FORMATS.get("qwen3")
    off = reasoning_plan({"chat_template_kwargs": {"enable_thinking": False}}, True, qwen3)
    assert off.reader(False).whole("plain answer") == (None, "plain answer")
    assert reasoning_plan({}, True, qwen3).reader(False).whole("cut short") == ("cut short", "")
    assert reasoning_plan({}, True, qwen3).reader(True).whole("a</think>b") == (None, "a</think>b")
    assert reasoning_plan({"include_reasoning": False}, True, R1).reader(False).whole("a</think>b") == (None, "b")
    assert reasoning_plan({}, False, R1) is None and reasoning_plan({}, True, None) is None
    with pytest.raises(InvalidRequestError, match="include_reasoning"):
        reasoning_plan({"include_reasoning": "yes"}, True, R1)


def test_formats_need_two_markers():
    with pytest.raises(ConfigError, match="reasoning_parser"):
        ReasoningFormat("broken", "<t>", "<t>")


# --- thinking_token_budget ------------------------------------------------------------------------------------


def _opens(engine, ids) -> int:
    """How many of `ids` it takes for the text to hold the start marker."""
    return next(k for k in range(1, len(ids) + 1) if "<think>" in engine.tokenizer.decode(list(ids[:k])))


@pytest.mark.parametrize("budget", [0, 3])
def test_a_spent_budget_forces_the_end_marker_after_the_model_opened_the_thought(engine, budget):
    prompt = ChatPrompt(few_shot(QUESTIONS[2]))
    _, free = run(engine, prompt, greedy())
    free_ids = free.outputs[0].token_ids
    opened = _opens(engine, free_ids)
    _, capped = run(engine, prompt, SamplingParams(temperature=0, max_tokens=64, thinking_token_budget=budget))
    ids, end_ids = capped.outputs[0].token_ids, tuple(engine.tokenizer.encode("</think>", False))
    assert len(free.outputs[0].text.partition("</think>")[0]) > 0 and "</think>" not in engine.tokenizer.decode(
        list(free_ids[:opened + budget]))  # the model's own thought is longer than the budget
    assert ids[:opened + budget] == free_ids[:opened + budget]
    assert ids[opened + budget:opened + budget + len(end_ids)] == end_ids
    assert capped.outputs[0].text.count("</think>") >= 1
    assert_no_blocks_held(engine)


def test_a_budget_the_thought_stays_within_changes_nothing(engine):
    prompt = ChatPrompt(few_shot(QUESTIONS[0]))
    _, free = run(engine, prompt, greedy())
    _, roomy = run(engine, prompt, SamplingParams(temperature=0, max_tokens=64, thinking_token_budget=40))
    assert roomy.outputs[0].token_ids == free.outputs[0].token_ids


def test_budget_zero_on_a_prompt_that_opened_the_thought_answers_at_once_and_the_grammar_follows(engine):
    text = engine.tokenizer.render_chat(few_shot(QUESTIONS[0]), ChatOptions()) + "<think>\n"
    prompt = TextPrompt(text, add_special_tokens=False)
    params = SamplingParams(temperature=0, max_tokens=32, thinking_token_budget=0, constraint=regex(YES_NO))
    admitted, out = run(engine, prompt, params)
    end_ids = tuple(engine.tokenizer.encode("</think>", False))
    assert admitted.budget.opened and out.outputs[0].token_ids[:len(end_ids)] == end_ids
    assert re.fullmatch(YES_NO, out.outputs[0].text.removeprefix("</think>"))


def test_a_prompt_that_closed_the_thought_starts_no_budget(engine):
    text = engine.tokenizer.render_chat(few_shot(QUESTIONS[0]), ChatOptions()) + "<think>\n\n</think>\n\n"
    prompt = TextPrompt(text, add_special_tokens=False)
    _, free = run(engine, prompt, greedy(16))
    admitted, capped = run(engine, prompt, SamplingParams(temperature=0, max_tokens=16, thinking_token_budget=0))
    assert admitted.budget is None and capped.outputs[0].token_ids == free.outputs[0].token_ids


def test_budget_errors_name_the_field(llm_fp32):
    with pytest.raises(InvalidRequestError, match="thinking_token_budget: must be >= 0"):
        SamplingParams(thinking_token_budget=-1)
    with pytest.raises(InvalidRequestError, match="thinking_token_budget: needs a server started with --reasoning"):
        llm_fp32.engine.admission.admit(GenerationRequest(TextPrompt("Hi"), SamplingParams(thinking_token_budget=4)))


def test_markers_held_as_special_tokens_open_the_grammar_by_id(tmp_path):
    """Real reasoning tokenizers hold the markers as single tokens. Added as special tokens here, the end marker
    never reaches the text (skip_special_tokens), so only its id can open the grammar."""
    from conftest import make_tiny_model
    from transformers import AutoTokenizer

    path = make_tiny_model(tmp_path, vocab_size=49160)
    hf = AutoTokenizer.from_pretrained(path)
    hf.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    hf.save_pretrained(path)
    start_id, end_id = hf.convert_tokens_to_ids(["<think>", "</think>"])
    tiny = LLMEngine(EngineConfig(model=str(path), dtype="float32", reasoning_parser="qwen3"))
    assert tiny.admission.thought_end.token_id == end_id
    opened = TokensPrompt((5, 6, start_id))
    # The bias makes the end marker the first token; from the next one the grammar masks it out.
    params = SamplingParams(temperature=0, max_tokens=16, logit_bias={end_id: 100.0}, constraint=regex("[ab]{1,4}"))
    admitted, out = run(tiny, opened, params)
    assert admitted.grammar_waits_for.token_id == end_id and out.outputs[0].token_ids[0] == end_id
    assert re.fullmatch("[ab]{1,4}", out.outputs[0].text), out.outputs[0].text
    budget = SamplingParams(temperature=0, max_tokens=6, thinking_token_budget=2, logit_bias={end_id: -100.0})
    _, capped = run(tiny, opened, budget)
    assert capped.outputs[0].token_ids[2] == end_id and end_id not in capped.outputs[0].token_ids[:2]
    # A budget sees the model open and close the thought by id too (the text holds neither marker)
    admitted = tiny.admission.admit(GenerationRequest(TokensPrompt((5, 6)), budget))
    state = admitted.budget.fork(0)
    assert not state.opened
    state.note(start_id, "")
    assert state.opened and not state.done
    state.note(end_id, "")
    assert state.done and state.forcing is None


def test_constraints_in_reasoning_apply_from_the_first_token_inside_the_thought():
    """vLLM's enable_in_reasoning (`--structured-outputs-config '{"enable_in_reasoning": true}'`)."""
    from pagedserve.service.cli import build_parser, engine_config

    args = build_parser().parse_args(["serve", "--max-model-len", "1024", "--kv-cache-memory", "64MiB",
                                      "--structured-outputs-config",
                                      '{"backend": "guidance", "reasoning_parser": "deepseek_r1", '
                                      '"enable_in_reasoning": true}'])
    eager = LLMEngine(engine_config(args))
    admitted, out = run(eager, ChatPrompt(few_shot(QUESTIONS[0])), greedy(constraint=regex(YES_NO)))
    assert admitted.thought_closed is False and admitted.grammar_waits_for is None
    assert re.fullmatch(YES_NO, out.outputs[0].text)


@pytest.mark.parametrize(("config", "message"), [
    ('{"backend": "xgrammar"}', r"structured_outputs_config\.backend: 'xgrammar' is not available"),
    ('{"disable_any_whitespace": true}', r"structured_outputs_config\.disable_any_whitespace: unknown"),
    ('{"enable_in_reasoning": "yes"}', r"structured_outputs_config\.enable_in_reasoning: must be true or false"),
    ("[1]", "structured_outputs_config: must be a JSON object"),
    ("{oops", "structured_outputs_config: is not valid JSON"),
])
def test_structured_outputs_config_refuses_what_it_cannot_honour_by_key(config, message):
    from pagedserve.service.cli import build_parser, engine_config

    with pytest.raises(ConfigError, match=message):
        engine_config(build_parser().parse_args(["serve", "--structured-outputs-config", config]))
    with pytest.raises(ConfigError, match=r"reasoning_parser: 'qwen3' disagrees with --reasoning-parser"):
        engine_config(build_parser().parse_args(["serve", "--reasoning-parser", "deepseek_r1",
                                                 "--structured-outputs-config", '{"reasoning_parser": "qwen3"}']))


def test_the_router_is_told_where_constraints_start():
    from pagedserve.service.router.vllm_requests import constrained_decoding_start

    assert constrained_decoding_start("", False) == "first_token"
    assert constrained_decoding_start("qwen3", False) == "after_reasoning"
    assert constrained_decoding_start("qwen3", True) == "first_token"


def test_a_short_last_message_cannot_hide_the_turns_markers(engine):
    """The turn is what the rendering adds after the conversation, not what follows the last message's text: a user
    who writes "think" (a piece of `</think>`) still has the closed thought of a thinking-off template read."""
    template = ("{% for m in messages %}<|im_start|>{{ m.role }}\\n{{ m.content }}<|im_end|>\\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\\n"
                "{% if not enable_thinking %}<think>\\n\\n</think>\\n\\n{% endif %}{% endif %}")
    for thinking, closed in ((False, True), (True, False)):
        options = ChatOptions(template=template, kwargs=(("enable_thinking", thinking),))
        prompt = ChatPrompt((ChatMessage("user", "think"),), options)
        assert engine.admission.admit(GenerationRequest(prompt, greedy())).thought_closed is closed
