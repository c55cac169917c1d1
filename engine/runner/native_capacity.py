"""How large a decode step the native C step takes: the one size rule. The runner asks it for every step
(`NativeDecodeStep.accepts`) and the drafter asks it how many drafts keep a step native, so the two never disagree."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class NativeCapacity:
    """max_batch: sequences of a decode step (any drafts included) the native step takes; max_rows: past that, the
    rows (1 + drafts per sequence) of a step with drafts it still takes (0: none). Both 0: no native step."""

    max_batch: int = 0
    max_rows: int = 0

    def serves(self, num_seqs: int, num_rows: int, has_drafts: bool) -> bool:
        return num_seqs <= self.max_batch or (has_drafts and num_rows <= self.max_rows)

    def drafts_that_fit(self, num_seqs: int, k: int) -> int:
        """k, or fewer where that keeps a step of `num_seqs` drafting sequences native (fewer drafts on the native step
        beat k drafts on the torch path: benchmarks/spec_decode.py); k where not even one draft each fits."""
        if self.serves(num_seqs, num_seqs * (1 + k), True):
            return k
        fit = self.max_rows // max(num_seqs, 1) - 1
        return fit if fit >= 1 else k


NO_NATIVE_STEP = NativeCapacity()
