"""Tool-call formats on texts written as each model family writes them: whole and streamed (any split of the text
gives the same content and calls as the whole), truncated and malformed (a clear answer: the text as content),
the forced grammar of each format accepts exactly what its parser reads back, and the registry lists its names."""

from __future__ import annotations

import json
import random

import llguidance
import llguidance.hf
import pytest
from transformers import AutoTokenizer

from pagedserve.engine.errors import ConfigError
from pagedserve.engine.loading.model_store import resolve_model
from pagedserve.service.openai.openai_tools import ToolSettings
from pagedserve.service.openai.tool_parsers.base import ForcedCalls
from pagedserve.service.openai.tool_parsers.forced_json import JsonListFormat, json_list_schema
from pagedserve.service.openai.tool_parsers.registry import TOOL_PARSERS
from pagedserve.service.openai.tool_parsers.stream import ToolCallStream

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
           "required": ["city", "days"], "additionalProperties": False}
NOW = {"type": "object", "properties": {}}
FORCED = ForcedCalls((("get_weather", WEATHER), ("now", NOW)), 1, None)
CALLS = [("get_weather", {"city": "Paris", "days": 3}), ("now", {})]

# (parser, text, content, calls): real shapes of each family's output.
CASES = [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
               '</tool_call>\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>', "Let me check.\n\n", CALLS),
    ("hermes", '<tool_call>\n{"name": "now", "arguments": {}}', "", CALLS[1:]),  # Qwen stops unclosed
    ("hermes", "Paris is sunny; <tool is not a tag.", "Paris is sunny; <tool is not a tag.", []),
    ("qwen", '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\", \\"days\\": 3}"}</tool_call>',
     "", CALLS[:1]),  # arguments written as a JSON string
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}; '
                    '{"name": "now", "parameters": {}}', "", CALLS),
    ("llama3_json", '{"name": "now", "arguments": {}}', "", CALLS[1:]),
    ("llama3_json", "The weather {in Paris} is fine.", "The weather {in Paris} is fine.", []),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),  # JSON that is not a call is an answer
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, '
                '{"name": "now", "arguments": {}}]', "", CALLS),
    ("mistral", 'Sure. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}[TOOL_CALLS]now[ARGS]{}',
     "Sure. ", CALLS),
    ("mistral", "No calls [TOOL here.", "No calls [TOOL here.", []),
    ("pythonic", '[get_weather(city="Paris", days=3), now()]', "", CALLS),
    ("pythonic", '<|python_start|>[get_weather(city=\'Paris\', days=3)]<|python_end|>', "", CALLS[:1]),
    ("pythonic", "[1, 2, 3] are numbers.", "[1, 2, 3] are numbers.", []),
    ("pythonic", "Paris is in France.", "Paris is in France.", []),
    ("qwen3_coder", "Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=now>\n"
                    "</function>\n</tool_call>", "Let me check.\n\n", CALLS),
    ("qwen3_coder", "<tool_call>\n<function=now>\n</function>", "", CALLS[1:]),  # stopped unclosed
    ("qwen3_coder", "Use <function=x> tags like <tool_ here.", "Use <function=x> tags like <tool_ here.", []),
    ("qwen3_xml", "<tool_call><function=get_weather><parameter=city>Paris</parameter><parameter=days>3</parameter>"
                  "</function></tool_call>", "", CALLS[:1]),
]


def _expected(calls):
    return [(name, args) for name, args in calls]


