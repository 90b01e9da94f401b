"""Cache-affinity types and the cache-aware ordering of waiting work (behaviour.md §1.6, §3).

An affinity is a per-stage vector so that split pipeline stages score their own prefix hits;
its value is the prefill work a hit saves minus the cost of restoring it.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Hashable, Iterable, Sequence as _Seq

from ._validate import U32_MAX, U64_MAX, check_bool, check_uint, sat


@dataclass(frozen=True)
class StageCacheAffinity:
    """Prefix-cache observation of one pipeline stage for one prompt."""

    stage_index: int = 0
    matched_tokens: int = 0  # prompt tokens the stage's cache already holds
    prefill_cost_per_token: int = 0  # cost units one prefilled token takes
    restore_cost: int = 0  # cost units of restoring the matched prefix
    cache_epoch: int = 0  # cache epoch the observation was taken at (carried only)

    def __post_init__(self) -> None:
        # Python ints only: the fields are kept as given, and the scores multiply them.
        check_uint("stage_index", self.stage_index, U32_MAX, exact=True)
        check_uint("matched_tokens", self.matched_tokens, exact=True)
        check_uint("prefill_cost_per_token", self.prefill_cost_per_token, exact=True)
        check_uint("restore_cost", self.restore_cost, exact=True)
        check_uint("cache_epoch", self.cache_epoch, exact=True)

    def estimated_saved_cost(self) -> int:
        return max(0, sat(self.matched_tokens * self.prefill_cost_per_token) - self.restore_cost)


@dataclass(frozen=True)
class CacheAffinity:
    """Per-stage affinity vector; empty means no cache knowledge (a cold request)."""

    stages: tuple[StageCacheAffinity, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        stages = tuple(self.stages)
        for stage in stages:
            if not isinstance(stage, StageCacheAffinity):
                raise TypeError("CacheAffinity.stages must hold StageCacheAffinity values")
        object.__setattr__(self, "stages", stages)

    @classmethod
    def from_stage(cls, stage: StageCacheAffinity) -> "CacheAffinity":
        return cls((stage,))

    def estimated_saved_cost(self) -> int:
        return sat(sum(s.estimated_saved_cost() for s in self.stages))

    def matched_tokens(self) -> int:
        return sat(sum(s.matched_tokens for s in self.stages))


@dataclass(frozen=True)
class CacheAwareCandidate:
    """One waiting request as the ordering sees it; `index` is returned in the order."""

    index: int
    priority: int = 0
    affinity: CacheAffinity = field(default_factory=CacheAffinity)
    prompt_tokens: _Seq[int] = ()
    enqueued_turn: int = 0
    order: int = 0
    tenant: Hashable = None  # the sequence's `Sequence.tenant` (fair-share admission)
    # The sequence's `Sequence.ttft_deadline` (seconds on the scheduler's clock, None = none):
    # nearer first among equal priority and score (docs/behaviour.md §3.3a).
    ttft_deadline: float | None = None


def ttft_deadline_key(ttft_deadline: object) -> int:
    """The u64 ranking key of a TTFT deadline in seconds (docs/behaviour.md §3.3a).

    The deadline in microseconds as the core holds it (`seconds * 1e6`), as the bits of the
    double, which order as the values do for positive doubles; None gives U64_MAX (last).
    TypeError / ValueError unless None or a finite number > 0.
    """
    from .slack import check_optional_seconds

    seconds = check_optional_seconds("ttft_deadline", ttft_deadline)
    if seconds is None:
        return U64_MAX
    micros = seconds * 1e6
    if not micros > 0.0:  # the core reads 0 as "no deadline"
        return U64_MAX
    return int.from_bytes(struct.pack("<d", micros), "little")


def _check_candidates(candidates: object) -> list[CacheAwareCandidate]:
    if isinstance(candidates, (str, bytes)):
        raise TypeError("candidates must be an iterable of CacheAwareCandidate")
    try:
        items: list[CacheAwareCandidate] = list(candidates)  # type: ignore[call-overload]
    except TypeError:
        raise TypeError("candidates must be an iterable of CacheAwareCandidate") from None
    for item in items:
        if not isinstance(item, CacheAwareCandidate):
            raise TypeError(
                f"candidates must be CacheAwareCandidate values, got {type(item).__name__}")
    return items


def order_cache_aware_candidates(
    candidates: Iterable[CacheAwareCandidate],
    current_turn: int,
    aging_cost_per_turn: int,
    group_waiting_prefixes: bool,
) -> list[int]:
    """The candidates' `index` values, best first (§3.3), ranked by the native kernel.

    Keys: priority desc; grouping score (or effective score without grouping) desc; TTFT
    deadline asc (none last, §3.3a); the waiting-prefix DFS rank when grouping and the prompts
    differ; effective score desc; order asc; then input position. Raises TypeError / ValueError for malformed input (prompt tokens
    must be ints in the i32 range, every other field a u64).
    """
    from ._rank import order_candidates

    items = _check_candidates(candidates)
    turn = check_uint("current_turn", current_turn)
    aging = check_uint("aging_cost_per_turn", aging_cost_per_turn)
    grouping = check_bool("group_waiting_prefixes", group_waiting_prefixes)
    return order_candidates(items, turn, aging, grouping)


def select_cache_aware_candidate(
    candidates: Iterable[CacheAwareCandidate],
    current_turn: int,
    aging_cost_per_turn: int,
    group_waiting_prefixes: bool,
) -> int | None:
    """The best candidate's `index`, or None when there is no candidate."""
    order = order_cache_aware_candidates(
        candidates, current_turn, aging_cost_per_turn, group_waiting_prefixes)
    return order[0] if order else None
