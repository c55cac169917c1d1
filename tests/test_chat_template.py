"""Chat templates render exactly what transformers' apply_chat_template renders, and refuse bad input by name."""

from __future__ import annotations

import functools
import json

import pytest
from transformers import AutoTokenizer

from chat_templates import ALTERNATING, LLAMA3, QWEN2, conversation, tokenizer_dir
from pagedserve.engine.errors import ConfigError, InvalidRequestError, MissingChatTemplateError
from pagedserve.engine.loading.chat_template import ChatMessage, ChatOptions, check_messages, read_template_file
from pagedserve.engine.loading.tokenizer import Tokenizer

VOCAB = 49152


@pytest.fixture(scope="module")
def folders(tmp_path_factory, default_model):
    root = tmp_path_factory.mktemp("chat-templates")
    return {
        "smollm2": default_model.tokenizer_dir,
        "llama3": tokenizer_dir(root / "llama3", LLAMA3, as_jinja_file=False, bos="<|begin_of_text|>"),
        "qwen2": tokenizer_dir(root / "qwen2", QWEN2, as_jinja_file=True),
        "none": tokenizer_dir(root / "none", None, as_jinja_file=False),
    }


@pytest.fixture(scope="module")
def tokenizers(folders):
    """(transformers', ours) per folder, loaded once for the module (~1 s a pair); rendering leaves them unchanged."""
    @functools.cache
    def load(name: str) -> tuple:
        return AutoTokenizer.from_pretrained(str(folders[name])), Tokenizer(folders[name], VOCAB)
    return load


def _messages(chat: list[dict[str, str]]) -> tuple[ChatMessage, ...]:
    return tuple(ChatMessage(m["role"], m["content"]) for m in chat)


@pytest.mark.parametrize("name", ["smollm2", "llama3", "qwen2"])
@pytest.mark.parametrize("turns", [1, 2, 5])
@pytest.mark.parametrize("system", [False, True], ids=["no-system", "system"])
def test_rendered_prompt_equals_transformers(tokenizers, name, turns, system):
    hf, ours = tokenizers(name)
    chat = conversation(turns, system)
    for add_generation_prompt in (True, False):
        expected = hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=add_generation_prompt)
        got = ours.chat.render(_messages(chat), ChatOptions(add_generation_prompt=add_generation_prompt))
        assert got.encode() == expected.encode()
    expected_ids = hf.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ours.apply_chat_template(_messages(chat)) == list(expected_ids)


def test_templates_differ_so_the_comparison_means_something(tokenizers):
    chat = _messages(conversation(2, False))  # with a system message, SmolLM2's and Qwen2's formats coincide
    rendered = {name: tokenizers(name)[1].chat.render(chat) for name in ("smollm2", "llama3", "qwen2")}
    assert len(set(rendered.values())) == 3
    assert rendered["llama3"].startswith("<|begin_of_text|><|start_header_id|>system")
    assert "Today Date: " in rendered["llama3"]


def test_request_template_overrides_the_models(tokenizers):
    hf, ours = tokenizers("smollm2")
    chat = conversation(2, False)
    expected = hf.apply_chat_template(chat, chat_template=QWEN2, tokenize=False, add_generation_prompt=True)
    assert ours.chat.render(_messages(chat), ChatOptions(template=QWEN2)) == expected


def test_server_template_file_overrides_the_models(folders, tmp_path):
    path = tmp_path / "qwen.jinja"
    path.write_text(QWEN2)
    ours = Tokenizer(folders["smollm2"], VOCAB, read_template_file(path))
    assert ours.chat.render(_messages(conversation(1, False))).startswith("<|im_start|>system\nYou are Qwen")


def test_a_broken_template_file_is_a_config_error(tmp_path):
    path = tmp_path / "broken.jinja"
    path.write_text("{% for m in messages %}{{ m.content }")
    with pytest.raises(ConfigError, match="chat_template") as info:
        read_template_file(path)
    assert info.value.field == "chat_template"
    with pytest.raises(ConfigError, match="cannot read"):
        read_template_file(tmp_path / "missing.jinja")