def _read(parser_name: str, pieces: list[str]) -> tuple[str, list[tuple[str, dict]], list[str]]:
    """Streams pieces through a ToolCallStream: (content, calls, ids) as a client accumulates them."""
    stream = ToolCallStream(TOOL_PARSERS.get(parser_name)())
    content, calls, ids, text = "", {}, {}, ""
    for i, piece in enumerate(pieces):
        text += piece
        delta = stream.delta(text, final=i == len(pieces) - 1)
        content += delta.get("content", "")
        for call in delta.get("tool_calls", []):
            entry = calls.setdefault(call["index"], ["", ""])
            if "id" in call:
                assert call["index"] not in ids, "the id comes once per call"
                ids[call["index"]] = call["id"]
                entry[0] = call["function"]["name"]
            entry[1] += call["function"].get("arguments", "")
    return content, [(n, json.loads(a)) for n, a in calls.values()], list(ids.values())


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_whole_text(parser, text, content, calls):
    message_content, message_calls = ToolCallStream(TOOL_PARSERS.get(parser)()).message(text)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message_calls] == calls
    assert message_content == (content if content.strip() or not calls else None)
    assert len({c["id"] for c in message_calls}) == len(message_calls)


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_any_split_streams_the_same(parser, text, content, calls):
    rng = random.Random(len(text))
    splits = [[text], list(text)] + [_random_split(text, rng) for _ in range(5)]
    for pieces in splits:
        assert _read(parser, pieces)[:2] == (content, calls), pieces


def _random_split(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(6, len(text) - 1)))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


@pytest.mark.parametrize(("parser", "text", "content", "calls"), [c for c in CASES if c[3]])
def test_truncated_or_broken_calls_finish_clearly(parser, text, content, calls):
    """Every prefix (max_tokens) and every single-character deletion: no exception, and what is not a call comes
    back as content, so the text is never lost."""
    variants = [text[:n] for n in range(len(text))] + [text[:i] + text[i + 1:] for i in range(len(text))]
    for variant in variants:
        got_content, got_calls = ToolCallStream(TOOL_PARSERS.get(parser)()).message(variant)
        for call in got_calls:
            assert isinstance(json.loads(call["function"]["arguments"]), dict)
        if not got_calls:
            assert got_content == variant, variant


@pytest.mark.parametrize("seed", range(40))
def test_fuzzed_bytes_never_raise(seed):
    rng = random.Random(seed)
    alphabet = ['<tool_call>', '</tool_call>', '[TOOL_CALLS]', '[ARGS]', '<|python_tag|>', '{', '}', '[', ']', '(',
                ')', '"', ':', ',', ';', '=', 'name', 'arguments', 'x', ' ', '\n', '\\', '1e999', 'None', '**',
                '<function=f>', '</function>', '<parameter=p>', '</parameter>']
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60)))
    for name in TOOL_PARSERS.names():
        stream = ToolCallStream(TOOL_PARSERS.get(name)())
        for n in range(len(text) + 1):
            stream.delta(text[:n], final=n == len(text))
        ToolCallStream(TOOL_PARSERS.get(name)()).message(text)


@pytest.fixture(scope="module")
def tokenizer_info():
    hf = AutoTokenizer.from_pretrained(resolve_model(None).tokenizer_dir)
    return llguidance.hf.from_tokenizer(hf)


def _accepts(tokenizer_info, grammar: str, text: str) -> bool:
    matcher = llguidance.LLMatcher(tokenizer_info, grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    ok = matcher.consume_tokens(tokenizer_info.tokenize_str(text))
    return ok and not matcher.is_error() and matcher.is_accepting()


FORCED_SAMPLES = {
    "hermes": ('<tool_call>\n{"name": "get_weather", "arguments": {"city":"Paris","days":3}}\n</tool_call>\n'
               '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'),
    "llama3_json": '{"name": "get_weather", "parameters": {"city":"Paris","days":3}}; {"name": "now", "parameters": {}}',
    "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city":"Paris","days":3}}, '
               '{"name": "now", "arguments": {}}]',
    "pythonic": '[get_weather(city="Paris", days=3), now()]',
    "qwen3_coder": ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n"
                    "3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=now>\n</function>\n"
                    "</tool_call>"),
}


