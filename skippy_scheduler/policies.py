"""Admission and preemption policies (behaviour.md §0.3).

A scheduler asks its admission policy for the order of the waiting queue whenever the queue
changed (submit, waiting-cancel, preemption), and its preemption policy for a victim while a
memory component is over its budget. Built-in policies carry a `native_kind` (an
`AdmissionKind` or `PreemptionKind`) so the native scheduler runs them in C; their Python
methods here are the reference that code is checked against. User policies (native_kind None)
are called from Python.
"""
from __future__ import annotations

import abc
import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, ClassVar, Sequence as _Seq

from ._validate import U64_MAX, check_bool, check_optional_uint
from .cache_policy import CacheAwareCandidate

if TYPE_CHECKING:  # pragma: no cover
    from .types import SchedulerConfig

__all__ = [
    "AdmissionKind",
    "PreemptionKind",
    "AdmissionPolicy",
    "CacheAwareAdmission",
    "FcfsAdmission",
    "PriorityAdmission",
    "PreemptionPolicy",
    "VictimCandidate",
    "LowestPriorityNewest",
    "FewestComputedTokens",
]


class AdmissionKind(enum.IntEnum):
    """The admission orders the native core implements: the values of the C enum
    skippy_admission_policy (abi/skippy_scheduler_decls.h), which the compiled scheduler checks
    at import."""

    CACHE_AWARE = 0
    FCFS = 1
    PRIORITY = 2
    CALLBACK = 3  # none built in: the core asks the policy object for the order


class PreemptionKind(enum.IntEnum):
    """The victim rules the native core implements: the values of the C enum
    skippy_preemption_policy (abi/skippy_scheduler_decls.h), which the compiled scheduler
    checks at import."""

    LOWEST_PRIORITY_NEWEST = 0
    FEWEST_COMPUTED = 1
    CALLBACK = 2  # none built in: the core asks the policy object for the victim


class AdmissionPolicy(abc.ABC):
    """Orders the waiting queue; the scheduler admits front to back as capacity allows."""

    native_kind: ClassVar[AdmissionKind | None] = None

    @abc.abstractmethod
    def order(self, candidates: list[CacheAwareCandidate], current_turn: int) -> list[int]:
        """Return the candidates' `index` values, best first (a permutation of them)."""

    def resolved(self, config: "SchedulerConfig") -> "AdmissionPolicy":
        """This policy with every setting taken from `config` made concrete."""
        return self


class CacheAwareAdmission(AdmissionPolicy):
    """The default order (docs/behaviour.md §3): priority, cache value plus aging, waiting-prefix grouping.

    `None` settings take the scheduler config's `cache_aging_cost_per_iteration` and
    `group_waiting_prefixes`; an explicit aging cost of 0 gives no aging credit.
    """

    native_kind: ClassVar[AdmissionKind | None] = AdmissionKind.CACHE_AWARE
    _DEFAULT_AGING = 4096

    def __init__(self, aging_cost_per_turn: int | None = None, group_waiting_prefixes: bool | None = None):
        self.aging_cost_per_turn = check_optional_uint("aging_cost_per_turn", aging_cost_per_turn, U64_MAX)
        if group_waiting_prefixes is not None:
            check_bool("group_waiting_prefixes", group_waiting_prefixes)
        self.group_waiting_prefixes = group_waiting_prefixes

    def resolved(self, config: "SchedulerConfig") -> "CacheAwareAdmission":
        normalized = config.normalized()
        aging = self.aging_cost_per_turn
        grouping = self.group_waiting_prefixes
        return type(self)(
            normalized.cache_aging_cost_per_iteration if aging is None else aging,
            normalized.group_waiting_prefixes if grouping is None else grouping,
        )

    def order(self, candidates: list[CacheAwareCandidate], current_turn: int) -> list[int]:
        aging = self._DEFAULT_AGING if self.aging_cost_per_turn is None else self.aging_cost_per_turn
        grouping = True if self.group_waiting_prefixes is None else self.group_waiting_prefixes
        # Imported at call time because the reference package imports this module (its
        # scheduler takes policies); a top-level import would be circular.
        from .reference.ordering import order_cache_aware_candidates

        return order_cache_aware_candidates(candidates, current_turn, aging, grouping)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CacheAwareAdmission):
            return NotImplemented
        return (self.aging_cost_per_turn, self.group_waiting_prefixes) == (
            other.aging_cost_per_turn,
            other.group_waiting_prefixes,
        )

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return (
            f"CacheAwareAdmission(aging_cost_per_turn={self.aging_cost_per_turn!r}, "
            f"group_waiting_prefixes={self.group_waiting_prefixes!r})"
        )


class FcfsAdmission(AdmissionPolicy):
    """First come, first served: enqueue order (a preempted sequence gets a fresh one)."""

    native_kind: ClassVar[AdmissionKind | None] = AdmissionKind.FCFS

    def order(self, candidates: list[CacheAwareCandidate], current_turn: int) -> list[int]:
        return [c.index for c in sorted(candidates, key=lambda c: c.order)]


class PriorityAdmission(AdmissionPolicy):
    """Highest priority first, then enqueue order."""

    native_kind: ClassVar[AdmissionKind | None] = AdmissionKind.PRIORITY

    def order(self, candidates: list[CacheAwareCandidate], current_turn: int) -> list[int]:
        return [c.index for c in sorted(candidates, key=lambda c: (-c.priority, c.order))]


@dataclass(frozen=True)
class VictimCandidate:
    """An active sequence as the preemption policy sees it."""

    sequence_id: str
    priority: int
    admitted_at: int
    computed_tokens: int  # replay tokens already fed (the prefill cursor)
    generated_tokens: int  # number of generated tokens


class PreemptionPolicy(abc.ABC):
    """Chooses which active sequence gives its memory back under component pressure."""

    native_kind: ClassVar[PreemptionKind | None] = None

    @abc.abstractmethod
    def select_victim(self, candidates: list[VictimCandidate]) -> int | None:
        """Return the position in `candidates` of the victim (None: preempt nothing)."""


def _first_min(
    candidates: _Seq[VictimCandidate], key: Callable[[VictimCandidate], tuple[int, ...]]
) -> int | None:
    best = None
    best_key = None
    for position, candidate in enumerate(candidates):
        k = key(candidate)
        if best_key is None or k < best_key:
            best, best_key = position, k
    return best


class LowestPriorityNewest(PreemptionPolicy):
    """The default victim (docs/behaviour.md §2.8): lowest priority, then the most recently admitted."""

    native_kind: ClassVar[PreemptionKind | None] = PreemptionKind.LOWEST_PRIORITY_NEWEST

    def select_victim(self, candidates: list[VictimCandidate]) -> int | None:
        return _first_min(candidates, lambda c: (c.priority, -c.admitted_at))


class FewestComputedTokens(PreemptionPolicy):
    """The sequence that loses the least work: fewest computed tokens, then §2.8's order."""

    native_kind: ClassVar[PreemptionKind | None] = PreemptionKind.FEWEST_COMPUTED

    def select_victim(self, candidates: list[VictimCandidate]) -> int | None:
        return _first_min(candidates, lambda c: (c.computed_tokens, c.priority, -c.admitted_at))

