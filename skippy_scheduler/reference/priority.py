"""The reference scheduler's preemption for priority (behaviour.md §2.8a), a departure from the
reference rule, on only with `SchedulerConfig.priority_preemption`.

Owns `preempt_for_priority`: after the admission pass, each waiting sequence in queue order
that still cannot be admitted takes the lanes and memory it lacks from running sequences of
strictly lower priority (lowest priority first, then the most recently admitted), no more than
it needs and none when the eligible victims cannot make it fit; a sequence preempted for
priority is safe from it for `priority_preemption_guard_steps` plans, and one plan makes at most
`max_priority_preemptions_per_step` such preemptions. Under the cold prefix hold (hold.py) a
sequence the admission walk held stays waiting, and one this pass would admit is first put to
the hold: held, it is not admitted and takes no victim.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from .._validate import sat
from ..types import Sequence

if TYPE_CHECKING:
    from .scheduler import TwinScheduler


def _guarded(sched: "TwinScheduler", s: Sequence, step: int) -> bool:
    at = sched._flights[s.id].priority_preempted_at
    return at is not None and step - at < sched._config.priority_preemption_guard_steps


def _pick(sched: "TwinScheduler", want: Sequence, chosen: list[Sequence],
          step: int) -> Optional[Sequence]:
    eligible = [s for s in sched._active.values()
                if s.priority < want.priority and not _guarded(sched, s, step)
                and all(s is not c for c in chosen)]
    if not eligible:
        return None
    return min(eligible, key=lambda s: (s.priority, -(s.admitted_at or 0)))


def _admissible(sched: "TwinScheduler", used: list[int], freed: int, want: Sequence) -> bool:
    if len(sched._active) - freed >= sched._config.max_active_sequences:
        return False
    ledger = sched._memory
    saved, ledger.used = ledger.used, used
    try:
        return ledger.fits(ledger.reservation(want))
    finally:
        ledger.used = saved


def preempt_for_priority(sched: "TwinScheduler", step: int) -> int:
    """Runs the pass over `sched`'s waiting queue for plan `step`; returns the admissions."""
    budget = sched._config.max_priority_preemptions_per_step
    if budget == 0 or not sched._waiting or not sched._active:
        return 0
    admitted, taken = 0, 0
    kept: list[Sequence] = []
    victims: list[Sequence] = []
    hold = sched._hold if sched._hold.tokens and sched._link.store is not None else None
    for want in sched._waiting:
        if hold is not None and sched._flights[want.id].held_walk == hold.walks:
            kept.append(want)  # held by this plan's admission walk: no admission, no victims
            continue
        admit = _admissible(sched, sched._memory.used, 0, want)
        chosen: list[Sequence] = []
        if admit:
            admit = not (hold is not None and hold.holds(want, sched._active.values()))
        elif taken < budget:
            used = list(sched._memory.used)
            while not _admissible(sched, used, len(chosen), want) and taken + len(chosen) < budget:
                v = _pick(sched, want, chosen, step)
                if v is None:
                    break
                used = sched._memory.without(used, v)
                chosen.append(v)
            # What would admit it is put to the hold as the walk does (§2.3a).
            admit = (_admissible(sched, used, len(chosen), want)
                     and not (hold is not None and hold.holds(want, sched._active.values())))
            if admit and chosen:
                sched._memory.used = used
                for v in chosen:
                    sched._requeue_victim(v)
                    sched._flights[v.id].priority_preempted_at = step
                    m = sched._metrics
                    m.preempted_priority = sat(m.preempted_priority + 1)
                victims.extend(chosen)
                taken += len(chosen)
        if not admit:
            kept.append(want)
            continue
        sched._admit_one(want)
        admitted += 1
    # Victims first (the last one at the front), then the sequences still waiting.
    sched._waiting = victims[::-1] + kept
    sched._priority_victims = [v.id for v in victims]
    return admitted
