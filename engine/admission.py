"""One request, checked once: a prompt (text, token ids or chat messages), SamplingParams and limits become an
`AdmittedRequest` (engine/requests.py) that the engine runs as it is.

Every front end (the offline `LLM`, pagedserve.v1, OpenAI HTTP, the router's vllm.grpc.engine) maps its own fields
onto a `GenerationRequest` and renames the fields of the errors back to its own (`errors.renamed`); nothing downstream
checks again. Checks run in one order for all of them: the request's own values (SamplingParams, built by the
front end), then the prompt against the model (tokenize or render, vocabulary, truncation, context), then the
output budget (max_tokens against the context and the whole KV cache), then the constraint, compiled last (the
dearest check) for the model's tokenizer: the engine's step loop never compiles.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from pagedserve.engine.constraint import OutputConstraint
from pagedserve.engine.errors import (
    AdapterNotFoundError, CapacityError, InvalidRequestError, PagedServeError, UnsupportedTaskError,
)
from pagedserve.engine.loading.chat_template import ChatMessage, ChatOptions, check_messages
from pagedserve.engine.pooling import PoolerConfig
from pagedserve.engine.reasoning import ReasoningFormat, ThoughtMarker
from pagedserve.engine.requests import (
    TRUNCATE_TO_CONTEXT, AdmittedRequest, ChatPrompt, EmbeddingRequest, GenerationRequest, Prompt, TextPrompt,
)
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.engine.structured_output.backend import CompiledConstraint
from pagedserve.engine.thought_budget import ThoughtBudget

if TYPE_CHECKING:
    from pagedserve.engine.lora.weights import LoraWeights

# Field names in this module's errors; front ends rename them (`errors.renamed`) to the paths their clients set.
TEXT_FIELD, TOKENS_FIELD, CHAT_FIELD = "prompt", "prompt_token_ids", "chat"


@dataclass(frozen=True, slots=True)
class ModelLimits:
    vocab_size: int
    max_model_len: int
    kv_cache_tokens: int  # the whole KV cache: one request's prompt + output must fit in it
    hidden_size: int = 0  # the width of an embedding before any Matryoshka cut


class PromptEncoder(Protocol):
    """What admission needs of the tokenizer; `engine.tokenizer.Tokenizer` is one."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def render_chat(self, messages: tuple[ChatMessage, ...], options: ChatOptions) -> str: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class ConstraintCompiler(Protocol):
    """What admission needs to compile a constraint; `structured_output.compiler.ConstraintCompiler` is one."""

    def compile(self, constraint: OutputConstraint) -> CompiledConstraint: ...


class AdapterResolver(Protocol):
    """What admission needs of the adapters; `lora.manager.AdapterManager` is one (thread-safe)."""

    def resolve(self, name: str | None) -> LoraWeights | None: ...


