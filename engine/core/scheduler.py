"""Iteration-level scheduling: every step picks which sequences compute how many tokens.

There are no prefill or decode phases: each running sequence computes the gap between its computed and its
total tokens, limited by a per-step token budget, so chunked prefill and mixed prefill+decode batches fall out.
vLLM's `long_prefill_token_threshold` caps one sequence's share of a step, so a long prompt's chunks leave budget
to the prompts queued behind it instead of taking whole steps.
Under KV pressure the running sequence that ranks last (`scheduling_policy.py`: the newest, or the lowest priority)
is preempted and later recomputed (its outputs are kept).

LoRA: at most `max_loras` distinct adapters among the running sequences (so in any step; the base is not counted).
A waiting request whose adapter would exceed it is passed only by requests of the base or of an adapter already
running, and only for `lora_pass_steps` steps; then nothing behind it is admitted until an adapter's last request
ends and frees its place: first come, first served, without starving anyone.

Speculative decoding: a decode sequence the drafter proposes for computes 1 + len(drafts) positions in the same step
(the budget counts them; drafts are dropped rather than preempting anyone). Its commit waits for verification
(`commit_verified`): only the accepted positions count as computed, and blocks taken only for rejected ones go back.

After the runner's step, `update` is the one place the step's outcome changes state: blocks are committed, tokens
appended through the stop rules (verified drafts one by one), n > 1 samples forked off their first token, dead ends
and finished sequences released.
"""

from __future__ import annotations

import logging
from collections import deque

from pagedserve.engine.core.block_manager import BlockManager, PrefixHit
from pagedserve.engine.core.scheduler_output import ScheduledSeq, SchedulerOutput, StepUpdate
from pagedserve.engine.core.scheduling_policy import SchedulingPolicy
from pagedserve.engine.core.sequence import FinishReason, Sequence, SeqStatus, TokenLogprob, now
from pagedserve.engine.core.step_output import SeqSample, StepOutput
from pagedserve.engine.core.stopping import StopRules
from pagedserve.engine.spec_decode.drafter import Drafter


logger = logging.getLogger(__name__)

# Steps a request blocked by the adapter cap may be passed by others before admission waits for it.
LORA_PASS_STEPS = 16


