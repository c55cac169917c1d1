"""Which sequences get drafts this step, and how many: the scheduler's side of speculative decoding.

A sequence speculates only where verification reproduces exactly what decoding without drafts would do, token by
token: a decode step (its one new token, not a prefill or a recompute after preemption), no grammar (the matcher
would have to be rolled back), no repetition/presence/frequency penalties and min_tokens already reached (those
change each row's distribution with the tokens before it), no samples still to fork (n > 1 forks on the first
token; the forked samples speculate on their own afterwards), and the request did not opt out. Drafts never run
past max_tokens or the context limit, so they need no KV the admission did not reserve.

Row budget: past the native decode step's sequence limit, a step with drafts still runs natively while its rows fit
`EngineConfig.native_step_max_rows`; each sequence then drafts at most that budget's share (`drafts_per_sequence`).

Back-off: drafts that are all rejected still cost their rows (in the native decode step, or on the torch path for
batches too large for it), so they cost real time. After a verification that accepted nothing, the
sequence proposes nothing for 1, 2, 4, ... up to `MAX_BACKOFF_STEPS` steps; any accepted draft resets it. This
changes which steps speculate, never the tokens.
"""

from __future__ import annotations

from pagedserve.engine.sequence import Sequence
from pagedserve.engine.spec_decode.config import (
    DEFAULT_DISABLE_BY_BATCH_SIZE, DEFAULT_DISABLE_WITH_WIDE_NATIVE_STEP, SpeculativeConfig,
)
from pagedserve.engine.spec_decode.ngram import propose_ngram


MAX_BACKOFF_STEPS = 16


class Drafter:
    def __init__(self, config: SpeculativeConfig, max_model_len: int, native_rows: int = 0, native_seqs: int = 0):
        self.config = config
        self.max_model_len = max_model_len
        self.native_rows = native_rows  # the native decode step's row budget for steps with drafts (0: none)
        self.native_seqs = native_seqs  # sequences it takes in any decode step
        wide = native_seqs > 2  # the native step serves non-speculative batches past 2 (config.py's two defaults)
        self.disable_by_batch_size = config.disable_by_batch_size or (
            DEFAULT_DISABLE_WITH_WIDE_NATIVE_STEP if wide else DEFAULT_DISABLE_BY_BATCH_SIZE)

    def active(self, num_running: int) -> bool:
        """vLLM's disable-by-batch-size, decided per step from the running sequences."""
        return num_running <= self.disable_by_batch_size

    def drafts_per_sequence(self, num_running: int) -> int:
        """k, or fewer where that keeps a step too large for the native step's sequence limit within its row budget
        (fewer drafts on the native step beat k drafts on the torch path: benchmarks/spec_decode.py). Where even one
        draft each does not fit, k on the torch path."""
        k = self.config.num_speculative_tokens
        if num_running <= self.native_seqs or num_running * (1 + k) <= self.native_rows:
            return k
        fit = self.native_rows // max(num_running, 1) - 1
        return fit if fit >= 1 else k

    def propose(self, seq: Sequence, budget: int) -> tuple[int, ...]:
        """Draft tokens for a decode sequence, at most `budget` of them (the step's token budget left)."""
        limit = min(budget, self._room(seq))
        if limit < 1 or not self.eligible(seq):
            return ()
        if seq.spec_skip:
            seq.spec_skip -= 1
            return ()
        c = self.config
        return propose_ngram(seq.token_ids, limit, c.prompt_lookup_min, c.prompt_lookup_max)

    @staticmethod
    def observe(seq: Sequence, num_accepted: int) -> None:
        """A verification's outcome: nothing accepted backs the sequence off for longer each time in a row."""
        if num_accepted:
            seq.spec_misses = 0
            return
        seq.spec_misses += 1
        seq.spec_skip = min(2 ** (seq.spec_misses - 1), MAX_BACKOFF_STEPS)

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
        return (p.speculative and seq.matcher is None and not p.needs_penalties and not p.bad_words_ids
                and seq.pending_forks == 0
                and seq.num_output_tokens >= p.min_tokens and seq.num_computed_tokens + 1 == seq.num_tokens)
