"""N-gram prompt lookup (vLLM's `ngram` method): the sequence's own tokens are the draft model.

The longest suffix n-gram (from `prompt_lookup_max` down to `prompt_lookup_min` tokens) that also occurs earlier in
the prompt + output proposes the tokens that followed its most recent earlier occurrence. Text that copies its
input (edits, summaries quoting their source, code) repeats such n-grams, so the guess is often right.
"""

from __future__ import annotations

import numpy as np

# Only the last tokens are searched: the cost per step stays bounded however long the sequence grows.
LOOKUP_WINDOW = 4096


def propose_ngram(tokens: list[int], k: int, n_min: int, n_max: int, window: int = LOOKUP_WINDOW) -> tuple[int, ...]:
    """Up to `k` draft tokens for the sequence `tokens`, or () when no suffix n-gram recurs."""
    if k < 1 or len(tokens) <= n_min:
        return ()
    seq = np.asarray(tokens[-window:], dtype=np.int64)
    length = len(seq)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        pattern = seq[length - n:]
        # Starts i < length - n: the occurrence ends before the suffix does, so a token follows it.
        starts = np.flatnonzero(seq[: length - n] == pattern[0])
        for offset in range(1, n):
            if not starts.size:
                break
            starts = starts[seq[starts + offset] == pattern[offset]]
        if starts.size:
            begin = int(starts[-1]) + n
            return tuple(seq[begin : begin + k].tolist())
    return ()
