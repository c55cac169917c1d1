"""The synchronous engine: add requests, step, read outputs. One step = schedule -> run model -> sample -> emit."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Protocol

import torch

from pagedserve.engine.admission import (
    TOKENS_FIELD, AdmittedRequest, Admission, GenerationRequest, ModelLimits, TextPrompt, TokensPrompt, renamed,
)
from pagedserve.engine.block_manager import BlockManager
from pagedserve.engine.config import EngineConfig
from pagedserve.engine.errors import AdapterInUseError, AdapterLoadError, AdapterNotFoundError, InvalidRequestError
from pagedserve.engine.loading.chat_template import read_template_file
from pagedserve.engine.loading.model_loader import load_model
from pagedserve.engine.loading.model_store import resolve_model
from pagedserve.engine.loading.tokenizer import Tokenizer, start_detok
from pagedserve.engine.lora.config import AdapterInfo, LoraModule
from pagedserve.engine.lora.layers import lora_dtype
from pagedserve.engine.lora.manager import AdapterManager
from pagedserve.engine.lora.weights import LoraWeights
from pagedserve.engine.model_runner import ModelRunner
from pagedserve.engine.outputs import (
    CompletionOutput, EngineStats, ModelDescription, OutputHistory, RequestMetrics, RequestOutput,
)
from pagedserve.engine.sampler import Sampler, SampledTokens, generator_for, native_max_argmax, torch_max_argmax
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.engine.scheduler import Scheduler
from pagedserve.engine.sequence import FinishReason, Sequence, SequenceMetrics, SeqStatus, now
from pagedserve.engine.spec_decode.drafter import Drafter
from pagedserve.engine.spec_decode.verifier import Verified, Verifier
from pagedserve.engine.stopping import apply_token
from pagedserve.engine.structured_output.compiler import ConstraintCompiler
from pagedserve.engine.structured_output.registry import CONSTRAINT_BACKENDS
from pagedserve.kernels.cpu import native as cpu_native

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class RequestState:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    seqs: list[Sequence] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(s.is_finished and not s.pending_forks for s in self.seqs)


class StepGovernor(Protocol):
    """Runs around every step on the computing thread (`engine/host/thread_governor.py`'s `ThreadGovernor`)."""

    def tick(self) -> None: ...

    def step_done(self) -> None: ...


class LLMEngine:
    """governor: what the entry's host tuning returned (`engine/host/tuning.py: tune_host`), ticked every step; the
    engine itself sets up nothing on the host."""

    def __init__(self, config: EngineConfig, governor: StepGovernor | None = None):
        self.config = config
        self.device = torch.device(config.device)
        self.thread_governor = governor
        self.source = resolve_model(config.model, config.tokenizer)
        override = read_template_file(config.chat_template) if config.chat_template else None  # fail before loading
        self.loaded = load_model(self.source.weights, config.torch_dtype, config.quantization, self.device,
                                 config.gguf_weights, config.lm_head_quantization)
        self.runner = ModelRunner(self.loaded, config, self.device)
        self.tokenizer = Tokenizer(self.source.tokenizer_dir, self.runner.vocab_size, override, self.source.name)
        self.max_model_len = self.runner.max_model_len
        self.block_manager = BlockManager(
            self.runner.num_blocks, config.block_size, config.enable_prefix_caching, self.runner.kv_window
        )
        lora = config.lora
        self.lora_manager = None if lora is None else \
            AdapterManager(lora, self.runner.lora_layout, lora_dtype(self.loaded.dtype, self.device), self.device)
        native = self.runner.native_step
        drafter = None if config.speculative is None else Drafter(
            config.speculative, self.max_model_len, *((native.max_rows, native.max_batch) if native else (0, 0)))
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   None if lora is None else lora.max_loras, drafter=drafter)
        native_picks = self.device.type == "cpu" and cpu_native.available()
        self.sampler = Sampler(self.tokenizer.eos_token_ids, native_max_argmax if native_picks else torch_max_argmax)
        self.verifier = Verifier(self.sampler)
        kv_tokens = self.block_manager.num_blocks * config.block_size
        if self.block_manager.peak_blocks(self.max_model_len, config.max_num_batched_tokens) <= self.block_manager.num_blocks:
            # Every layer slides: a sequence holds only its window's blocks, so any context fits.
            kv_tokens = max(kv_tokens, self.max_model_len)
        backend = CONSTRAINT_BACKENDS.get(config.structured_output_backend)
        vocab, eos = self.runner.vocab_size, self.tokenizer.eos_token_ids
        self.constraints = ConstraintCompiler(lambda: backend(self.tokenizer.hf, vocab, eos),
                                              config.constraint_compile_timeout_s)
        self.admission = Admission(ModelLimits(self.runner.vocab_size, self.max_model_len, kv_tokens), self.tokenizer,
                                   self.constraints, self.lora_manager)
        self.requests: dict[str, RequestState] = {}
        self.num_aborted_requests = 0

    # -- admission ------------------------------------------------------------------------------------
    def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams, arrival_time: float | None = None,
        adapter: str | None = None,
    ) -> None:
        """The offline front end's request: admitted here, then queued. Its id must not be running (the served
        front ends' ids are checked once, by AsyncEngine, which submits each under a key of its own)."""
        admitted = self.admit_prompt(prompt, params, adapter)
        if request_id in self.requests:
            raise InvalidRequestError("request_id", f"{request_id!r} is already running")
        self.submit(request_id, admitted, arrival_time)

    def admit_prompt(self, prompt: str | list[int], params: SamplingParams, adapter: str | None = None) -> AdmittedRequest:
        """A text or token-id prompt with SamplingParams (and a LoRA adapter's name), checked once; errors name
        SamplingParams' fields."""
        as_prompt = TextPrompt(prompt) if isinstance(prompt, str) else TokensPrompt(tuple(prompt))
        with renamed(_offline_field):
            return self.admission.admit(GenerationRequest(as_prompt, params, adapter=adapter))

    def submit(self, request_id: str, request: AdmittedRequest, arrival_time: float | None = None) -> None:
        """Queues an admitted request as it is (no check is repeated: its id is new, see add_request)."""
        ids, params = request.prompt_token_ids, request.params
        seq = Sequence(request_id, 0, list(ids), len(ids), params, SequenceMetrics(arrival_time or now()))
        seq.pending_forks = params.n - 1
        seq.sampler_state = generator_for(params.seed, 0) if params.seed is not None else None
        seq.detok = start_detok(len(ids))
        seq.matcher = request.constraint.new_matcher() if request.constraint is not None else None
        seq.lora = request.adapter
        self.requests[request_id] = RequestState(request_id, ids, params, [seq])
        self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stops the request now and frees its blocks; returns its final output (None if unknown)."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return None
        self.num_aborted_requests += 1
        for seq in state.seqs:
            seq.pending_forks = 0
            if not seq.is_finished:
                self._finish(seq, FinishReason.ABORT)
        return self._output(state)

    def _fail(self, state: RequestState, error: str) -> RequestOutput:
        """Finishes every sequence of one request with ERROR and frees its blocks; the rest of the batch goes on."""
        logger.warning("request %s failed: %s", state.request_id, error)
        for seq in state.seqs:
            seq.pending_forks = 0
            if not seq.is_finished:
                self._finish(seq, FinishReason.ERROR)
        return dataclasses.replace(self._output(state), error=error)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # -- LoRA adapters --------------------------------------------------------------------------------
    def load_adapter(self, module: LoraModule) -> AdapterInfo:
        """Reads, validates and registers a PEFT folder (the same name and folder again: a no-op)."""
        return self.register_adapter(self.read_adapter(module))

    def read_adapter(self, module: LoraModule) -> LoraWeights | AdapterInfo:
        """The disk half of load_adapter (any thread): the folder must be allowed, readable and fit the base."""
        manager = self._lora("lora_name", AdapterLoadError)
        manager.check_allowed(module.path)
        return manager.read(module)

    def register_adapter(self, read: LoraWeights | AdapterInfo) -> AdapterInfo:
        """The registry half of load_adapter (the step loop's thread, between steps)."""
        return self._lora("lora_name", AdapterLoadError).register(read)

    def unload_adapter(self, name: str) -> None:
        """Refused while a request using it is unfinished (AdapterInUseError); running requests are never broken."""
        manager = self._lora("lora_name", AdapterNotFoundError)
        users = [rid for rid, state in self.requests.items() if state.seqs[0].adapter_name == name]
        if users and name in {info.name for info in manager.infos()}:
            raise AdapterInUseError(f"adapter {name!r} is used by {len(users)} unfinished request(s); unload it "
                                    "when they end")
        manager.unregister(name)

    def adapters(self) -> tuple[AdapterInfo, ...]:
        return () if self.lora_manager is None else self.lora_manager.infos()

    def _lora(self, field: str, error: type[InvalidRequestError]) -> AdapterManager:
        if self.lora_manager is None:
            raise error(field, "LoRA adapters are off on this engine (EngineConfig.lora is None)")
        return self.lora_manager

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
        batch = self.scheduler.schedule()
        if batch.is_empty:
            return []
        logits, seqs = self.runner.execute(batch)
        self.scheduler.commit(batch)
        touched: dict[str, RequestState] = {}
        failed: dict[str, str] = {}
        drafts = {item.seq: item.draft_tokens for item in batch.scheduled if item.draft_tokens}
        if drafts:
            logits, seqs = self._verify(logits, seqs, drafts, touched, failed)
        for sampled in self.sampler(logits, seqs) if seqs else ():
            state = self.requests[sampled.seq.request_id]
            touched[state.request_id] = state
            if sampled.error is not None:
                failed[state.request_id] = sampled.error
            elif sampled.dead_end:
                self._dead_end(state, sampled.seq)
            elif state.request_id not in failed:
                self._accept(state, sampled)
        outputs = [self._fail(state, failed[rid]) if rid in failed else self._output(state) for rid, state in touched.items()]
        for out in outputs:
            if out.finished:
                del self.requests[out.request_id]
        return outputs

    def _verify(self, logits: torch.Tensor, seqs: tuple[Sequence, ...], drafts: dict[Sequence, tuple[int, ...]],
                touched: dict[str, RequestState], failed: dict[str, str]) -> tuple[torch.Tensor, tuple[Sequence, ...]]:
        """Verifies and appends the speculating sequences' tokens; returns the other rows and sequences to sample."""
        plain_rows: list[int] = []
        plain: list[Sequence] = []
        row = 0
        for seq in seqs:
            num_rows = 1 + len(drafts.get(seq, ()))
            if num_rows == 1:
                plain_rows.append(row)
                plain.append(seq)
            else:
                state = touched[seq.request_id] = self.requests[seq.request_id]
                verified = self.verifier(logits[row : row + num_rows], seq, drafts[seq])
                if verified.error is not None:
                    failed[state.request_id] = verified.error
                else:
                    self._append_verified(verified)
            row += num_rows
        return logits[plain_rows], tuple(plain)

    def _append_verified(self, verified: Verified) -> None:
        """Token by token, as without speculation: the first token that ends the sequence ends it there. Only the
        appended drafts count as computed (their KV was written by this step), so the prefix cache and the block
        table never keep a rejected or unused draft."""
        seq, appended, done = verified.seq, 0, False
        for token, logprob in verified.tokens:
            appended += 1
            done = apply_token(seq, token, logprob, self.tokenizer, self.max_model_len)
            if done:
                break
        self.scheduler.commit_verified(seq, min(appended, verified.num_accepted))
        Drafter.observe(seq, verified.num_accepted)
        if done:
            self.scheduler.finish(seq)

    def _accept(self, state: RequestState, sampled: SampledTokens) -> None:
        seq = sampled.seq
        first, *extra = sampled.tokens
        for index, (token, logprob) in enumerate(extra, start=1):
            child = seq.fork(index)
            self.block_manager.fork(seq, child)
            child.sampler_state = generator_for(seq.params.seed, index) if seq.params.seed is not None else None
            child.detok = type(seq.detok)(seq.detok.prefix_offset, seq.detok.read_offset)
            child.matcher = seq.matcher.fork() if seq.matcher is not None else None  # before seq takes its token
            state.seqs.append(child)
            self.scheduler.add_running(child)
            self._append(child, token, logprob)
        seq.pending_forks = 0
        self._append(seq, *first)

    def _append(self, seq: Sequence, token: int, logprob) -> None:
        if seq.matcher is not None and not seq.matcher.accept(token):
            self._finish(seq, FinishReason.CONSTRAINT_DEAD_END)  # the library refused a token its own mask allowed
            return
        if apply_token(seq, token, logprob, self.tokenizer, self.max_model_len):
            self.scheduler.finish(seq)

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        seq.finish_reason, seq.metrics.finished_time = reason, now()
        self.scheduler.finish(seq)

    def _dead_end(self, state: RequestState, seq: Sequence) -> None:
        """The constraint allows no token: only this sequence ends (with its text so far) and frees its blocks; the
        samples it has not forked yet would start from the same dead end, so they end with it."""
        for index in range(1, seq.pending_forks + 1):
            child = seq.fork(index)
            child.status, child.metrics.finished_time = SeqStatus.FINISHED, now()
            child.finish_reason = FinishReason.CONSTRAINT_DEAD_END
            state.seqs.append(child)
        seq.pending_forks = 0
        self._finish(seq, FinishReason.CONSTRAINT_DEAD_END)

    def _output(self, state: RequestState) -> RequestOutput:
        completions = tuple(_completion(seq) for seq in sorted(state.seqs, key=lambda s: s.index))
        first = state.seqs[0].metrics
        metrics = RequestMetrics(
            arrival_time=first.arrival_time,
            first_scheduled_time=first.first_scheduled_time,
            first_token_time=min((s.metrics.first_token_time for s in state.seqs if s.metrics.first_token_time), default=None),
            finished_time=max((s.metrics.finished_time or 0.0 for s in state.seqs), default=None) if state.finished else None,
            num_preemptions=sum(s.metrics.num_preemptions for s in state.seqs),
            num_cached_tokens=first.num_cached_tokens,
        )
        return RequestOutput(state.request_id, state.prompt_token_ids, completions, state.finished, metrics)

    def describe(self) -> ModelDescription:
        architectures = self.loaded.hf_config.get("architectures") or [type(self.loaded.model).__name__]
        return ModelDescription(
            architecture=architectures[0],
            quantization=self.loaded.quant.describe(),
            dtype=str(self.loaded.dtype).removeprefix("torch."),
            kv_cache_dtype=self.runner.kv_spec.dtype.value,
            block_size=self.config.block_size,
            max_model_len=self.max_model_len,
            vocab_size=self.runner.vocab_size,
            eos_token_ids=tuple(sorted(self.tokenizer.eos_token_ids)),
            num_kv_blocks=self.block_manager.num_blocks,
            model_path=str(self.source.weights),
            tokenizer_path=str(self.source.tokenizer_dir),
            model_type=str(self.loaded.hf_config.get("model_type", "")),
        )

    def stats(self) -> EngineStats:
        bm, spec = self.block_manager, self.verifier.counters
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_kv_blocks=bm.num_blocks,
            num_free_kv_blocks=bm.num_free_blocks,
            num_active_kv_blocks=bm.num_used_blocks,
            prefix_cache_queries=bm.prefix_queries,
            prefix_cache_hits=bm.prefix_hits,
            num_preemptions=self.scheduler.num_preemptions,
            num_aborted_requests=self.num_aborted_requests,
            constraints=self.constraints.stats(),
            block_size=self.config.block_size,
            max_model_len=self.max_model_len,
            kv_cache_dtype=self.runner.kv_spec.dtype.value,
            max_loras=0 if self.config.lora is None else self.config.lora.max_loras,
            running_adapters=self.scheduler.running_adapters(),
            waiting_adapters=self.scheduler.waiting_adapters(),
            spec_decode_num_drafts=spec.num_drafts,
            spec_decode_num_draft_tokens=spec.num_draft_tokens,
            spec_decode_num_accepted_tokens=spec.num_accepted_tokens,
            spec_decode_accepted_per_position=tuple(spec.accepted_per_position),
        )