class Admission:
    """Thread-safe: it reads the tokenizer and fixed limits only (the constraint compiler locks its own cache, the
    adapter manager its registry), so front ends admit on their own threads. Without a compiler, constrained requests
    are refused by name; without adapters, a request naming one is refused (`AdapterNotFoundError`). With a
    reasoning format, each request is told whether its prompt closed the thought, and a constraint waits for the
    output to close it otherwise (engine/reasoning.py)."""

    def __init__(self, limits: ModelLimits, encoder: PromptEncoder, compiler: ConstraintCompiler | None = None,
                 adapters: AdapterResolver | None = None, reasoning: ReasoningFormat | None = None,
                 priority_scheduling: bool = False, constraints_in_reasoning: bool = False,
                 pooler: PoolerConfig | None = None):
        self.limits, self.encoder, self.compiler, self.adapters = limits, encoder, compiler, adapters
        self.pooler = pooler  # the pooling runner's rule: the engine embeds and does not generate; None: generates
        self.reasoning, self.priority_scheduling = reasoning, priority_scheduling
        self.constraints_in_reasoning = constraints_in_reasoning
        if reasoning is not None:
            self.thought_start, self.thought_end = self._marker(reasoning.start), self._marker(reasoning.end)

    def admit(self, request: GenerationRequest | EmbeddingRequest) -> AdmittedRequest:
        if isinstance(request, EmbeddingRequest):
            return self._admit_embedding(request)
        if self.pooler is not None:
            raise UnsupportedTaskError("this server runs an embedding model (--runner pooling): it answers embeddings, "
                                       "not generations")
        self._check_priority(request.priority)
        adapter = self._adapter(request.adapter)
        ids, field, text = self._prompt_ids(request.prompt)
        ids, truncated = self._truncate(ids, request.truncate_prompt_tokens)
        context = self.limits.max_model_len
        if len(ids) >= context:
            raise InvalidRequestError(field, f"the prompt is {len(ids)} tokens; the model's context is {context} "
                                      "tokens and at least one must be left to generate")
        params = self._fit(request, len(ids))
        if params.bad_words:
            params = params.with_bad_words_ids(self._bad_words_ids(params.bad_words))
        params.check_vocab(self.limits.vocab_size)
        constraint = self._compile(params.constraint)
        # Token ids are decoded to be read only when something here depends on the thought (a chat front end, which
        # splits the answer, always has the text)
        wanted = text is not None or constraint is not None or params.thinking_token_budget is not None
        turn = self._current_turn(request.prompt, text, ids) if self.reasoning is not None and wanted else None
        closed = None if turn is None else self.reasoning.closed_in(turn)
        waits_for = self.thought_end if constraint is not None and closed is False \
            and not (request.grammar_from_first_token or self.constraints_in_reasoning) else None
        return AdmittedRequest(tuple(ids), params, truncated, constraint, adapter, salt_key(request.cache_salt),
                               thought_closed=closed, grammar_waits_for=waits_for,
                               budget=self._budget(params.thinking_token_budget, turn, closed),
                               priority=request.priority)

    def _admit_embedding(self, request: EmbeddingRequest) -> AdmittedRequest:
        """The prompt's checks as for a generation, except that it needs no room to generate in."""
        if self.pooler is None:
            raise UnsupportedTaskError("this server runs a generation model: start it with --runner pooling to serve "
                                       "embeddings")
        pooling = self.pooler.resolve(request.pooling, self.limits.hidden_size)
        self._check_priority(request.priority)
        adapter = self._adapter(request.adapter)
        ids, field, _ = self._prompt_ids(request.prompt)
        ids, truncated = self._truncate(ids, request.truncate_prompt_tokens, room=0)
        context = self.limits.max_model_len
        if len(ids) > context:
            raise InvalidRequestError(field, f"the prompt is {len(ids)} tokens; the model's context is {context} "
                                      "tokens")
        if len(ids) > self.limits.kv_cache_tokens:
            raise CapacityError(field, f"the prompt is {len(ids)} tokens, more than the whole KV cache "
                                f"({self.limits.kv_cache_tokens} tokens)")
        return AdmittedRequest(tuple(ids), SamplingParams(max_tokens=1), truncated, adapter=adapter,
                               cache_salt=salt_key(request.cache_salt), priority=request.priority,
                               pooling=pooling)

    def _check_priority(self, priority: object) -> None:
        if not isinstance(priority, int) or isinstance(priority, bool) or not -2**63 <= priority < 2**63:
            raise InvalidRequestError("priority", f"must be a 64-bit integer, got {priority!r}")
        if priority and not self.priority_scheduling:
            raise InvalidRequestError("priority", f"got {priority}, but this server schedules first come, first "
                                      "served (--scheduling-policy priority takes priorities, as in vLLM)")

    def _adapter(self, name: str | None) -> LoraWeights | None:
        if name is None:
            return None
        if not isinstance(name, str):
            raise InvalidRequestError("adapter", f"must be an adapter's name (a string), got {type(name).__name__}")
        if self.adapters is None:
            raise AdapterNotFoundError("adapter", f"no adapter named {name!r}: LoRA adapters are off on this engine")
        return self.adapters.resolve(name)

    def _compile(self, constraint: OutputConstraint | None) -> CompiledConstraint | None:
        if constraint is None:
            return None
        if self.compiler is None:
            raise InvalidRequestError(constraint.field, "structured outputs are not available on this engine")
        return self.compiler.compile(constraint)

    def _prompt_ids(self, prompt: Prompt) -> tuple[list[int], str, str | None]:
        """(token ids, the field errors name, the prompt's text: None for token ids)."""
        text = None
        if isinstance(prompt, TextPrompt):
            if not isinstance(prompt.text, str):
                raise InvalidRequestError(TEXT_FIELD, f"must be a string, got {type(prompt.text).__name__}")
            ids = self.encoder.encode(prompt.text, prompt.add_special_tokens) if prompt.text else []
            field, text = TEXT_FIELD, prompt.text
        elif isinstance(prompt, ChatPrompt):
            messages = check_messages(prompt.messages, "messages")
            text = self.encoder.render_chat(messages, prompt.options)
            ids, field = self.encoder.encode(text, prompt.add_special_tokens), CHAT_FIELD
        else:
            ids, field = list(prompt.token_ids), TOKENS_FIELD
            self._check_ids(ids)
        if not ids:
            raise InvalidRequestError(field, "the prompt is empty")
        return ids, field, text

    def _current_turn(self, prompt: Prompt, text: str | None, ids: list[int]) -> str:
        """The prompt text whose thought markers count: the turn being answered only, so a thought closed in an
        earlier turn or a few-shot example does not (vLLM reads the whole prompt and is fooled by them). A chat's
        turn is what its rendering adds to the rendering of the conversation before it; a plain prompt is read whole."""
        if text is None:
            return self.encoder.decode(ids, skip_special_tokens=False)
        before = self._before_turn(prompt) if isinstance(prompt, ChatPrompt) else None
        return text[len(before):] if before is not None and text.startswith(before) else text

    def _before_turn(self, prompt: ChatPrompt) -> str | None:
        """The conversation rendered up to the turn being answered: without the generation prompt, or without the
        message the answer continues (None: no such rendering, e.g. a template that refuses the shorter list)."""
        options = prompt.options
        if options.continue_final_message:
            messages = prompt.messages[:-1]
            options = dataclasses.replace(options, continue_final_message=False, add_generation_prompt=True)
        elif options.add_generation_prompt:
            messages, options = prompt.messages, dataclasses.replace(options, add_generation_prompt=False)
        else:
            return None
        try:
            return self.encoder.render_chat(messages, options) if messages else ""
        except PagedServeError:
            return None

    def _budget(self, budget: int | None, turn: str | None, closed: bool | None) -> ThoughtBudget | None:
        if budget is None:
            return None
        if self.reasoning is None:
            raise InvalidRequestError("thinking_token_budget", "needs a server started with --reasoning-parser (the "
                                      "model's thought markers)")
        if closed:
            return None  # the prompt closed the thought: nothing to count
        return ThoughtBudget(budget, self.thought_start, self.thought_end, self.reasoning.opened_in(turn))

    def _marker(self, text: str) -> ThoughtMarker:
        """A marker with its tokens (one, where the tokenizer holds it as a token of its own)."""
        return ThoughtMarker(text, tuple(self.encoder.encode(text, False)))

    def _bad_words_ids(self, words: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
        """Each word as the model writes it alone and after a space (vLLM's two spellings), each once."""
        found: list[tuple[int, ...]] = []
        for word in words:
            for spelling in (word.lstrip(), " " + word.lstrip()):
                ids = tuple(self.encoder.encode(spelling, False))
                if ids and ids not in found:
                    found.append(ids)
        return tuple(found)

    def _check_ids(self, ids: list[int]) -> None:
        vocab = self.limits.vocab_size
        for i, token in enumerate(ids):
            if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < vocab:
                raise InvalidRequestError(f"{TOKENS_FIELD}[{i}]",
                                          f"token id {token} is outside the vocabulary (size {vocab})")

    def _truncate(self, ids: list[int], keep: int | None, room: int = 1) -> tuple[list[int], bool]:
        """room: the positions TRUNCATE_TO_CONTEXT leaves free (one to generate; none for an embedding)."""
        if keep is None:
            return ids, False
        if keep == TRUNCATE_TO_CONTEXT:
            keep = self.limits.max_model_len - room
        if keep < 1:
            raise InvalidRequestError("truncate_prompt_tokens",
                                      f"must be >= 1 (or {TRUNCATE_TO_CONTEXT}: as many as fit), got {keep}")
        return ids[-keep:], len(ids) > keep

    def _fit(self, request: GenerationRequest, prompt_len: int) -> SamplingParams:
        """An unset or default max_tokens shrinks to the room the prompt leaves; a client's must fit."""
        params, context = request.params, self.limits.max_model_len
        room = context - prompt_len
        wanted = params.max_tokens
        if wanted is None or (request.max_tokens_is_default and wanted > room):
            params = params.with_max_tokens(room)
        elif wanted > room:
            raise InvalidRequestError("max_tokens", f"{wanted} new tokens after a {prompt_len}-token prompt exceed "
                                      f"the model's context of {context} tokens (at most {room})")
        total = prompt_len + params.max_tokens
        if total > self.limits.kv_cache_tokens:
            raise CapacityError("max_tokens", f"prompt + max_tokens = {total} tokens needs more than the whole KV "
                                f"cache ({self.limits.kv_cache_tokens} tokens)")
        return params


_MAX_SALT_CHARS = 1024


def salt_key(salt: object) -> int | None:
    """A cache salt as the 64-bit key the prefix cache chains from: a digest, not hash(), whose value for a str
    changes with every process (KV events carry these keys to routers)."""
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt or len(salt) > _MAX_SALT_CHARS:
        got = f"{len(salt)} characters" if isinstance(salt, str) else type(salt).__name__  # never the salt itself
        raise InvalidRequestError("cache_salt", f"must be a non-empty string of at most {_MAX_SALT_CHARS} "
                                  f"characters, got {got}")
    return int.from_bytes(hashlib.blake2b(salt.encode(), digest_size=8).digest(), "little")
