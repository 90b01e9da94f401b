"""The reference scheduler's cold prefix hold (behaviour.md §2.3a; native: csrc/sk_hold.c).

Owns `ColdPrefixHold`: with a prefix store attached and `cold_prefix_hold_tokens` = H > 0, the
admission walk holds a waiting sequence W when an active sequence (its leader) has the same
first restore(W) + H prompt tokens, is computing its prompt or decoding (not a recompute still
replaying), and, if held on already, has fewer than max_inflight_plans confirmed tokens more
than when it was first held on, and was not itself admitted after a hold that gained it nothing
while its leader stayed active; W is held in at most `cold_prefix_hold_max_steps` plans. A
leader held on with a token confirmed since its admission is a keep `take` reports, once, while
it is active.
The pass of preemption for priority (priority.py) leaves what the walk held waiting and puts what
it would admit to the same rule.
"""
from __future__ import annotations

from typing import Callable, Iterable

from .._validate import sat
from ..types import SchedulerConfig, Sequence
from .plan import Flight
from .planning import prefill_pending

LEAD_NONE, LEAD_HELD_ON, LEAD_REPORTED = 0, 1, 2


class ColdPrefixHold:
    """The hold rule and the leaders to report."""

    def __init__(self, config: SchedulerConfig, flight: Callable[[Sequence], Flight]) -> None:
        self.tokens = config.cold_prefix_hold_tokens
        self.max_steps = config.cold_prefix_hold_max_steps
        self.depth = config.max_inflight_plans
        self._flight = flight
        self._leaders = 0  # marked and not reported
        self.walks = 0  # admission walks made (the scheduler counts them)

    def holds(self, w: Sequence, active: Iterable[Sequence]) -> bool:
        """Whether the walk defers `w` now (it counts as one more plan held, and marks the
        leader). Only called with a store attached and H > 0."""
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
            if fa.no_lead:
                continue  # admitted after a hold that gained it nothing
            confirmed = len(a.generated_tokens) - fa.pending
            if fa.lead == LEAD_NONE:
                # a prompt being computed, or a live decode (a late leader: its keep comes
                # with its next confirmed token); not a recompute still replaying
                if confirmed and prefill_pending(a):
                    continue
            elif confirmed >= fa.lead_base + self.depth:
                continue  # led for the plans made before its keep could be applied
            if len(a.prompt_tokens) < need or a.prompt_tokens[:need] != prefix:
                continue
            if fa.lead == LEAD_NONE:
                fa.lead = LEAD_HELD_ON
                fa.lead_base = confirmed
                self._leaders += 1
            fw.held_steps += 1
            fw.held_walk = self.walks
            fw.held_restore = restored
            fw.held_on = (a.id, a.admitted_at)
            return True
        return False

    def take(self, active: Iterable[Sequence]) -> list[tuple[str, int]]:
        """(id, prompt length) of the active leaders held on with a token confirmed since their
        admission (so every row planned before, the prompt's included, has run), in walk order,
        each once."""
        if not self._leaders:
            return []
        out = []
        waiting = 0
        for a in active:
            fa = self._flight(a)
            if fa.lead != LEAD_HELD_ON:
                continue
            if len(a.generated_tokens) - fa.pending > fa.admit_gen:
                fa.lead = LEAD_REPORTED
                out.append((a.id, len(a.prompt_tokens)))
            else:
                waiting += 1
        self._leaders = waiting
        return out
