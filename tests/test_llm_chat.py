"""vLLM's offline LLM.chat (and SamplingParams.truncate_prompt_tokens): OpenAI-format conversations rendered by the model's chat template give the same tokens as
generate on transformers' apply_chat_template of them; a list of conversations answers in order; a continued final
message, a template given as text and template variables reach the template; bad messages name the field."""

from __future__ import annotations

import pytest

from pagedserve.engine import SamplingParams
from pagedserve.engine.errors import InvalidRequestError

GREEDY = SamplingParams(temperature=0, max_tokens=8)
TALK = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a color."}]
OTHER = [{"role": "user", "content": [{"type": "text", "text": "Count to three"}, {"type": "text", "text": "now."}]}]


def _tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_chat_equals_generate_on_transformers_template(llm_fp32, hf_reference):
    _, tokenizer = hf_reference
    expected = []
    for conversation in (TALK, OTHER):
        flat = [{**m, "content": "\n".join(p["text"] for p in m["content"])} if isinstance(m["content"], list) else m
                for m in conversation]  # text parts joined, as vLLM joins them
        ids = tokenizer.apply_chat_template(flat, add_generation_prompt=True, tokenize=True, return_dict=False)
        expected.append(list(llm_fp32.generate([list(ids)], GREEDY)[0].outputs[0].token_ids))
    assert _tokens(llm_fp32.chat(TALK, GREEDY)) == expected[:1]
    assert _tokens(llm_fp32.chat([TALK, OTHER], GREEDY)) == expected


def test_continued_message_and_a_template_given_as_text(llm_fp32, hf_reference):
    _, tokenizer = hf_reference
    open_turn = [*TALK, {"role": "assistant", "content": "The color is"}]
    ids = tokenizer.apply_chat_template(open_turn, continue_final_message=True, tokenize=True, return_dict=False)
    continued = llm_fp32.chat(open_turn, GREEDY, add_generation_prompt=False, continue_final_message=True)
    assert _tokens(continued) == _tokens(llm_fp32.generate([list(ids)], GREEDY))
    template = "{% for m in messages %}{{ greeting }} {{ m['content'] }}\n{% endfor %}"
    rendered = "".join(f"Hey {m['content']}\n" for m in TALK)
    plain = llm_fp32.generate([tokenizer.encode(rendered, add_special_tokens=False)], GREEDY)
    assert _tokens(llm_fp32.chat(TALK, GREEDY, chat_template=template, chat_template_kwargs={"greeting": "Hey"})) \
        == _tokens(plain)


@pytest.mark.parametrize(("messages", "field"), [
    ([{"content": "no role"}], "messages[0].role"),
    ([], "messages"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "messages[0].content[0]"),
])
def test_bad_messages_name_the_field(llm_fp32, messages, field):
    with pytest.raises(InvalidRequestError) as info:
        llm_fp32.chat(messages, GREEDY)
    assert info.value.field == field
    assert not llm_fp32.engine.has_unfinished_requests()


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm_fp32, hf_reference):
    """vLLM's offline SamplingParams(truncate_prompt_tokens=N): the prompt's last N tokens, as if sent alone."""
    _, tokenizer = hf_reference
    ids = tokenizer("The quick brown fox jumps over the lazy dog and runs far away").input_ids
    cut = llm_fp32.generate([ids], SamplingParams(temperature=0, max_tokens=6, truncate_prompt_tokens=5))
    alone = llm_fp32.generate([ids[-5:]], SamplingParams(temperature=0, max_tokens=6))
    assert _tokens(cut) == _tokens(alone) and len(cut[0].prompt_token_ids) == 5
    with pytest.raises(InvalidRequestError) as info:
        llm_fp32.generate([ids], SamplingParams(truncate_prompt_tokens=0))
    assert info.value.field == "truncate_prompt_tokens"
