"""The sampler's mask step: for the constrained rows of a step only, fill each matcher's allowed-token bitmask on
CPU and send every token it forbids to -inf. Unconstrained rows are neither read nor written."""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from pagedserve.engine.sequence import Sequence

_SHIFTS = torch.arange(32, dtype=torch.int32)


def mask_constrained_rows(logits: torch.Tensor, seqs: Seq[Sequence]) -> set[int]:
    """Masks logits [S, vocab] in place on the rows whose sequence has a matcher; returns the rows that allow no
    token at all (the constraint's dead ends)."""
    rows = [i for i, seq in enumerate(seqs) if seq.matcher is not None]
    if not rows:
        return set()
    vocab = logits.shape[1]
    words = max((seqs[r].matcher.vocab_words for r in rows))
    bitmask = torch.zeros((len(rows), words), dtype=torch.int32)
    for k, row in enumerate(rows):
        seqs[row].matcher.fill_bitmask(bitmask, k)
    allowed = unpack(bitmask, vocab)
    index = torch.tensor(rows, dtype=torch.long)
    with torch.inference_mode():  # the runner's logits are inference tensors; masked in place, not copied whole
        logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
    return {rows[k] for k in torch.nonzero(~allowed.any(dim=1)).flatten().tolist()}


def unpack(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """int32 words [R, W] -> bool [R, vocab] (bit t % 32 of word t // 32); ids past the bitmask are forbidden."""
    bits = ((bitmask.unsqueeze(-1) >> _SHIFTS) & 1).bool().flatten(1)
    if bits.shape[1] >= vocab:
        return bits[:, :vocab]
    return torch.cat([bits, bits.new_zeros((bits.shape[0], vocab - bits.shape[1]))], dim=1)
