"""One step's inputs, prepared once from the SchedulerOutput for whichever path runs it (the torch forward or the
native C step): the new tokens of every sequence packed into one batch, their positions and KV slots, and the
logits rows that sample."""

from __future__ import annotations

from dataclasses import dataclass, replace

from pagedserve.engine.core.scheduler_output import ScheduledSeq
from pagedserve.engine.core.sequence import Sequence
from pagedserve.engine.lora.weights import LoraWeights
from pagedserve.engine.runner.pooled_rows import PoolRows, pool_rows
from pagedserve.engine.runner.prompt_logprobs import PromptRows, prompt_rows


@dataclass(frozen=True, slots=True)
class StepInput:
    token_ids: list[int]  # [T]: each sequence's new tokens, then its drafts
    positions: list[int]  # [T]
    slots: list[int]  # [T]: the KV cache slot each token's K/V goes to
    query_lens: list[int]  # [S]: new tokens per sequence
    seq_lens: list[int]  # [S]: each sequence's context after this step
    block_tables: list[list[int]]  # [S]: each sequence's table, padded with 0 to the longest
    # The last new token of each sequence that samples this step, and each of its draft tokens
    logits_rows: list[int]
    sampling_seqs: tuple[Sequence, ...]  # the sequences, in logits-row order (a speculating one has 1 + drafts rows)
    adapter_spans: list[tuple[LoraWeights, int, int]]  # (adapter, first token, end) of each adapter row's tokens
    rope_lengths: list[int]  # [S]: each sequence's length as LongRoPE sees it (its factors switch on it)
    # Async scheduling: (index in token_ids, sequence) of each input token the step in flight is still sampling;
    # token_ids holds 0 there until the runner fills it from that step's device tokens.
    pending: tuple[tuple[int, Sequence], ...] = ()
    prompt_rows: tuple[PromptRows, ...] = ()  # prefill rows whose next prompt token's logprob was asked for
    pool_rows: tuple[PoolRows, ...] = ()  # each embedding sequence's chunk: the rows its pooling reads

    @property
    def needs_hidden(self) -> bool:
        """Rows other than the sampling ones are read from the hidden states (the native step returns logits only)."""
        return bool(self.prompt_rows or self.pool_rows)

    @property
    def row_block_tables(self) -> list[list[int]]:
        """[T]: every token's sequence table (a draft is a decode row of its own over its sequence's table)."""
        return [table for table, count in zip(self.block_tables, self.query_lens) for _ in range(count)]

    def resolved(self, tokens: dict[Sequence, int]) -> StepInput:
        """This step with its pending input tokens filled in from the host (for the paths that take host ids)."""
        ids = list(self.token_ids)
        for index, seq in self.pending:
            ids[index] = tokens[seq]
        return replace(self, token_ids=ids, pending=())


def prepare_step(scheduled: tuple[ScheduledSeq, ...], block_size: int) -> StepInput:
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_lens: list[int] = []
    seq_lens: list[int] = []
    rope_lengths: list[int] = []
    rows: list[int] = []
    sampling: list[Sequence] = []
    spans: list[tuple[LoraWeights, int, int]] = []
    pending: list[tuple[int, Sequence]] = []
    prompt: list[PromptRows] = []
    pooled: list[PoolRows] = []
    for item in scheduled:
        seq, start = item.seq, item.seq.num_computed_tokens
        end = start + item.num_new_tokens
        pooling = pool_rows(seq, start, end, len(ids))
        if pooling is not None:
            pooled.append(pooling)
        scored = prompt_rows(seq, start, end, len(ids)) if not item.draft_tokens else None
        if scored is not None:
            prompt.append(scored)
        if seq.adapter is not None:
            spans.append((seq.features[LoraWeights], len(ids), len(ids) + item.num_new_tokens))
        drafts = item.draft_tokens
        known = seq.num_tokens  # plus the one token still being sampled, for a row whose input is pending
        if item.input_pending:
            pending.append((len(ids), seq))
            ids.append(0)
            known += 1
        else:
            ids += seq.token_ids[start : end - len(drafts)]
        ids += drafts
        positions += range(start, end)
        table = seq.block_table
        slots += [table[p // block_size] * block_size + p % block_size for p in range(start, end)]
        query_lens.append(item.num_new_tokens)
        seq_lens.append(end)
        rope_lengths.append(max(known, end))
        if end - len(drafts) == known and pooling is None:  # an embedding sequence never samples
            # A speculating sequence samples at its last token and after each draft: 1 + len(drafts) rows.
            rows += range(len(ids) - 1 - len(drafts), len(ids))
            sampling.append(seq)
    width = max(len(item.seq.block_table) for item in scheduled)
    tables = [item.seq.block_table + [0] * (width - len(item.seq.block_table)) for item in scheduled]
    return StepInput(ids, positions, slots, query_lens, seq_lens, tables, rows, tuple(sampling), spans, rope_lengths,
                     tuple(pending), tuple(prompt), tuple(pooled))
