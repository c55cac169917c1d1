"""The synchronous engine: add requests, step, read outputs. One step = schedule -> execute -> update -> outputs."""

from __future__ import annotations

import dataclasses
import logging
from typing import Protocol

from pagedserve.engine.admission import TOKENS_FIELD
from pagedserve.engine.build import EngineParts, build_engine
from pagedserve.engine.config import EngineConfig
from pagedserve.engine.core.lookahead import schedule_ahead
from pagedserve.engine.core.request_outputs import RequestState, engine_stats, request_output
from pagedserve.engine.core.scheduler_output import StepUpdate
from pagedserve.engine.core.sequence import FinishReason, now
from pagedserve.engine.errors import AdapterLoadError, AdapterNotFoundError, InvalidRequestError, renamed
from pagedserve.engine.lora.config import AdapterInfo, LoraModule
from pagedserve.engine.lora.manager import require
from pagedserve.engine.lora.weights import LoraWeights
from pagedserve.engine.outputs import EngineStats, ModelDescription, RequestOutput
from pagedserve.engine.pooling import PoolingParams
from pagedserve.engine.requests import (
    AdmittedRequest, ChatPrompt, EmbeddingRequest, GenerationRequest, TextPrompt, TokensPrompt,
)
from pagedserve.engine.runner.launched_step import LaunchedStep
from pagedserve.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class StepGovernor(Protocol):
    """Runs around every step on the computing thread (`engine/host/thread_governor.py`'s `ThreadGovernor`)."""

    def tick(self) -> None: ...

    def step_done(self) -> None: ...


