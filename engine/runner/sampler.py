"""Turns each sampling sequence's logits into its next token(s), honouring its own SamplingParams.

A constrained row is masked to the tokens its grammar allows first (`engine/structured_output/bitmask.py`), before
penalties, bias, min_tokens and temperature. Logprobs are reported from the model's distribution before penalties
and temperature, as vLLM does: for a constrained row, the masked (constrained) distribution.
Every row is sampled on its own: temperatures divide logits after the row maximum is subtracted (so no
temperature overflows a row to inf/NaN), and a row that is still not finite fails only its own request, as does
an exception raised by one row's own rules or draw (a bug must not end its batch mates).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from pagedserve.engine.core.sequence import Sequence, TokenLogprob
from pagedserve.engine.core.step_output import SeqSample, row_failure
from pagedserve.engine.runner.device_rows import DeviceRows, HostRows
from pagedserve.engine.runner.row_argmax import MaxArgmax, picks_and_finite, torch_max_argmax
from pagedserve.engine.runner.seeded_sampling import generator_of
from pagedserve.engine.structured_output.backend import GrammarState
from pagedserve.engine.structured_output.bitmask import mask_constrained_rows
from pagedserve.engine.thought_budget import budget_active, forced_token


Pending = Mapping[Sequence, torch.Tensor]  # a sequence's token in flight, one int64 where the logits are

NON_FINITE = "the model's logits for this request are not finite (NaN or inf); no token can be sampled"


class Sampler:
    def __init__(self, eos_token_ids: frozenset[int], max_argmax: MaxArgmax = torch_max_argmax):
        self.eos_token_ids = eos_token_ids
        self.max_argmax = max_argmax  # greedy picks and the finiteness check; native_max_argmax where it builds

    def __call__(self, logits: torch.Tensor, seqs: tuple[Sequence, ...], pending: Pending | None = None
                 ) -> list[SeqSample]:
        """logits [S, vocab] fp32, one row per sequence in `seqs`."""
        assert logits.dim() == 2 and logits.shape[0] == len(seqs) and logits.dtype == torch.float32
        failed: dict[int, str] = {}
        dead = mask_constrained_rows(logits, seqs, failed)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(s.params.logprobs is not None for s in seqs) else None
        processed = self.process(logits, seqs, pending, failed)
        # A NaN or +inf anywhere, or no finite logit at all, makes the row's maximum non-finite (NaN for a NaN).
        row_max, argmax = self.max_argmax(processed)
        picks, finite = picks_and_finite(row_max, argmax)
        # A dead end's row is all -inf (so not finite) by design; a failed row keeps its own error.
        failed.update((i, NON_FINITE) for i, ok in enumerate(finite) if not ok and i not in failed and i not in dead)
        live = [i for i in range(len(seqs)) if i not in failed and i not in dead]
        choices: dict[int, list[int]] = {row: [picks[row]] for row in live if seqs[row].params.greedy}
        random_rows = [i for i in live if not seqs[i].params.greedy]
        if random_rows:
            choices.update(self._sample_random(processed, row_max, seqs, random_rows, failed))
        return [
            SeqSample(seq, (), error=failed[row]) if row in failed else
            SeqSample(seq, (), dead_end=True) if row in dead else
            SeqSample(seq, tuple((tok, self.logprob(raw_logprobs, row, tok, seq)) for tok in choices[row]))
            for row, seq in enumerate(seqs)
        ]

    def picks_on_device(self, seq: Sequence) -> bool:
        """Whether nothing on the host decides `seq`'s next token (what async scheduling needs: `device_picks`): no
        grammar or bad words (they read the tokens so far, and the token in flight is not on the host yet) and no
        samples to fork. Penalties and min_tokens count the token in flight (`pending`). `device_picks` gives these
        sequences the tokens and logprobs `__call__` would."""
        p = seq.params
        return not p.bad_words_ids and seq.pending_forks == 0 and GrammarState not in seq.features \
            and not budget_active(seq)

    def device_picks(self, logits: torch.Tensor, seqs: tuple[Sequence, ...], pending: Pending | None = None
                     ) -> DeviceRows:
        """Each row's token, whether its maximum is finite and its logprobs, left where the logits are (nothing
        waits for the host): the argmax for greedy rows, one draw from the filtered distribution for the others."""
        raw = torch.log_softmax(logits, dim=-1) if any(s.params.logprobs is not None for s in seqs) else None
        failed: dict[int, str] = {}
        processed = self.process(logits, seqs, pending, failed)
        row_max, tokens = self.max_argmax(processed)
        finite = torch.isfinite(row_max)
        if failed:  # its processed row is whatever the failure left: drawn from as a non-finite one, then discarded
            finite[torch.tensor(sorted(failed), device=logits.device)] = False
        rows = [i for i, seq in enumerate(seqs) if not seq.params.greedy]
        if rows:
            probs, order = self.filtered_probs(processed, row_max, seqs, rows)
            # A non-finite row's token is discarded (its request fails), but its NaNs must not reach multinomial,
            # which asserts on the device: it draws from a one-hot row instead.
            bad = ~finite[torch.tensor(rows, device=logits.device)]
            probs = probs.masked_fill(bad.unsqueeze(1), 0.0)
            probs[:, 0] += bad.to(probs.dtype)
            tokens = tokens.clone()
            for row, drawn in self._draws(probs, order, seqs, rows, [1] * len(rows), failed).items():
                tokens[row : row + 1] = drawn
        if raw is None:
            return DeviceRows(tokens, finite, failed=failed)
        top = torch.topk(raw, max(s.params.logprobs or 0 for s in seqs), dim=-1)
        return DeviceRows(tokens, finite, raw.gather(1, tokens.unsqueeze(1)).squeeze(1), top.values, top.indices,
                          failed=failed)

    @staticmethod
    def device_samples(seqs: tuple[Sequence, ...], rows: HostRows) -> list[SeqSample]:
        """`device_picks`' rows, read on the host, as `__call__` reports them."""
        samples = []
        for row, seq in enumerate(seqs):
            if row in rows.failed or not rows.finite[row]:
                samples.append(SeqSample(seq, (), error=rows.failed.get(row, NON_FINITE)))
                continue
            logprob, k = None, seq.params.logprobs
            if k is not None:
                top = tuple(zip(rows.top_ids[row][:k], rows.top_values[row][:k])) if k else ()
                logprob = TokenLogprob(rows.tokens[row], rows.chosen[row], top)
            samples.append(SeqSample(seq, ((rows.tokens[row], logprob),)))
        return samples

    def process(self, logits: torch.Tensor, seqs: tuple[Sequence, ...], pending: Pending | None = None,
                failed: dict[int, str] | None = None) -> torch.Tensor:
        """Bias, penalties and min_tokens applied to each row (a copy when any row needs one). `pending`: a sequence's
        token still in flight (async scheduling: on the device, not yet in its token ids), counted as its last.
        `failed`: where a row whose rules raised is recorded (its request fails); without it, the error propagates."""
        pending = pending or {}
        needs = [
            i for i, s in enumerate(seqs)
            if s.params.logit_bias or s.params.needs_penalties or s.params.restricts_tokens
            or s.num_output_tokens + (s in pending) < s.params.min_tokens or forced_token(s) is not None
        ]
        if not needs:
            return logits
        out = logits.clone()
        for row in needs:
            try:
                self._process_row(out[row], seqs[row], pending.get(seqs[row]))
            except Exception as exc:
                if failed is None:
                    raise
                failed[row] = row_failure(seqs[row], "its logits processing", exc)
        return out

    def _process_row(self, row: torch.Tensor, seq: Sequence, in_flight: torch.Tensor | None) -> None:
        p = seq.params
        ids = dict(dtype=torch.long, device=row.device)  # every index and value where the logits are (CPU or GPU)
        outputs = seq.num_output_tokens + (in_flight is not None)
        if p.logit_bias:
            row[torch.tensor(list(p.logit_bias), **ids)] += torch.tensor(list(p.logit_bias.values()), dtype=row.dtype,
                                                                         device=row.device)
        if p.repetition_penalty != 1.0:
            seen = _with(torch.tensor(sorted(set(seq.token_ids)), **ids), in_flight)  # a repeated id: same value
            scores = row[seen]
            row[seen] = torch.where(scores < 0, scores * p.repetition_penalty, scores / p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and outputs:
            counts = torch.bincount(_with(torch.tensor(seq.output_token_ids, **ids), in_flight), minlength=row.shape[0])
            row -= p.frequency_penalty * counts.to(row.dtype) + p.presence_penalty * (counts > 0).to(row.dtype)
        if outputs < p.min_tokens:
            banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_token_ids))
            if banned:
                _ban(row, torch.tensor(sorted(banned), **ids), keep_one=GrammarState in seq.features)
        if p.restricts_tokens:
            _restrict(row, seq)
        forced = forced_token(seq)
        if forced is not None:  # the thought's budget is spent: its end marker comes next, whatever else applies
            value = row[forced].clone()
            row.fill_(float("-inf"))
            row[forced] = value if torch.isfinite(value) else 0.0

    def _sample_random(self, logits: torch.Tensor, row_max: torch.Tensor, seqs: tuple[Sequence, ...],
                       rows: list[int], failed: dict[int, str]) -> dict[int, list[int]]:
        probs, order = self.filtered_probs(logits, row_max, seqs, rows)
        counts = [1 + seqs[row].pending_forks if seqs[row].num_output_tokens == 0 else 1 for row in rows]
        return {row: drawn.tolist() for row, drawn in self._draws(probs, order, seqs, rows, counts, failed).items()}

    @staticmethod
    def _draws(probs: torch.Tensor, order: torch.Tensor, seqs: tuple[Sequence, ...], rows: list[int],
               counts: list[int], failed: dict[int, str]) -> dict[int, torch.Tensor]:
        """Each of `rows`' `counts` draws from its own generator (`filtered_probs`' rows), as token ids on the
        probabilities' device: the one draw both the host sampler and `device_picks` make, so a seed gives both the
        same tokens. A row whose draw raises (on CPU: a distribution with no mass) goes to `failed` instead."""
        drawn = {}
        for i, (row, count) in enumerate(zip(rows, counts)):
            try:
                drawn[row] = order[i, torch.multinomial(probs[i], count, replacement=True,
                                                        generator=generator_of(seqs[row], probs.device))]
            except RuntimeError as exc:
                failed[row] = row_failure(seqs[row], "its draw", exc)
        return drawn

    @staticmethod
    def filtered_probs(
        logits: torch.Tensor, row_max: torch.Tensor, seqs: tuple[Sequence, ...], rows: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The distribution each of `rows` samples from, after temperature, top-k, min-p and top-p: (probabilities
        sorted best first [len(rows), vocab], the token id at each sorted place)."""
        device = logits.device
        temps = torch.tensor([seqs[r].params.temperature for r in rows], dtype=torch.float32, device=device)
        temps = temps.unsqueeze(1)
        # Shifted rows are <= 0 with the best logit exactly 0, so dividing by any temperature (a denormal one
        # included) gives 0 or a negative number, never inf or 0/0; the softmax is unchanged by the shift.
        scaled = (logits[rows] - row_max[rows].unsqueeze(1)) / temps.clamp(min=torch.finfo(torch.float32).tiny)
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        ranks = torch.arange(sorted_logits.shape[1], device=device).unsqueeze(0)
        vocab = sorted_logits.shape[1]
        ks = [min(seqs[r].params.top_k or vocab, vocab) for r in rows]  # checked on the host: no wait for a GPU
        top_k = torch.tensor(ks, device=device).unsqueeze(1)
        if any(k < vocab for k in ks):
            # Tokens tied with the k-th are kept with it (as transformers and vLLM do): which of equal logits the
            # sort puts first must not decide what can be sampled.
            kth = sorted_logits.gather(1, top_k - 1)
            sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
        probs = sorted_logits.softmax(dim=-1)
        ps = [seqs[r].params.top_p for r in rows]
        # A top_p below fp32's smallest normal (accepted: it is > 0) would round to 0 here and drop the best token
        # too, leaving nothing to sample; clamped, the best token's mass of 0 stays below it.
        top_p = torch.tensor(ps, device=device).clamp(min=torch.finfo(torch.float32).tiny).unsqueeze(1)
        min_p = torch.tensor([seqs[r].params.min_p for r in rows], device=device).unsqueeze(1)
        drop = probs < min_p * probs[:, :1]
        if any(p < 1 for p in ps):
            drop |= (_mass_strictly_above(probs, ranks) >= top_p) & (top_p < 1)
        return probs.masked_fill(drop, 0.0), order

    @staticmethod
    def logprob(raw: torch.Tensor | None, row: int, token: int, seq: Sequence) -> TokenLogprob | None:
        if raw is None or seq.params.logprobs is None:
            return None
        values = raw[row]
        top: tuple[tuple[int, float], ...] = ()
        if seq.params.logprobs:
            best = torch.topk(values, seq.params.logprobs)
            top = tuple(zip(best.indices.tolist(), best.values.tolist()))
        return TokenLogprob(token, float(values[token]), top)


def _with(ids: torch.Tensor, in_flight: torch.Tensor | None) -> torch.Tensor:
    return ids if in_flight is None else torch.cat([ids, in_flight.to(ids.device)])


def _ban(row: torch.Tensor, ids: torch.Tensor, keep_one: bool) -> None:
    """min_tokens: the end is forbidden; under a constraint only while the grammar allows some other token (a
    complete grammar that allows only the end still ends, rather than dead-ending on min_tokens)."""
    saved = row[ids].clone()
    row[ids] = float("-inf")
    if keep_one and not bool(torch.isfinite(row).any()):
        row[ids] = saved


def _restrict(row: torch.Tensor, seq: Sequence) -> None:
    """allowed_token_ids: every other token is out; bad words: a word's last token is out while the output ends
    with the word's other tokens (a one-token word is always out)."""
    p = seq.params
    if p.allowed_token_ids is not None:
        keep = torch.tensor(p.allowed_token_ids, dtype=torch.long, device=row.device)
        kept = row[keep].clone()
        row.fill_(float("-inf"))
        row[keep] = kept
    if p.bad_words_ids:
        output = seq.output_token_ids
        banned = {ids[-1] for ids in p.bad_words_ids
                  if len(ids) == 1 or (len(ids) - 1 <= len(output) and tuple(output[len(output) - len(ids) + 1:]) == ids[:-1])}
        if banned:
            row[torch.tensor(sorted(banned), dtype=torch.long, device=row.device)] = float("-inf")


def _mass_strictly_above(probs: torch.Tensor, ranks: torch.Tensor) -> torch.Tensor:
    """For rows sorted in descending order: each token's mass of strictly more likely tokens. top_p keeps a token
    while that mass is below top_p (the smallest set reaching top_p), and tied tokens share their run's first
    value, so equal tokens are kept or dropped together; the best token (mass 0) always survives."""
    before = probs.cumsum(dim=-1) - probs
    tied = (probs[:, 1:] == probs[:, :-1]) & (probs[:, 1:] > 0)  # tokens of probability 0 are dropped anyway
    if probs.device.type == "cpu" and not bool(tied.any()):  # a shortcut on CPU; on a GPU the check would wait
        return before
    starts = torch.ones_like(probs, dtype=torch.bool)
    starts[:, 1:] = ~tied
    first = torch.where(starts, ranks, 0).cummax(dim=-1).values
    return before.gather(1, first)
