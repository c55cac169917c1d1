"""vLLM's `thinking_token_budget`: a reasoning model's thought takes at most N tokens; then its end marker is forced,
token by token, and the model answers from there.

The thought is open from the output's start when the prompt opened it (DeepSeek-R1's and Qwen3.5's templates end with
`<think>`), or from the start marker the model writes itself (older Qwen3 templates); a prompt that closed it
(`enable_thinking: false`) starts no budget. The count stops, and nothing is forced, once the model closes the thought
on its own. While a budget can still force a token, the sequence's next token is decided on the host (no step is
launched ahead, no draft is speculated for it), as for a grammar.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedserve.engine.core.seq_features import SeqFeature
from pagedserve.engine.reasoning import ThoughtMarker

if TYPE_CHECKING:  # the core's stop rules import this module
    from pagedserve.engine.core.sequence import Sequence


@dataclass(slots=True)
class ThoughtBudget(SeqFeature):
    left: int  # tokens the open thought may still take
    start: ThoughtMarker  # what opens the thought (watched while it is not open yet)
    end: ThoughtMarker  # what closes it: stops the count when the model writes it; forced once `left` is spent
    opened: bool  # the thought is open (else: waiting for the model to open it)
    forced: int = 0  # end.token_ids forced so far
    done: bool = False  # the thought closed: the budget has nothing more to do

    @property
    def watch_chars(self) -> int:
        """How far back a new token's text may complete a marker."""
        return max(self.start.reach, self.end.reach)

    @property
    def active(self) -> bool:
        return not self.done

    @property
    def forcing(self) -> int | None:
        """The token the next step must take (None: the model picks)."""
        return self.end.token_ids[self.forced] if not self.done and self.opened and self.left <= 0 else None

    def note(self, token: int, tail: str) -> None:
        """After each appended token: `tail`, the output's text from where a marker could have started."""
        if self.done:
            return
        if not self.opened:
            self.opened = self.start.seen(token, tail)
            return
        if self.forcing is not None:
            self.forced += 1
            self.done = self.forced == len(self.end.token_ids)
        elif self.end.seen(token, tail):
            self.done = True
        else:
            self.left -= 1

    def fork(self, index: int) -> ThoughtBudget:
        return ThoughtBudget(self.left, self.start, self.end, self.opened, self.forced, self.done)


def budget_active(seq: Sequence) -> bool:
    budget = seq.features.get(ThoughtBudget)
    return budget is not None and budget.active


def forced_token(seq: Sequence) -> int | None:
    """The token `seq`'s spent budget forces next (None: none)."""
    budget = seq.features.get(ThoughtBudget)
    return budget.forcing if budget is not None else None