def test_model_without_template_names_the_model(tokenizers):
    ours = tokenizers("none")[1]
    assert not ours.chat.available
    with pytest.raises(MissingChatTemplateError, match="'none' has no chat template"):
        ours.apply_chat_template(_messages(conversation(1, False)))
    # a request's own template still works there
    assert ours.chat.render(_messages(conversation(1, False)), ChatOptions(template=QWEN2))


def test_template_refusal_is_an_invalid_request(tokenizers):
    ours = tokenizers("smollm2")[1]
    bad = _messages([{"role": "assistant", "content": "hi"}])
    with pytest.raises(InvalidRequestError, match="roles must alternate") as info:
        ours.chat.render(bad, ChatOptions(template=ALTERNATING))
    assert info.value.field == "messages"


def test_request_template_syntax_error_names_the_field(tokenizers):
    ours = tokenizers("smollm2")[1]
    with pytest.raises(InvalidRequestError) as info:
        ours.chat.render(_messages(conversation(1, False)), ChatOptions(template="{% if %}"))
    assert info.value.field == "chat_template"


@pytest.mark.parametrize(("messages", "field"), [
    ([], "messages"),
    ((ChatMessage("user", "hi"), ChatMessage("wizard", "x")), "messages[1].role"),
    ((ChatMessage("user", 3),), "messages[0].content"),
    (({"role": "user", "content": "hi"},), "messages[0]"),
])
def test_check_messages_names_the_bad_message(messages, field):
    with pytest.raises(InvalidRequestError) as info:
        check_messages(messages)
    assert info.value.field == field


TOOLS = ({"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},)


def test_tools_documents_and_kwargs_render_as_transformers_renders_them(folders, tmp_path):
    """A named-template dict: "tool_use" with tools, "default" without (transformers' choice); documents and
    template variables reach the template."""
    default = "{% for m in messages %}{{ m.content }}{% endfor %}{% if shout %}!{% endif %}"
    tool_use = ("{% for t in tools %}[{{ t.function.name }}]{% endfor %}{% for d in documents or [] %}"
                "<{{ d.title }}>{% endfor %}{% for m in messages %}{{ m.content or '' }}{% for c in m.tool_calls or [] %}"
                "{{ c.function.name }}{{ c.function.arguments | tojson }}{% endfor %}{% endfor %}")
    folder = tokenizer_dir(tmp_path / "named", None, as_jinja_file=False)
    config = folder / "tokenizer_config.json"
    data = json.loads(config.read_text())
    data["chat_template"] = [{"name": "default", "template": default}, {"name": "tool_use", "template": tool_use}]
    config.write_text(json.dumps(data))
    ours, theirs = Tokenizer(folder, VOCAB), AutoTokenizer.from_pretrained(folder)
    chat = [{"role": "user", "content": "Hi"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": {"tz": "UTC"}}}]},
            {"role": "tool", "content": "12:00", "tool_call_id": "c1", "name": "get_time"}]
    messages = tuple(ChatMessage(m["role"], m["content"], tuple(m.get("tool_calls", ())), m.get("tool_call_id"),
                                 m.get("name")) for m in chat)
    documents = ({"title": "doc", "text": "x"},)
    got = ours.chat.render(messages, ChatOptions(tools=TOOLS, documents=documents))
    assert got == theirs.apply_chat_template(chat, tools=list(TOOLS), documents=list(documents), tokenize=False,
                                             add_generation_prompt=True)
    assert got == '[get_time]<doc>Higet_time{"tz": "UTC"}12:00'
    assert ours.chat.render(messages[:1], ChatOptions(kwargs=(("shout", True),))) == "Hi!"
    with pytest.raises(InvalidRequestError) as refused:
        ChatOptions(kwargs=(("tools", []),))
    assert refused.value.field == "chat_template_kwargs"


def test_bad_words_are_tokenized_alone_and_after_a_space(default_model):
    from pagedserve.engine.admission import Admission, ModelLimits

    tokenizer = Tokenizer(default_model.tokenizer_dir, VOCAB)
    admission = Admission(ModelLimits(VOCAB, 512, 10_000), tokenizer)
    ids = admission._bad_words_ids(("Paris", " Paris"))
    assert ids == (tuple(tokenizer.encode("Paris", False)), tuple(tokenizer.encode(" Paris", False)))