class Scheduler:
    # Free blocks an admitted prompt leaves each running sequence and itself to grow into (see _prefill_can_finish).
    HEADROOM_BLOCKS = 1

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_loras: int | None = None, lora_pass_steps: int = LORA_PASS_STEPS, drafter: Drafter | None = None,
                 stop: StopRules | None = None, policy: SchedulingPolicy = SchedulingPolicy.FCFS,
                 long_prefill_token_threshold: int = 0):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_loras = max_loras  # None: no cap (LoRA off)
        self.lora_pass_steps = lora_pass_steps
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # LongRoPE: a sequence that grows past this length recomputes its cache with the long factors, once, as
        # transformers' Phi-3 drops its cache there (prepare_inputs_for_generation); set by the engine.
        self.long_rope_after: int | None = None
        self._long_recomputed: set[int] = set()
        self._passed_steps: dict[Sequence, int] = {}  # a request blocked by the adapter cap -> steps it was passed
        self.drafter = drafter  # None: no speculative decoding
        self.stop = stop  # the stop rules `update` appends through
        self.policy = policy
        self.long_prefill_token_threshold = long_prefill_token_threshold  # tokens per sequence per step; 0: none

    def add(self, seq: Sequence) -> None:
        self.policy.enqueue(self.waiting, seq)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        copies: list[tuple[int, int]] = []
        preempted: list[Sequence] = []
        index = 0
        speculate = self.drafter is not None and self.drafter.active(len(self.running))
        per_seq = self.drafter.drafts_per_sequence(len(self.running)) if speculate else 0
        self.policy.order_running(self.running)
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            if self._crossed_long_rope(seq):
                self.running.pop(index)
                self._preempt(seq)
                preempted.append(seq)
                continue
            num_new = self._chunk(seq.num_tokens - seq.num_computed_tokens, budget)
            drafts = self._drafts(seq, min(per_seq, budget - num_new)) if per_seq else ()
            num_new += len(drafts)
            while not self.block_manager.can_allocate(seq, num_new):
                victim = self.running.pop()  # the one that ranks last gives way
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING:
                break
            copies += self.block_manager.allocate(seq, num_new)
            scheduled.append(ScheduledSeq(seq, num_new, drafts))
            budget -= num_new
            index += 1
        if not preempted:
            budget = self._admit_waiting(budget, scheduled, copies)
        return SchedulerOutput(tuple(scheduled), tuple(copies))

    def _chunk(self, uncomputed: int, budget: int) -> int:
        """The tokens one sequence computes this step: what it lacks, within the budget and the per-sequence cap."""
        cap = self.long_prefill_token_threshold
        return min(uncomputed, budget, cap) if cap > 0 else min(uncomputed, budget)

    def _drafts(self, seq: Sequence, budget: int) -> tuple[int, ...]:
        """Drafts only where their blocks are free now: speculation never preempts anyone."""
        drafts = self.drafter.propose(seq, budget)
        return drafts if drafts and self.block_manager.can_allocate(seq, 1 + len(drafts)) else ()

    def _admit_waiting(self, budget: int, scheduled: list[ScheduledSeq], copies: list[tuple[int, int]]) -> int:
        adapters = {s.adapter_id for s in self.running if s.adapter is not None}
        index = 0  # the waiting requests before this one are blocked by the adapter cap
        while index < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[index]
            if self._over_adapter_cap(seq, adapters):
                passed = self._passed_steps[seq] = self._passed_steps.get(seq, 0) + 1
                if index == 0 and passed > self.lora_pass_steps:
                    break  # the first blocked request waited long enough: nobody else goes before it
                index += 1
                continue
            fresh = not seq.block_table
            hit = self.block_manager.lookup_prefix(seq) if fresh and not seq.needs_every_position else None
            hit_tokens = len(hit.block_ids) * self.block_manager.block_size if hit else 0
            uncomputed = seq.num_tokens - seq.num_computed_tokens - hit_tokens
            num_new = self._chunk(uncomputed, budget)
            if not self.block_manager.can_allocate(seq, num_new, hit) or \
                    not self._prefill_can_finish(seq, num_new, uncomputed, hit):
                break
            del self.waiting[index]
            self._passed_steps.pop(seq, None)
            if seq.adapter is not None:
                adapters.add(seq.adapter_id)
            if hit is not None:
                self.block_manager.record_lookup(seq, hit)
                if seq.metrics.first_scheduled_time is None:
                    seq.metrics.num_cached_tokens = hit_tokens
            copies += self.block_manager.allocate(seq, num_new, hit)
            seq.status = SeqStatus.RUNNING
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = now()
            self.running.append(seq)
            scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new
        return budget

    def _prefill_can_finish(self, seq: Sequence, num_new: int, uncomputed: int, hit: PrefixHit | None) -> bool:
        """A prompt starts only when the free blocks hold all of it and still leave every running sequence and it
        one more block; a prompt longer than one step's chunk, also the blocks the running sequences add during its
        chunks. Admitted into the last free blocks (vLLM v1 checks only the first chunk's), it is the newest
        sequence when the next block anyone needs is missing, so it is preempted and everything it computed is
        computed again (a 4k prompt beside three long decodes threw away 2k tokens of prefill that way)."""
        if not self.running or self.block_manager.window is not None:
            return True  # nobody to wait for; or windowed, where a prompt never holds all its blocks
        spare = self.HEADROOM_BLOCKS * (len(self.running) + 1)
        if uncomputed > num_new:
            per_step = self._chunk(uncomputed, max(1, self.max_num_batched_tokens - len(self.running)))
            steps = -(-uncomputed // per_step)
            spare = max(spare, len(self.running) * self.block_manager.blocks_needed(steps))
        return self.block_manager.can_allocate(seq, uncomputed, hit, spare_blocks=spare)

    def _over_adapter_cap(self, seq: Sequence, running: set[int]) -> bool:
        """By id, not name: a name unloaded and loaded again from another folder is another adapter."""
        return self.max_loras is not None and seq.adapter is not None and seq.adapter_id not in running and \
            len(running) >= self.max_loras

    def running_adapters(self) -> tuple[str, ...]:
        """Adapter names of the running sequences, in first-seen order."""
        return tuple(dict.fromkeys(s.adapter_name for s in self.running if s.adapter is not None))

    def waiting_adapters(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(s.adapter_name for s in self.waiting if s.adapter is not None))

    def _crossed_long_rope(self, seq: Sequence) -> bool:
        """Whether `seq` just grew past the LongRoPE switch with keys cached under the short factors."""
        switch = self.long_rope_after
        if switch is None or seq.seq_id in self._long_recomputed or seq.num_prompt_tokens > switch:
            return False
        if 0 < seq.num_computed_tokens <= switch < seq.num_tokens:
            self._long_recomputed.add(seq.seq_id)
            return True
        return False

    def _preempt(self, seq: Sequence) -> None:
        """Recompute later: drop the KV blocks, keep the tokens (prompt and outputs alike)."""
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SeqStatus.WAITING
        seq.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.policy.enqueue(self.waiting, seq, preempted=True)

    def commit(self, output: SchedulerOutput) -> None:
        """The forward for `output` ran: its tokens are now computed, full blocks become shareable, and blocks that
        fell out of every sliding window go back to the pool (after being published: their contents stay valid)."""
        for item in output.scheduled:
            # A speculating one is committed by commit_verified once its drafts are checked; a finished one (async
            # scheduling: stopped while its look-ahead row ran) holds no blocks any more.
            if not item.draft_tokens and not item.seq.is_finished:
                self._advance(item.seq, item.num_new_tokens)

    def commit_verified(self, seq: Sequence, num_accepted: int) -> None:
        """A speculating sequence's step: its last token and the `num_accepted` drafts now in its tokens are computed
        (their KV is right); the rejected drafts' positions are not, and blocks taken only for them go back."""
        self._advance(seq, 1 + num_accepted)
        self.block_manager.trim_to_computed(seq)

    def _advance(self, seq: Sequence, num_computed: int) -> None:
        seq.num_computed_tokens += num_computed
        self.block_manager.commit_full_blocks(seq)
        self.block_manager.release_out_of_window(seq)

    def update(self, batch: SchedulerOutput, output: StepOutput, committed: bool = False) -> StepUpdate:
        """Applies the runner's step: commits `batch` (unless the look-ahead already did: `committed`), then each
        sequence's tokens, in the runner's order. A sequence that ended while its row was in flight (async
        scheduling: stopped by the step before, or aborted) takes nothing."""
        if not committed:
            self.commit(batch)
        update = StepUpdate()
        for scored in output.prompt_logprobs:
            if not scored.seq.is_finished:
                try:
                    scored.apply()
                except Exception as exc:
                    self._failed_applying(scored.seq, update, exc)
        for pooled in output.pooled:
            if not pooled.seq.is_finished:
                try:
                    pooled.apply()
                    if pooled.done:  # an embedding request ends with its prompt: its one output
                        update.touched[pooled.seq.request_id] = None
                        self.finish(pooled.seq, FinishReason.STOP)
                except Exception as exc:
                    self._failed_applying(pooled.seq, update, exc)
        for sample in output.samples:
            seq = sample.seq
            if seq.is_finished:
                continue
            update.touched[seq.request_id] = None
            if sample.error is not None:
                update.failed[seq.request_id] = sample.error
            elif sample.dead_end:
                self._dead_end(seq, update)
            elif seq.request_id not in update.failed:
                try:
                    if sample.num_drafts:
                        self._append_verified(sample)
                    else:
                        self._append_sampled(sample, update)
                except Exception as exc:
                    self._failed_applying(seq, update, exc)
        return update

    @staticmethod
    def _failed_applying(seq: Sequence, update: StepUpdate, exc: Exception) -> None:
        """A bug in one request's bookkeeping (its stop rules, grammar, pooler) fails that request, which the
        engine then ends whole, freeing its blocks; its batch mates' outputs are applied as if it were not there."""
        logger.exception("request %s: the step's output could not be applied", seq.request_id)
        update.touched[seq.request_id] = None
        update.failed[seq.request_id] = \
            f"internal error while applying this request's step ({type(exc).__name__}: {exc})"

    def _append_sampled(self, sample: SeqSample, update: StepUpdate) -> None:
        """A first token with n > 1 forks the other samples off it: each child shares the blocks computed so far."""
        seq = sample.seq
        first, *extra = sample.tokens
        for index, (token, logprob) in enumerate(extra, start=1):
            child = seq.fork(index)  # before seq takes its token: its feature state is forked as it is now
            self.block_manager.fork(seq, child)
            update.forked.append(child)
            self.running.append(child)  # a forked sibling joins the batch right after its parent
            self._append(child, token, logprob)
        seq.pending_forks = 0
        self._append(seq, *first)

    def _append_verified(self, sample: SeqSample) -> None:
        """Token by token, as without speculation: the first token that ends the sequence ends it there. Only the
        appended drafts count as computed (their KV was written by this step), so the prefix cache and the block
        table never keep a rejected or unused draft."""
        seq, appended, done = sample.seq, 0, False
        for token, logprob in sample.tokens:
            appended += 1
            done = self.stop.append(seq, token, logprob)
            if done:
                break
        self.commit_verified(seq, min(appended, sample.num_accepted))
        Drafter.observe(seq, sample.num_accepted)
        if done:
            self.finish(seq)

    def _append(self, seq: Sequence, token: int, logprob: TokenLogprob | None) -> None:
        if self.stop.append(seq, token, logprob):
            self.finish(seq)

    def _dead_end(self, seq: Sequence, update: StepUpdate) -> None:
        """The constraint allows no token: only this sequence ends (with its text so far) and frees its blocks; the
        samples it has not forked yet would start from the same dead end, so they end with it."""
        update.forked.extend(seq.unforked_samples(FinishReason.CONSTRAINT_DEAD_END))
        self.finish(seq, FinishReason.CONSTRAINT_DEAD_END)

    def finish(self, seq: Sequence, reason: FinishReason | None = None) -> None:
        """Remove a finished or aborted sequence wherever it is and release its blocks; `reason`: why it ends, when
        the stop rules did not already say."""
        if reason is not None:
            seq.finish_reason, seq.metrics.finished_time = reason, now()
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
            self._passed_steps.pop(seq, None)
        seq.status = SeqStatus.FINISHED
        self._long_recomputed.discard(seq.seq_id)
        self.block_manager.free(seq)
