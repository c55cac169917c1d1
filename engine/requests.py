"""What a front end asks the engine for, in no transport's terms (`GenerationRequest`, `EmbeddingRequest` and their
prompts), and what admission makes of it (`AdmittedRequest`, which only `Admission.admit` builds and which the
engine runs as it is)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedserve.engine.core.sequence import Sequence, SequenceMetrics
from pagedserve.engine.loading.chat_template import ChatMessage, ChatOptions
from pagedserve.engine.loading.tokenizer import start_detok
from pagedserve.engine.pooling import PoolingParams, PoolingPlan
from pagedserve.engine.reasoning import ThoughtMarker
from pagedserve.engine.runner.seeded_sampling import SeededSampling
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.engine.structured_output.backend import CompiledConstraint, GrammarState
from pagedserve.engine.thought_budget import ThoughtBudget

if TYPE_CHECKING:
    from pagedserve.engine.lora.weights import LoraWeights

TRUNCATE_TO_CONTEXT = -1  # truncate_prompt_tokens: keep as many of the last tokens as the context allows


@dataclass(frozen=True, slots=True)
class TextPrompt:
    text: str
    add_special_tokens: bool = True


@dataclass(frozen=True, slots=True)
class TokensPrompt:
    token_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    messages: tuple[ChatMessage, ...]
    options: ChatOptions = ChatOptions()
    add_special_tokens: bool = False  # the template writes the special tokens itself


Prompt = TextPrompt | TokensPrompt | ChatPrompt


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """What a client asks for, in no transport's terms. `params.max_tokens` None means "until the context is full";
    `max_tokens_is_default` says it is the front end's default, not the client's, so it shrinks to the room the
    prompt leaves instead of being refused."""

    prompt: Prompt
    params: SamplingParams
    max_tokens_is_default: bool = False
    truncate_prompt_tokens: int | None = None  # keep only the last N prompt tokens (TRUNCATE_TO_CONTEXT: fit)
    adapter: str | None = None  # a LoRA adapter's name (engine/lora/); None: the base model
    # vLLM's cache_salt: only requests with the same salt share prefix-cache blocks (tenants cannot probe each
    # other's prompts by timing); None shares with every other request without one
    cache_salt: str | None = None
    # The constraint applies from the first token even behind a reasoning parser: the client's grammar already
    # leads with the thought (the router protocol's grammar_from_first_token)
    grammar_from_first_token: bool = False
    priority: int = 0  # lower goes first under --scheduling-policy priority; refused otherwise unless 0 (as vLLM)


@dataclass(frozen=True, slots=True)
class EmbeddingRequest:
    """An embedding of one prompt, for a server whose model runs the pooling runner (`engine/pooling.py`)."""

    prompt: Prompt
    pooling: PoolingParams = PoolingParams()
    truncate_prompt_tokens: int | None = None  # as GenerationRequest's (TRUNCATE_TO_CONTEXT: the whole context)
    adapter: str | None = None
    cache_salt: str | None = None
    priority: int = 0


@dataclass(frozen=True, slots=True)
class AdmittedRequest:
    """A request that passed every check; only `Admission.admit` makes one. `params.max_tokens` is set and fits."""

    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    truncated: bool  # truncate_prompt_tokens cut the prompt
    constraint: CompiledConstraint | None = None  # params.constraint, compiled for the engine's tokenizer
    adapter: LoraWeights | None = None  # the LoRA adapter's weights, held until the request ends; None: the base
    cache_salt: int | None = None  # GenerationRequest.cache_salt as a 64-bit key (salt_key)
    # With a reasoning parser (None without): the prompt closed the thought, so the output starts as content
    thought_closed: bool | None = None
    grammar_waits_for: ThoughtMarker | None = None  # the constraint applies once the output closes the thought
    budget: ThoughtBudget | None = None  # params.thinking_token_budget's starting state (None: no budget)
    priority: int = 0
    pooling: PoolingPlan | None = None  # an embedding request: pooled, never sampled (params are unused)

    def start(self, request_id: str, arrival_time: float) -> Sequence:
        """The request's first sequence, holding each feature's starting state (its forks copy them from it)."""
        ids, params = self.prompt_token_ids, self.params
        seq = Sequence(request_id, 0, list(ids), len(ids), params, SequenceMetrics(arrival_time),
                       pending_forks=params.n - 1, adapter=None if self.adapter is None else self.adapter.info,
                       cache_salt=self.cache_salt, priority=self.priority)
        seq.features.attach(start_detok(len(ids)))
        if params.seed is not None:
            seq.features.attach(SeededSampling.start(params.seed))
        if self.constraint is not None:
            seq.features.attach(GrammarState(self.constraint.new_matcher(), self.grammar_waits_for))
        if self.adapter is not None:
            seq.features.attach(self.adapter)
        if self.budget is not None:
            seq.features.attach(self.budget.fork(0))
        if self.pooling is not None:
            seq.features.attach(self.pooling.start())
        return seq