@pytest.mark.parametrize("parser", sorted(FORCED_SAMPLES))
def test_forced_grammar_accepts_what_the_parser_reads(tokenizer_info, parser):
    grammar = llguidance.grammar_from("grammar", TOOL_PARSERS.get(parser)().forced_grammar(FORCED))
    sample = FORCED_SAMPLES[parser]
    assert _accepts(tokenizer_info, grammar, sample)
    assert ToolCallStream(TOOL_PARSERS.get(parser)()).message(sample)[1]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in ToolCallStream(TOOL_PARSERS.get(parser)()).message(sample)[1]] == CALLS
    assert not _accepts(tokenizer_info, grammar, "Paris is sunny.")  # a forced answer is a call
    wrong_type = sample.replace("3", '"three"', 1)
    assert not _accepts(tokenizer_info, grammar, wrong_type)  # the parameter schema holds inside the format
    single = llguidance.grammar_from("grammar", TOOL_PARSERS.get(parser)().forced_grammar(
        ForcedCalls(FORCED.functions, 1, 1)))
    assert not _accepts(tokenizer_info, single, sample)  # parallel_tool_calls: false allows one call


def test_json_list_schema_is_read_back():
    text = '[{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}, {"name": "now", "parameters": {}}]'
    schema = json_list_schema(ForcedCalls(FORCED.functions, 1, 1))
    assert schema["maxItems"] == 1 and schema["minItems"] == 1
    _, calls = ToolCallStream(JsonListFormat()).message(text)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == CALLS
    cut = text[:text.index('{"name": "now"') + 10]  # max_tokens inside the second call: the first one stays
    content, calls = ToolCallStream(JsonListFormat()).message(cut)
    assert [c["function"]["name"] for c in calls] == ["get_weather"] and content == '{"name": "'
    assert _read_json_list_stream(text) == CALLS


def _read_json_list_stream(text: str) -> list:
    stream, calls = ToolCallStream(JsonListFormat()), []
    for n in range(1, len(text) + 1):
        for call in stream.delta(text[:n], n == len(text)).get("tool_calls", []):
            calls.append((call["function"]["name"], json.loads(call["function"]["arguments"])))
    return calls


def test_mistral_call_ids_are_nine_alphanumerics():
    _, calls = ToolCallStream(TOOL_PARSERS.get("mistral")()).message(CASES[8][1])
    assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in calls)


def test_unknown_parser_and_auto_without_parser_are_refused_listing_names():
    with pytest.raises(ConfigError, match="supported: hermes, llama3_json.*pythonic"):
        ToolSettings(False, "no_such_parser")
    with pytest.raises(ConfigError, match="needs --tool-call-parser"):
        ToolSettings(True, None)
    assert ToolSettings(True, "qwen").make_parser().name == "hermes"


def test_qwen3_coder_values_are_typed_by_the_request_schema():
    """The raw text of a parameter reads as the schema's type: a zip code stays a string, a count an integer."""
    text = ("<tool_call>\n<function=ship>\n<parameter=zip>\n75001\n</parameter>\n<parameter=count>\n2\n</parameter>"
            "\n<parameter=express>\nTrue\n</parameter>\n<parameter=tags>\n[\"a\"]\n</parameter>\n<parameter=note>\n"
            "line one\nline two\n</parameter>\n</function>\n</tool_call>")
    schema = {"type": "object", "properties": {"zip": {"type": "string"}, "count": {"type": "integer"},
                                               "express": {"type": "boolean"}, "tags": {"type": "array"},
                                               "note": {"type": "string"}}}
    bound = ToolSettings(True, "qwen3_coder").make_parser({"ship": schema})
    (call,) = ToolCallStream(bound).message(text)[1]
    assert json.loads(call["function"]["arguments"]) == {"zip": "75001", "count": 2, "express": True, "tags": ["a"],
                                                         "note": "line one\nline two"}
    (unbound,) = ToolCallStream(TOOL_PARSERS.get("qwen3_coder")()).message(text)[1]
    assert json.loads(unbound["function"]["arguments"])["zip"] == 75001  # no schema: JSON when it reads as JSON
