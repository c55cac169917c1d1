"""Which sequences get drafts this step, and how many: the scheduler's side of speculative decoding.

A sequence speculates only where verification reproduces exactly what decoding without drafts would do, token by
token: a decode step (its one new token, not a prefill or a recompute after preemption), no grammar (the matcher
would have to be rolled back), no repetition/presence/frequency penalties and min_tokens already reached (those
change each row's distribution with the tokens before it), no samples still to fork (n > 1 forks on the first
token; the forked samples speculate on their own afterwards), and the request did not opt out. Drafts never run
past max_tokens or the context limit, so they need no KV the admission did not reserve.

Row budget: past the native decode step's sequence limit, a step with drafts still runs natively while its rows fit
`EngineConfig.native_step_max_rows`; each sequence then drafts at most that budget's share, as the runner's own size
rule says (`engine/runner/native_capacity.py`).

Draft length: with `SpeculativeConfig.adaptive_drafts` (the default) a sequence drafts fewer than k tokens where its
n-gram match is short (`ngram.draft_count`): a chance repeat of two tokens is rarely followed by what followed it
before, and every rejected draft still costs its row.

Back-off: drafts that are all rejected still cost their rows (in the native decode step, or on the torch path for
batches too large for it), so they cost real time. After a verification that accepted nothing, the
sequence proposes nothing for 1, 2, 4, ... up to `MAX_BACKOFF_STEPS` steps; any accepted draft resets it. This
changes which steps speculate, never the tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.engine.core.seq_features import SeqFeature
from pagedserve.engine.core.sequence import Sequence
from pagedserve.engine.runner.native_capacity import NO_NATIVE_STEP, NativeCapacity
from pagedserve.engine.spec_decode.config import DEFAULT_DISABLE_BY_BATCH_SIZE, SpeculativeConfig
from pagedserve.engine.spec_decode.ngram import draft_count, find_ngram
from pagedserve.engine.structured_output.backend import GrammarState
from pagedserve.engine.thought_budget import budget_active

MAX_BACKOFF_STEPS = 16


@dataclass(slots=True)
class SpecBackoff(SeqFeature):
    """A sequence's back-off: steps left without drafts, and how many verifications in a row accepted nothing."""

    skip: int = 0
    misses: int = 0

    def fork(self, index: int) -> None:
        return None  # a forked sample starts speculating afresh


class Drafter:
    def __init__(self, config: SpeculativeConfig, max_model_len: int, native: NativeCapacity = NO_NATIVE_STEP):
        self.config = config
        self.max_model_len = max_model_len
        self.native = native
        self.disable_by_batch_size = config.disable_by_batch_size or DEFAULT_DISABLE_BY_BATCH_SIZE

    def active(self, num_running: int) -> bool:
        """vLLM's disable-by-batch-size, decided per step from the running sequences."""
        return num_running <= self.disable_by_batch_size

    def drafts_per_sequence(self, num_running: int) -> int:
        """k, or fewer where the native step's row budget takes the step then (`NativeCapacity.drafts_that_fit`)."""
        return self.native.drafts_that_fit(num_running, self.config.num_speculative_tokens)

    def propose(self, seq: Sequence, budget: int) -> tuple[int, ...]:
        """Draft tokens for a decode sequence, at most `budget` of them (the step's token budget left)."""
        limit = min(budget, self._room(seq))
        if limit < 1 or not self.eligible(seq):
            return ()
        backoff = seq.features.get(SpecBackoff)
        if backoff is not None and backoff.skip:
            backoff.skip -= 1
            return ()
        c = self.config
        match = find_ngram(seq.token_ids, c.prompt_lookup_min, c.prompt_lookup_max)
        if match is None:
            return ()
        return match.continuation(min(limit, draft_count(match.length)) if c.adaptive_drafts else limit)

    @staticmethod
    def observe(seq: Sequence, num_accepted: int) -> None:
        """A verification's outcome: nothing accepted backs the sequence off for longer each time in a row."""
        backoff = seq.features.get(SpecBackoff)
        if num_accepted:
            if backoff is not None:
                backoff.misses = 0
            return
        if backoff is None:
            backoff = SpecBackoff()
            seq.features.attach(backoff)
        backoff.misses += 1
        backoff.skip = min(2 ** (backoff.misses - 1), MAX_BACKOFF_STEPS)

    def _room(self, seq: Sequence) -> int:
        """Drafts after which the sequence can still end on its own next token."""
        p = seq.params
        k = self.config.num_speculative_tokens
        left = k if p.max_tokens is None else p.max_tokens - seq.num_output_tokens - 1
        return min(k, left, self.max_model_len - seq.num_tokens - 1)

    @staticmethod
    def eligible(seq: Sequence) -> bool:
        p = seq.params
        # bad words depend on the tokens before each position, which the verifier's rows do not carry for drafts
        return (p.speculative and GrammarState not in seq.features and not p.needs_penalties and not p.bad_words_ids
                and seq.pending_forks == 0 and seq.num_output_tokens >= p.min_tokens
                and seq.num_computed_tokens + 1 == seq.num_tokens and not budget_active(seq))
