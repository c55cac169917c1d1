"""N-gram prompt lookup (vLLM's `ngram` method): the sequence's own tokens are the draft model.

The longest suffix n-gram (from `prompt_lookup_max` down to `prompt_lookup_min` tokens) that also occurs earlier in
the prompt + output proposes the tokens that followed its most recent earlier occurrence. Text that copies its
input (edits, summaries quoting their source, code) repeats such n-grams, so the guess is often right.

How long the chosen occurrence's match runs (up to `MATCH_CAP` tokens, past `prompt_lookup_max` too) says how sure
the guess is: a text being copied matches tens of tokens back, a chance repeat two or three (the drafter sizes the
draft by it, `draft_count`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Only the last tokens are searched: the cost per step stays bounded however long the sequence grows.
LOOKUP_WINDOW = 4096
# How far back a match is measured for `NgramMatch.length`: past this, a longer match says little more.
MATCH_CAP = 16


@dataclass(frozen=True, slots=True)
class NgramMatch:
    """`tokens[begin:]` follow the chosen occurrence; `length`: how many tokens before them equal the sequence's
    last ones (at least the n-gram's n, at most max(n, MATCH_CAP))."""

    tokens: np.ndarray  # the searched window
    begin: int
    length: int

    def continuation(self, k: int) -> tuple[int, ...]:
        return tuple(self.tokens[self.begin : self.begin + k].tolist())


def find_ngram(tokens: list[int], n_min: int, n_max: int, window: int = LOOKUP_WINDOW) -> NgramMatch | None:
    """The most recent earlier occurrence of the longest suffix n-gram (n_max down to n_min tokens), or None.

    One comparison of the window finds the earlier places of the last token; one gather then measures how far back
    each of them matches the sequence's end, so the cost does not grow with the lookup range."""
    if len(tokens) <= n_min:
        return None
    seq = np.asarray(tokens[-window:], dtype=np.int64)
    length = len(seq)
    # ends: the last token of each candidate occurrence; < length - 1, so a token follows it
    ends = np.flatnonzero(seq[: length - 1] == seq[-1])
    depth = min(max(n_max, MATCH_CAP), length - 1)
    if not ends.size or depth < n_min:
        return None
    back = np.arange(depth)
    places = ends[:, None] - back
    same = (places >= 0) & (seq[np.maximum(places, 0)] == seq[length - 1 - back])
    matched = np.where(same.all(axis=1), depth, same.argmin(axis=1))  # tokens matched before the first mismatch
    n = np.minimum(matched, n_max)
    best = int(n.max())
    if best < n_min:
        return None
    chosen = int(np.flatnonzero(n == best)[-1])  # the most recent of the longest
    return NgramMatch(seq, int(ends[chosen]) + 1, int(matched[chosen]))


def propose_ngram(tokens: list[int], k: int, n_min: int, n_max: int, window: int = LOOKUP_WINDOW) -> tuple[int, ...]:
    """Up to `k` draft tokens for the sequence `tokens`, or () when no suffix n-gram recurs."""
    match = find_ngram(tokens, n_min, n_max, window) if k >= 1 else None
    return () if match is None else match.continuation(k)


def draft_count(match_length: int) -> int:
    """Drafts worth proposing after a match of `match_length` tokens: 1 for a chance two-token repeat, about 1.5 per
    matched token past the first for a longer one (2 -> 1, 3 -> 3, 4 -> 4, 5 -> 6, 6 -> 7, ...).

    Why: a draft row costs about a fifth of a one-row step on the native CPU step (its integer dots and attention),
    so a draft pays while it is accepted more often than that; on copy and free-writing texts the chance that the
    i-th draft stands grows with the match length (docs/speculative-decoding.md, "Draft length")."""
    return max(1, 3 * (match_length - 1) // 2)
