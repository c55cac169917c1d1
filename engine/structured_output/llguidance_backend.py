"""The llguidance backend (chosen by measurement: docs/structured-outputs.md): JSON Schema, regex, Lark or GBNF
grammars, choices and structural tags, compiled for the model's tokenizer.

JSON is compact (no free whitespace between tokens): a small model allowed any whitespace can spend its whole
budget on newlines. A matcher reports itself terminated as soon as the grammar allows nothing but the end.
"""

from __future__ import annotations

import json

import llguidance
import llguidance.hf
import torch

from pagedserve.engine.constraint import ConstraintKind, OutputConstraint
from pagedserve.engine.structured_output.backend import ConstraintMatcher, ConstraintRejected, GrammarBackend

_JSON_OPTIONS = {"whitespace_flexible": False}


class LLGuidanceMatcher(ConstraintMatcher):
    __slots__ = ("matcher", "vocab_words")

    def __init__(self, matcher: llguidance.LLMatcher, vocab_words: int):
        self.matcher, self.vocab_words = matcher, vocab_words

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        target = bitmask[row]
        assert bitmask.dtype == torch.int32 and target.is_contiguous()
        self.matcher.unsafe_compute_mask_ptr(target.data_ptr(), target.numel() * 4)

    def accept(self, token: int) -> bool:
        return self.matcher.consume_token(token) and not self.matcher.is_error()

    def is_terminated(self) -> bool:
        return self.matcher.is_stopped()

    def fork(self) -> "LLGuidanceMatcher":
        return LLGuidanceMatcher(self.matcher.deep_copy(), self.vocab_words)


class LLGuidanceBackend(GrammarBackend):
    name = "llguidance"

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: frozenset[int]):
        # The grammar's vocabulary covers the tokenizer's tokens and the model's logits, whichever is wider; ids past
        # the logits are never sampled (the mask step cuts the bitmask to the logits' width).
        self.vocab_size = max(vocab_size, len(hf_tokenizer))
        eos = sorted(eos_token_ids) or None
        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=self.vocab_size, eos_token=eos)

    def compile(self, constraint: OutputConstraint) -> llguidance.LLMatcher:
        """The template matcher (grammar built and checked); every sequence starts from a copy of it."""
        matcher = llguidance.LLMatcher(self.tokenizer, _grammar(constraint), log_level=0)
        if matcher.is_error():
            raise ConstraintRejected(matcher.get_error().strip())
        return matcher

    def matcher(self, compiled: llguidance.LLMatcher) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(compiled.deep_copy(), (self.vocab_size + 31) // 32)


def _grammar(constraint: OutputConstraint) -> str:
    kind, spec = constraint.kind, constraint.spec
    try:
        if kind is ConstraintKind.JSON_SCHEMA:
            return llguidance.LLMatcher.grammar_from_json_schema(spec, defaults=_JSON_OPTIONS)
        if kind is ConstraintKind.JSON_OBJECT:
            return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=_JSON_OPTIONS)
        if kind is ConstraintKind.REGEX:
            # llguidance 1.9.1 drops a trailing lone backslash ("a\\" compiles as "a"); every regex dialect refuses it.
            if (len(spec) - len(spec.rstrip("\\"))) % 2:
                raise ConstraintRejected("the pattern ends in a lone backslash, which escapes nothing")
            return llguidance.LLMatcher.grammar_from_regex(spec)
        if kind is ConstraintKind.CHOICE:
            return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in constraint.choices))
        if kind is ConstraintKind.GRAMMAR:
            return llguidance.grammar_from("grammar", spec)  # Lark, or GBNF converted to Lark
        return _structural_tag(spec)
    except ValueError as exc:
        raise ConstraintRejected(str(exc)) from None


def _structural_tag(spec: str) -> str:
    """vLLM's structural tag: {"structures": [{"begin", "schema", "end"}], "triggers": [...]}; free text until a
    trigger, then the structure whose `begin` starts with that trigger, its JSON constrained by `schema`."""
    value = json.loads(spec)
    structures, triggers = value.get("structures"), value.get("triggers")
    if not isinstance(structures, list) or not structures:
        raise ConstraintRejected('needs "structures": a non-empty list of {"begin", "schema", "end"}')
    if not isinstance(triggers, list) or not all(isinstance(t, str) and t for t in triggers):
        raise ConstraintRejected('needs "triggers": a list of non-empty strings')
    tags = []
    for i, s in enumerate(structures):
        if not isinstance(s, dict) or not isinstance(s.get("begin"), str) or not isinstance(s.get("end"), str):
            raise ConstraintRejected(f"structures[{i}] needs string fields begin and end")
        trigger = next((t for t in triggers if s["begin"].startswith(t)), None)
        if trigger is None:
            raise ConstraintRejected(f"structures[{i}].begin {s['begin']!r} starts with none of the triggers")
        tags.append(llguidance.StructTag(trigger=trigger, begin=s["begin"], grammar=s.get("schema", {}), end=s["end"]))
    return llguidance.StructTag.to_grammar(tags)
