"""The offline API vLLM users know: LLM(model).generate(prompts, SamplingParams(...)); with LoRA adapters,
LLM(model, enable_lora=True).generate(..., lora_request=LoRARequest(name, 1, path)) as in vLLM, or
LLM(model, lora=LoraConfig(modules=(LoraModule(name, path), ...), max_loras=...)).generate(..., adapter=name)."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence as SequenceABC
from typing import Any

from pagedserve.engine.chat_messages import parse_messages
from pagedserve.engine.config import EngineConfig
from pagedserve.engine.errors import ConfigError
from pagedserve.engine.host.allocator import release_freed_memory
from pagedserve.engine.host.tuning import tune_host
from pagedserve.engine.llm_args import engine_fields
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.engine.loading.chat_template import ChatOptions
from pagedserve.engine.lora.config import AdapterInfo, LoraModule
from pagedserve.engine.lora.request import LoRARequest, LoraRequests
from pagedserve.engine.outputs import RequestOutput
from pagedserve.engine.pooling import PoolingParams
from pagedserve.engine.requests import ChatPrompt
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.engine.scoring import ScorePairs, check_token_limit


class LLM:
    def __init__(self, model: str | None = None, **config_fields):
        config = EngineConfig(model=model, **engine_fields(config_fields))  # vLLM's arguments too (llm_args.py)
        # The offline entry: it tunes the host itself, before the engine is built (the engine core never does).
        self.engine = LLMEngine(config, governor=tune_host(config))
        release_freed_memory()  # what loading freed, kept by the allocator's thresholds otherwise
        self._ids = itertools.count()
        self._lora_requests = LoraRequests()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def load_adapter(self, name: str, path: str) -> AdapterInfo:
        return self.engine.load_adapter(LoraModule(name, path))

    def unload_adapter(self, name: str) -> None:
        self.engine.unload_adapter(name)

    def adapters(self) -> tuple[AdapterInfo, ...]:
        return self.engine.adapters()

    def generate(
        self,
        prompts: str | list[int] | SequenceABC[str | list[int] | ChatPrompt],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        adapter: str | SequenceABC[str | None] | None = None,
        lora_request: LoRARequest | SequenceABC[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Runs every prompt to completion in one continuously batched engine; outputs in prompt order. `adapter`:
        one loaded LoRA adapter's name for every prompt, or one name (None: the base) per prompt; or vLLM's
        `lora_request`, one or one per prompt, whose adapter loads on first use."""
        prompts = _prompt_list(prompts)
        params = sampling_params or SamplingParams()
        params_list = list(params) if isinstance(params, SequenceABC) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params_list)} sampling params")
        if lora_request is not None:
            if adapter is not None:
                raise ConfigError("lora_request", "give adapter names or LoRA requests, not both")
            adapter = self._lora_adapters(lora_request, len(prompts))
        adapters = [adapter] * len(prompts) if adapter is None or isinstance(adapter, str) else list(adapter)
        if len(adapters) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(adapters)} adapters")
        return self._run([functools.partial(self.engine.add_request, prompt=prompt, params=p, adapter=name)
                          for prompt, p, name in zip(prompts, params_list, adapters)])

    def chat(
        self,
        messages: SequenceABC[dict[str, Any]] | SequenceABC[SequenceABC[dict[str, Any]]],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        lora_request: LoRARequest | SequenceABC[LoRARequest | None] | None = None,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: SequenceABC[dict[str, Any]] | None = None,
        documents: SequenceABC[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        adapter: str | SequenceABC[str | None] | None = None,
    ) -> list[RequestOutput]:
        """vLLM's LLM.chat: one conversation (OpenAI-format messages) or a list of them, each rendered by the model's
        chat template (or `chat_template`, jinja text) and generated as `generate` does; outputs in order."""
        one = not messages or isinstance(messages[0], dict)  # empty: refused as an empty conversation
        conversations = [messages] if one else list(messages)
        options = ChatOptions(template=chat_template, add_generation_prompt=add_generation_prompt,
                              continue_final_message=continue_final_message,
                              tools=None if tools is None else tuple(tools),
                              documents=None if documents is None else tuple(documents),
                              kwargs=tuple((chat_template_kwargs or {}).items()))
        prompts = [ChatPrompt(parse_messages(list(conversation)), options) for conversation in conversations]
        return self.generate(prompts, sampling_params, adapter, lora_request)

    def _lora_adapters(self, lora_request: LoRARequest | SequenceABC[LoRARequest | None],
                       count: int) -> list[str | None]:
        """vLLM's lora_request: each adapter loaded (the same name and folder again: a no-op), its name per prompt."""
        requests = [lora_request] * count if isinstance(lora_request, LoRARequest) else list(lora_request)
        names = self._lora_requests.names(requests)
        for request in dict.fromkeys(r for r in requests if r is not None):
            self.engine.load_adapter(request.module)
        return names

    def embed(self, prompts: str | list[int] | SequenceABC[str | list[int]],
              pooling_params: PoolingParams | None = None) -> list[RequestOutput]:
        """Embeddings (an engine built with runner="pooling", or a sentence-transformers folder): each output's
        `embedding`, in prompt order."""
        return self._run([functools.partial(self.engine.add_embedding_request, prompt=prompt,
                                            pooling=pooling_params or PoolingParams())
                          for prompt in _prompt_list(prompts)])

    def score(self, queries: str | SequenceABC[str], documents: str | SequenceABC[str], *,
              max_tokens_per_query: int = 0, max_tokens_per_doc: int = 0) -> list[float]:
        """vLLM's `LLM.score` on an embedding model: each document's cosine similarity to its query (1:1, 1:N or
        N:N), each text first cut to its side's token limit (0: uncut)."""
        pairs = ScorePairs.of(queries, documents).truncated(
            self.tokenizer, check_token_limit(max_tokens_per_query, "max_tokens_per_query", None),
            check_token_limit(max_tokens_per_doc, "max_tokens_per_doc", None))
        return pairs.scores([out.embedding for out in self.embed(list(pairs.texts))])

    def _run(self, adds: list[Callable[[str], None]]) -> list[RequestOutput]:
        """Adds each request under a fresh id and steps until all are done. Whatever stops the call (a request
        refused partway through the list, an exception out of a step, Ctrl-C) aborts the requests it added, as vLLM's
        LLM does, so none is left holding KV blocks or running into the next call."""
        order: list[str] = []
        finished: dict[str, RequestOutput] = {}
        try:
            for add in adds:
                request_id = f"llm-{next(self._ids)}"
                add(request_id)
                order.append(request_id)
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        finished[out.request_id] = out
        except BaseException:
            for request_id in order:
                self.engine.abort_request(request_id)
            raise
        return [finished[r] for r in order]


def _prompt_list(prompts: str | list[int] | SequenceABC[str | list[int]]) -> SequenceABC[str | list[int]]:
    """One prompt (a text or a token-id list), or a list of them, as a list."""
    return [prompts] if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)) else prompts