def _completion(seq: Sequence) -> CompletionOutput:
    """What the sequence produced since its previous output; text that may still grow into a stop string waits.
    Only the new tokens are copied: the history stays in the sequence's append-only lists (OutputHistory)."""
    hold = 0 if seq.is_finished or not seq.params.stop else max(len(s) for s in seq.params.stop) - 1
    release = max(seq.emitted_text_len, seq.text.length - hold)
    emitted = seq.emitted_token_len
    completion = CompletionOutput(
        index=seq.index,
        new_text=seq.text.tail(seq.emitted_text_len)[: release - seq.emitted_text_len],
        new_token_ids=tuple(seq.token_ids[seq.num_prompt_tokens + emitted :]),
        new_logprobs=tuple(seq.logprobs[emitted:]),
        num_tokens=seq.num_output_tokens,
        finish_reason=seq.finish_reason.value if seq.finish_reason else None,
        stop_reason=seq.stop_reason,
        history=OutputHistory(seq.token_ids, seq.num_prompt_tokens, seq.logprobs, len(seq.logprobs), seq.text.pieces,
                              release),
    )
    seq.emitted_text_len, seq.emitted_token_len = release, seq.num_output_tokens
    return completion


def _offline_field(field: str) -> str:
    """The offline API names the prompt list, not the position in it (`prompt_token_ids`, never `[3]`)."""
    return TOKENS_FIELD if field.startswith(TOKENS_FIELD + "[") else field
