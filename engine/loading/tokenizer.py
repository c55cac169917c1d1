"""The model's tokenizer plus an incremental detokenizer that never emits half a UTF-8 character."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pagedserve.engine.core.seq_features import SeqFeature
from pagedserve.engine.errors import ModelLoadError
from pagedserve.engine.loading.chat_template import ChatMessage, ChatOptions, ChatTemplate

# Decoding restarts a few tokens back so merges that depend on the left context (spaces, byte pairs) come out right.
_CONTEXT_TOKENS = 5


class Tokenizer:
    def __init__(self, folder: Path, vocab_size: int, chat_template: str | None = None, name: str | None = None):
        """folder: HF tokenizer files (a model folder, --tokenizer, or a GGUF's exported vocabulary);
        chat_template: replaces the model's own template (the text of `--chat-template FILE`)."""
        from transformers import AutoTokenizer

        try:
            self.hf = AutoTokenizer.from_pretrained(str(folder))
        except Exception as exc:  # transformers raises many types for a broken folder
            raise ModelLoadError(f"tokenizer in {folder}: {exc}") from None
        self.backend = self.hf.backend_tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(self._eos_ids(folder))
        self.chat = ChatTemplate(self.hf, name or folder.name, chat_template)

    def _eos_ids(self, folder: Path) -> set[int]:
        ids = {self.hf.eos_token_id} if self.hf.eos_token_id is not None else set()
        gen = folder / "generation_config.json"
        if gen.is_file():
            eos = json.loads(gen.read_text()).get("eos_token_id")
            ids |= set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        return ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_with_offsets(self, text: str, add_special_tokens: bool = True) -> tuple[list[int], list[tuple[int, int]]]:
        enc = self.backend.encode(text, add_special_tokens=add_special_tokens)
        return enc.ids, [tuple(o) for o in enc.offsets]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: tuple[ChatMessage, ...], options: ChatOptions = ChatOptions()) -> str:
        return self.chat.render(messages, options)

    def apply_chat_template(self, messages: list[dict[str, str]] | tuple[ChatMessage, ...],
                            options: ChatOptions = ChatOptions()) -> list[int]:
        """Rendered with the chat template, then tokenized without added special tokens (the template has them),
        as transformers' apply_chat_template(tokenize=True) does."""
        chat = tuple(m if isinstance(m, ChatMessage) else ChatMessage(m["role"], m["content"]) for m in messages)
        return self.encode(self.chat.render(chat, options), add_special_tokens=False)


@dataclass(slots=True)
class DetokState(SeqFeature):
    """A sequence's incremental detokenizer: the token offsets its next text piece is decoded from."""

    prefix_offset: int
    read_offset: int

    def fork(self, index: int) -> DetokState:
        return DetokState(self.prefix_offset, self.read_offset)


def start_detok(num_prompt_tokens: int) -> DetokState:
    return DetokState(max(num_prompt_tokens - _CONTEXT_TOKENS, 0), num_prompt_tokens)


def detokenize_step(tokenizer: Tokenizer, token_ids: list[int], state: DetokState,
                    skip_special_tokens: bool = True) -> str:
    """Text added by the tokens after `state.read_offset`; empty while a UTF-8 character is incomplete."""
    prefix = tokenizer.decode(token_ids[state.prefix_offset : state.read_offset], skip_special_tokens)
    full = tokenizer.decode(token_ids[state.prefix_offset :], skip_special_tokens)
    if len(full) > len(prefix) and not full.endswith("\ufffd"):
        state.prefix_offset = state.read_offset
        state.read_offset = len(token_ids)
        return full[len(prefix) :]
    return ""
