"""Server-side queue of cache restore / prefill runtime operations (behaviour.md §8b).

Operations are ranked with the same cache-aware order as admission (§3). Affinity observed at
enqueue time goes stale as the prefix cache changes, so right before each selection every
operation with a refresh callback is re-observed; a changed observation replaces the stored
one, flags the operation `stale_affinity_fallback` and forces a re-rank. Ranked operations are
kept in reverse order so that taking the best is a pop from the end.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from ._rank import RankSlots
from ._validate import check_bool, check_uint
from .cache_policy import CacheAffinity


@dataclass(frozen=True)
class CacheRuntimeTelemetry:
    """What was known about an operation's cache value when it was selected."""

    matched_tokens: int  # prompt tokens already cached, summed over stages
    saved_cost: int  # estimated prefill cost the hits save
    age_turns: int  # queue turns the operation waited
    stage_hits: int  # stages with at least one matched token
    cache_epoch: int  # newest cache epoch among the stage observations (0 if none)
    stale_affinity_fallback: bool  # the enqueue-time affinity was replaced by a refresh


class _Entry:
    __slots__ = ("operation", "affinity", "refresh", "enqueued_turn", "order", "stale")

    def __init__(self, operation: Any, affinity: CacheAffinity,
                 refresh: Optional[Callable[[], CacheAffinity]], enqueued_turn: int, order: int) -> None:
        self.operation = operation
        self.affinity = affinity
        self.refresh = refresh
        self.enqueued_turn = enqueued_turn
        self.order = order
        self.stale = False


def _check_affinity(value: object) -> CacheAffinity:
    if not isinstance(value, CacheAffinity):
        raise TypeError(f"affinity must be a CacheAffinity, got {type(value).__name__}")
    return value


class CacheRuntimeQueue:
    """Cache-aware queue of runtime operations with stale-affinity refresh."""

    def __init__(self, aging_cost_per_turn: int, group_waiting_prefixes: bool) -> None:
        self._aging = check_uint("aging_cost_per_turn", aging_cost_per_turn)
        self._grouping = check_bool("group_waiting_prefixes", group_waiting_prefixes)
        self._turn = 0
        self._next_order = 0
        self._dirty = False
        self._entries: list[_Entry] = []  # parallel to self._slots
        self._slots = RankSlots()

    @classmethod
    def from_config(cls, config: Any) -> "CacheRuntimeQueue":
        """Takes `cache_aging_cost_per_iteration` and `group_waiting_prefixes` from a config."""
        normalized = getattr(config, "normalized", None)
        if callable(normalized):
            config = normalized()
        return cls(config.cache_aging_cost_per_iteration, config.group_waiting_prefixes)

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def turn(self) -> int:
        return self._turn

    def push(
        self,
        operation: Any,
        prompt_tokens: Sequence[int],
        priority: int,
        affinity: CacheAffinity,
        refresh: Optional[Callable[[], CacheAffinity]] = None,
    ) -> None:
        check_uint("priority", priority)
        _check_affinity(affinity)
        if refresh is not None and not callable(refresh):
            raise TypeError("refresh must be callable or None")
        self._slots.append(priority, affinity.estimated_saved_cost(), self._turn,
                           self._next_order, prompt_tokens)
        self._entries.append(_Entry(operation, affinity, refresh, self._turn, self._next_order))
        self._next_order += 1
        self._dirty = True

    def advance_turn(self) -> None:
        self._turn = min(self._turn + 1, (1 << 64) - 1)

    def _refresh(self) -> None:
        # Every callback runs (and is checked) before anything is replaced, so a failing
        # callback leaves the queue as it was.
        fresh = []
        for i, entry in enumerate(self._entries):
            if entry.refresh is not None:
                fresh.append((i, _check_affinity(entry.refresh())))
        for i, affinity in fresh:
            entry = self._entries[i]
            if affinity != entry.affinity:
                entry.affinity = affinity
                entry.stale = True
                self._slots.set_saved_cost(i, affinity.estimated_saved_cost())
                self._dirty = True

    def pop_next(self) -> Optional[tuple[Any, CacheRuntimeTelemetry]]:
        if not self._entries:
            return None
        self._refresh()
        if self._dirty:
            ranked = self._slots.order(self._turn, self._aging, self._grouping)
            self._slots.reverse_to(ranked)
            self._entries = [self._entries[p] for p in reversed(ranked)]
            self._dirty = False
        entry = self._entries.pop()
        self._slots.pop()
        stages = entry.affinity.stages
        telemetry = CacheRuntimeTelemetry(
            matched_tokens=entry.affinity.matched_tokens(),
            saved_cost=entry.affinity.estimated_saved_cost(),
            age_turns=max(0, self._turn - entry.enqueued_turn),
            stage_hits=sum(1 for s in stages if s.matched_tokens > 0),
            cache_epoch=max((s.cache_epoch for s in stages), default=0),
            stale_affinity_fallback=entry.stale,
        )
        return entry.operation, telemetry


def should_serve_cache_runtime(
    has_cache_op: bool, has_iteration_work: bool, last_served_cache_op: bool
) -> bool:
    """Strict alternation when both kinds of work wait; otherwise serve whatever exists."""
    check_bool("has_cache_op", has_cache_op)
    check_bool("has_iteration_work", has_iteration_work)
    check_bool("last_served_cache_op", last_served_cache_op)
    if has_cache_op and has_iteration_work:
        return not last_served_cache_op
    return has_cache_op
