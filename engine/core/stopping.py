"""Appending a sampled token to a sequence: the grammar accepts it, it is detokenized, then the stop rules decide
whether the sequence is done."""

from __future__ import annotations

from pagedserve.engine.core.sequence import FinishReason, Sequence, TokenLogprob, now
from pagedserve.engine.loading.tokenizer import DetokState, Tokenizer, detokenize_step
from pagedserve.engine.structured_output.backend import GrammarState
from pagedserve.engine.thought_budget import ThoughtBudget


class StopRules:
    """The scheduler's appender: every token a sequence gets goes through `append`."""

    def __init__(self, tokenizer: Tokenizer, max_model_len: int):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len

    def append(self, seq: Sequence, token: int, logprob: TokenLogprob | None) -> bool:
        """Appends `token`; True when the sequence just finished (its finish reason set)."""
        grammar = seq.features.get(GrammarState)
        if grammar is not None and grammar.applies and not grammar.matcher.accept(token):
            # The library refused a token its own mask allowed: the sequence ends here, without it.
            seq.finish_reason, seq.metrics.finished_time = FinishReason.CONSTRAINT_DEAD_END, now()
            return True
        before = seq.text.length
        done = apply_token(seq, token, logprob, self.tokenizer, self.max_model_len)
        if grammar is not None and not grammar.applies:
            grammar.watch(token, seq.text.tail(max(0, before - grammar.waits_for.reach)))
        budget = seq.features.get(ThoughtBudget)
        if budget is not None and budget.active:
            budget.note(token, seq.text.tail(max(0, before - budget.watch_chars)))
        return done


def apply_token(seq: Sequence, token: int, logprob: TokenLogprob | None, tokenizer: Tokenizer, max_model_len: int) -> bool:
    """Appends `token` to `seq`; returns True when the sequence just finished."""
    seq.token_ids.append(token)
    if seq.metrics.first_token_time is None:
        seq.metrics.first_token_time = now()
    if logprob is not None:
        seq.logprobs.append(logprob)
    previous_len = seq.text.length
    seq.text.append(detokenize_step(tokenizer, seq.token_ids, seq.features[DetokState], seq.params.skip_special_tokens))
    reason = _stop_reason(seq, token, tokenizer, previous_len, max_model_len)
    if reason is None:
        return False
    if not seq.params.skip_special_tokens and _ended_by_token(seq, token, tokenizer):
        seq.text.truncate(previous_len)  # the ending token's own text (EOS) stays out, as vLLM leaves it out
    seq.finish_reason = reason
    seq.metrics.finished_time = now()
    return True


def _stop_reason(
    seq: Sequence, token: int, tokenizer: Tokenizer, previous_len: int, max_model_len: int
) -> FinishReason | None:
    p = seq.params
    if seq.num_output_tokens >= p.min_tokens:
        if token in p.stop_token_ids:
            seq.stop_reason = token
            return FinishReason.STOP
        if not p.ignore_eos and token in tokenizer.eos_token_ids:
            return FinishReason.STOP
        if p.stop and _match_stop_string(seq, previous_len):
            return FinishReason.STOP
    grammar = seq.features.get(GrammarState)
    if grammar is not None and grammar.applies and grammar.matcher.is_terminated():
        # The grammar is complete (as in vLLM, the output ends here, min_tokens or not); a complete output is a stop
        # even when its last token also reached max_tokens.
        return FinishReason.STOP
    if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= max_model_len:
        return FinishReason.LENGTH
    return None


def _ended_by_token(seq: Sequence, token: int, tokenizer: Tokenizer) -> bool:
    p = seq.params
    return seq.stop_reason == token or (not p.ignore_eos and token in tokenizer.eos_token_ids
                                        and seq.num_output_tokens >= p.min_tokens and seq.stop_reason is None)


def _match_stop_string(seq: Sequence, previous_len: int) -> bool:
    """Finds a stop string that ends in the new text (it may start in earlier text) and truncates there."""
    p = seq.params
    for stop in p.stop:
        start = max(0, previous_len - len(stop) + 1)
        index = seq.text.tail(start).find(stop)
        if index != -1:
            seq.text.truncate(start + index + (len(stop) if p.include_stop_str_in_output else 0))
            seq.stop_reason = stop
            return True
    return False
