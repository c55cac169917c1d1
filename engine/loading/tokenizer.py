"""The model's tokenizer plus an incremental detokenizer that never emits half a UTF-8 character."""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedserve.engine.core.seq_features import SeqFeature
from pagedserve.engine.errors import ModelLoadError
from pagedserve.engine.loading.chat_template import ChatMessage, ChatOptions, ChatTemplate

# Decoding restarts a few tokens back so merges that depend on the left context (spaces, byte pairs) come out right.
_CONTEXT_TOKENS = 5


class Tokenizer:
    def __init__(self, folder: Path, vocab_size: int, chat_template: str | None = None, name: str | None = None):
        """folder: HF tokenizer files (a model folder, --tokenizer, or a GGUF's exported vocabulary);
        chat_template: replaces the model's own template (the text of `--chat-template FILE`)."""
        try:
            self.hf = _hf_tokenizer(folder)
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


# Files no tokenizer is read from; whatever else sits beside the tokenizer (configs, vocabularies, templates) is in
# its fingerprint, so two folders with the same such files get the same tokenizer.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".onnx")
_HASHED_BYTES = 64 << 20  # a larger file counts by name, size and modification time instead of its bytes


def _fingerprint(folder: Path) -> str | None:
    """A digest of the folder's files a tokenizer may be built from; None when the folder cannot be read."""
    digest = hashlib.sha256()
    try:
        for file in sorted(f for f in folder.iterdir() if f.is_file() and not f.name.endswith(_WEIGHT_SUFFIXES)):
            stat = file.stat()
            digest.update(f"{file.name}\0{stat.st_size}\0".encode())
            digest.update(file.read_bytes() if stat.st_size <= _HASHED_BYTES else str(stat.st_mtime_ns).encode())
    except OSError:
        return None
    return digest.hexdigest()


# transformers parses tokenizer.json several times per load and converts it for the model's tokenizer class: 0.5 s
# for the default model, 7 s for Gemma 3's 262k vocabulary. Another engine over the same files in one process (LLM
# objects made one after another, a sweep, the test suite) reuses the parsed tokenizer, as vLLM's cached_get_tokenizer
# does. Sharing is safe because nothing here changes it (no truncation, padding or added tokens are set on it).
# Failures are not kept. Bounded, so a process cycling through many models keeps only the latest few.
_PARSED: OrderedDict[str, Any] = OrderedDict()  # fingerprint -> transformers' tokenizer, least recently used first
_PARSED_LOCK = threading.Lock()  # engines may be built on several threads; the parse itself runs outside it
_KEEP_PARSED = 4


def _hf_tokenizer(folder: Path) -> Any:
    from transformers import AutoTokenizer

    fingerprint = _fingerprint(folder)
    with _PARSED_LOCK:
        parsed = _PARSED.pop(fingerprint, None) if fingerprint is not None else None
    if parsed is None:
        parsed = AutoTokenizer.from_pretrained(str(folder))  # an unreadable folder: transformers' error names it
    if fingerprint is not None:
        with _PARSED_LOCK:
            _PARSED[fingerprint] = parsed
            while len(_PARSED) > _KEEP_PARSED:
                _PARSED.popitem(last=False)
    return parsed


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
