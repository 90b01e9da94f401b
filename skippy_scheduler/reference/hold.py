"""The reference scheduler's cold prefix hold (behaviour.md §2.3a; native: csrc/sk_hold.c).

Owns `ColdPrefixHold`: with a prefix store attached and `cold_prefix_hold_tokens` = H > 0, the
admission walk holds a waiting sequence W when an active sequence (its leader) has the same
first restore(W) + H prompt tokens and has no confirmed generated token yet (or, held on, got
its first one within the last max_inflight_plans - 1 plans); W is held in at most `cold_prefix_hold_max_steps` plans. A leader's first token makes
its prompt a keep to report (`take`), once, while it is active.
"""
from __future__ import annotations

from typing import Callable, Iterable

from .._validate import sat
from ..types import SchedulerConfig, Sequence
from .plan import Flight

LEAD_NONE, LEAD_HELD_ON, LEAD_READY, LEAD_REPORTED = 0, 1, 2, 3


class ColdPrefixHold:
    """The hold rule and the leaders to report."""

    def __init__(self, config: SchedulerConfig, flight: Callable[[Sequence], Flight]) -> None:
        self.tokens = config.cold_prefix_hold_tokens
        self.max_steps = config.cold_prefix_hold_max_steps
        self.window = config.max_inflight_plans - 1
        self._flight = flight
        self._ready = 0

    def holds(self, w: Sequence, active: Iterable[Sequence], turn: int) -> bool:
        """Whether the walk of the plan at waiting `turn` defers `w` now (it counts as one more
        plan held, and marks the leader). Only called with a store attached and H > 0."""
        fw = self._flight(w)
        if fw.held_steps >= self.max_steps:
            return False
        restored = w.prefix_restore.token_count if w.prefix_restore is not None else 0
        need = sat(restored + self.tokens)
        if need > len(w.prompt_tokens):
            return False
        prefix = w.prompt_tokens[:need]
        for a in active:
            fa = self._flight(a)
            confirmed = len(a.generated_tokens) - fa.pending
            # with a token, it leads for the plans made before its keep can be applied
            if confirmed and (fa.lead == LEAD_NONE or sat(fa.lead_turn + self.window) < turn):
                continue
            if len(a.prompt_tokens) < need:
                continue
            if a.prompt_tokens[:need] != prefix:
                continue
            if fa.lead == LEAD_NONE:
                fa.lead = LEAD_HELD_ON
            fw.held_steps += 1
            return True
        return False

    def first_token(self, fl: Flight, turn: int) -> None:
        """A token of the sequence of `fl` was confirmed; the last plan made had `turn`."""
        if fl.lead == LEAD_HELD_ON:
            fl.lead = LEAD_READY
            fl.lead_turn = turn
            self._ready += 1

    def take(self, active: Iterable[Sequence]) -> list[tuple[str, int]]:
        """(id, prompt length) of the ready leaders still active, in walk order, each once."""
        if not self._ready:
            return []
        out = []
        for a in active:
            fa = self._flight(a)
            if fa.lead == LEAD_READY:
                fa.lead = LEAD_REPORTED
                out.append((a.id, len(a.prompt_tokens)))
        self._ready = 0
        return out