class LLMEngine:
    """governor: what the entry's host tuning returned (`engine/host/tuning.py: tune_host`), ticked every step; the
    engine itself sets up nothing on the host. parts: an engine already built (default: `build_engine(config)`)."""

    def __init__(self, config: EngineConfig, governor: StepGovernor | None = None, parts: EngineParts | None = None):
        parts = parts or build_engine(config)
        self.config, self.thread_governor, self.source, self.loaded = config, governor, parts.source, parts.loaded
        self.tokenizer, self.runner, self.block_manager = parts.tokenizer, parts.runner, parts.block_manager
        self.scheduler, self.constraints, self.admission = parts.scheduler, parts.constraints, parts.admission
        self.lora_manager, self.description = parts.adapters, parts.description
        self.max_model_len = self.runner.max_model_len
        self.requests: dict[str, RequestState] = {}
        self.num_aborted_requests = 0
        self.inflight: LaunchedStep | None = None  # async scheduling: the step launched ahead, tokens not yet read
        self.num_lookahead_steps = 0  # steps launched ahead of the previous one's tokens
        if config.async_scheduling and self.runner.device.type == "cpu":
            logger.warning("async scheduling on CPU: the forward runs when launched, so nothing overlaps and each "
                           "decode token reaches its stream one step later; it is meant for CUDA")

    # -- admission ------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int] | ChatPrompt, params: SamplingParams,
                    arrival_time: float | None = None, adapter: str | None = None,
                    cache_salt: str | None = None) -> None:
        """The offline front end's request: admitted here, then queued. Its id must not be running (the served
        front ends' ids are checked once, by AsyncEngine, which submits each under a key of its own)."""
        self._submit_new(request_id, self.admit_prompt(prompt, params, adapter, cache_salt), arrival_time)

    def add_embedding_request(self, request_id: str, prompt: str | list[int],
                              pooling: PoolingParams = PoolingParams(), arrival_time: float | None = None) -> None:
        """The offline front end's embedding request (a pooling engine's: `EngineConfig.runner`)."""
        with renamed(_offline_field):
            admitted = self.admission.admit(EmbeddingRequest(_offline_prompt(prompt), pooling))
        self._submit_new(request_id, admitted, arrival_time)

    def _submit_new(self, request_id: str, admitted: AdmittedRequest, arrival_time: float | None) -> None:
        if request_id in self.requests:
            raise InvalidRequestError("request_id", f"{request_id!r} is already running")
        self.submit(request_id, admitted, arrival_time)

    def admit_prompt(self, prompt: str | list[int] | ChatPrompt, params: SamplingParams, adapter: str | None = None,
                     cache_salt: str | None = None) -> AdmittedRequest:
        """A text or token-id prompt with SamplingParams (and a LoRA adapter's name), checked once; errors name
        SamplingParams' fields."""
        with renamed(_offline_field):
            return self.admission.admit(GenerationRequest(_offline_prompt(prompt), params, adapter=adapter,
                                                          cache_salt=cache_salt,
                                                          truncate_prompt_tokens=params.truncate_prompt_tokens))

    def submit(self, request_id: str, request: AdmittedRequest, arrival_time: float | None = None) -> None:
        """Queues an admitted request as it is (no check is repeated: its id is new, see add_request)."""
        seq = request.start(request_id, arrival_time or now())
        self.requests[request_id] = RequestState(request_id, request.prompt_token_ids, request.params, [seq])
        self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stops the request now and frees its blocks; returns its final output (None if unknown)."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return None
        self.num_aborted_requests += 1
        return self._end(state, FinishReason.ABORT)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # -- LoRA adapters (the lifecycle is the adapter manager's) -------------------------------------
    def load_adapter(self, module: LoraModule) -> AdapterInfo:
        """Reads, validates and registers a PEFT folder (the same name and folder again: a no-op)."""
        return self.register_adapter(self.read_adapter(module))

    def read_adapter(self, module: LoraModule) -> LoraWeights | AdapterInfo:
        """The disk half of load_adapter (any thread)."""
        return require(self.lora_manager, "lora_name", AdapterLoadError).read_allowed(module)

    def register_adapter(self, read: LoraWeights | AdapterInfo) -> AdapterInfo:
        """The registry half of load_adapter (the step loop's thread, between steps)."""
        return require(self.lora_manager, "lora_name", AdapterLoadError).register(read)

    def unload_adapter(self, name: str) -> None:
        """Refused while a request using it is unfinished (AdapterInUseError)."""
        users = sum(state.seqs[0].adapter_name == name for state in self.requests.values())
        require(self.lora_manager, "lora_name", AdapterNotFoundError).unload(name, users)

    def adapters(self) -> tuple[AdapterInfo, ...]:
        return () if self.lora_manager is None else self.lora_manager.infos()

    # -- the step loop --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if self.thread_governor is None:
            return self._step()
        self.thread_governor.tick()  # here: torch's thread count is per calling thread, and this one computes
        try:
            return self._step()
        finally:
            self.thread_governor.step_done()

    def _step(self) -> list[RequestOutput]:
        if self.config.async_scheduling:
            return self._step_ahead()
        batch = self.scheduler.schedule()
        if batch.is_empty:
            return []
        return self._outputs(self.scheduler.update(batch, self.runner.execute(batch)))

    def _step_ahead(self) -> list[RequestOutput]:
        """Async scheduling: the next step is launched (`schedule_ahead`) before this one's tokens are read, so the
        device computes it while the host applies them; this call's outputs are the step launched before."""
        current, self.inflight = self.inflight, None
        if current is None:
            batch = self.scheduler.schedule()
            if batch.is_empty:
                return []
            current = self.runner.launch(batch)
        ahead = schedule_ahead(self.scheduler, current.batch, self.runner.sampler.picks_on_device) \
            if current.on_device else None
        if ahead is not None:
            self.inflight = self.runner.launch(ahead, current)
            self.num_lookahead_steps += 1
        update = self.scheduler.update(current.batch, self.runner.collect(current), committed=ahead is not None)
        return self._outputs(update)

    def _outputs(self, update: StepUpdate) -> list[RequestOutput]:
        for child in update.forked:
            self.requests[child.request_id].seqs.append(child)
        outputs = [self._fail(rid, update.failed[rid]) if rid in update.failed else request_output(self.requests[rid])
                   for rid in update.touched]
        for out in outputs:
            if out.finished:
                del self.requests[out.request_id]
        return outputs

    def _fail(self, request_id: str, error: str) -> RequestOutput:
        """Ends every sequence of one request with ERROR and frees its blocks; the rest of the batch goes on."""
        logger.warning("request %s failed: %s", request_id, error)
        return dataclasses.replace(self._end(self.requests[request_id], FinishReason.ERROR), error=error)

    def _end(self, state: RequestState, reason: FinishReason) -> RequestOutput:
        """Ends every sequence of the request (samples not forked yet included: its output lists all n)."""
        taken = {seq.index for seq in state.seqs}  # a step that failed while forking may have forked some already
        for seq in list(state.seqs):
            state.seqs.extend(child for child in seq.unforked_samples(reason) if child.index not in taken)
            if not seq.is_finished:
                self.scheduler.finish(seq, reason)
        return request_output(state)

    def describe(self) -> ModelDescription:
        return self.description

    def stats(self) -> EngineStats:
        lora = self.config.lora
        return engine_stats(self.scheduler, self.runner.verifier.counters, self.constraints.stats(),
                            self.max_model_len, self.runner.kv_spec.dtype.value, 0 if lora is None else lora.max_loras,
                            self.num_aborted_requests, self.num_lookahead_steps)


def _offline_prompt(prompt: str | list[int] | ChatPrompt) -> TextPrompt | TokensPrompt | ChatPrompt:
    if isinstance(prompt, ChatPrompt):
        return prompt  # LLM.chat's: rendered by the chat template at admission
    return TextPrompt(prompt) if isinstance(prompt, str) else TokensPrompt(tuple(prompt))


def _offline_field(field: str) -> str:
    """The offline API names the prompt list, not the position in it (`prompt_token_ids`, never `[3]`)."""
    return TOKENS_FIELD if field.startswith(TOKENS_FIELD + "[") else field
