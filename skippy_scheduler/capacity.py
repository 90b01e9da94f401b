"""Per-component admission and eviction planning (behaviour.md §4).

A pure function over a snapshot of one memory component: can a request be admitted while
keeping the free-space watermarks, and which evictable cache entries should go first. Entries
are evicted cheapest-to-recompute per unit first; the density comparison is done on exact
integer cross products (exact, like 128-bit products in C; docs/behaviour.md §4), never on floats.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cmp_to_key

from ._validate import check_str as _check_str
from ._validate import check_uint

U64_MAX = (1 << 64) - 1


def _sat(value: int) -> int:
    return value if value <= U64_MAX else U64_MAX


def _sub(a: int, b: int) -> int:
    return a - b if a > b else 0


def _norm_uints(obj: object, *names: str) -> None:
    """Checks u64 fields of a frozen dataclass and stores them as plain ints (a numpy integer
    would wrap around in the sums below instead of saturating)."""
    for name in names:
        object.__setattr__(obj, name, check_uint(name, getattr(obj, name)))


@dataclass(frozen=True)
class EvictableCacheEntry:
    """A cache entry that may be evicted to make room."""

    id: str
    units: int  # capacity units the entry occupies
    recompute_cost: int  # cost units of rebuilding it after eviction
    last_used: int  # recency clock; smaller = colder

    def __post_init__(self) -> None:
        _check_str("id", self.id)
        _norm_uints(self, "units", "recompute_cost", "last_used")


@dataclass(frozen=True)
class ComponentCapacitySnapshot:
    """Occupancy of one memory component, in its own units."""

    component: str
    capacity_units: int
    active_units: int = 0  # held by running work
    pinned_cache_units: int = 0  # cache that must not be evicted
    evictable_entries: tuple[EvictableCacheEntry, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        _check_str("component", self.component)
        _norm_uints(self, "capacity_units", "active_units", "pinned_cache_units")
        entries = self.evictable_entries
        if isinstance(entries, (str, bytes)):
            raise TypeError("evictable_entries must be a sequence of EvictableCacheEntry")
        try:
            entries = tuple(entries)
        except TypeError:
            raise TypeError("evictable_entries must be a sequence of EvictableCacheEntry") from None
        for entry in entries:
            if not isinstance(entry, EvictableCacheEntry):
                raise TypeError("evictable_entries must hold EvictableCacheEntry values")
        object.__setattr__(self, "evictable_entries", entries)


@dataclass(frozen=True)
class CapacityDemand:
    """What a request needs: its own units and the free space to keep (target >= minimum)."""

    request_units: int
    minimum_free_units: int = 0
    target_free_units: int = 0

    def __post_init__(self) -> None:
        _norm_uints(self, "request_units", "minimum_free_units", "target_free_units")


@dataclass
class CapacityPlan:
    """Outcome of `plan_component_capacity` for one component."""

    component: str
    admitted: bool
    victim_ids: list[str]
    required_eviction_units: int  # units the target watermark asks to free
    evicted_units: int  # units the victims free (whole entries, so may exceed the above)
    predicted_recompute_cost: int
    projected_free_units: int
    admission_deficit_units: int  # missing units when rejected, else 0


def _eviction_order(a: EvictableCacheEntry, b: EvictableCacheEntry) -> int:
    left = a.recompute_cost * max(b.units, 1)
    right = b.recompute_cost * max(a.units, 1)
    if left != right:
        return -1 if left < right else 1
    for x, y in ((a.last_used, b.last_used), (a.recompute_cost, b.recompute_cost)):
        if x != y:
            return -1 if x < y else 1
    if a.id != b.id:
        return -1 if a.id < b.id else 1
    return 0


def plan_component_capacity(
    snapshot: ComponentCapacitySnapshot, demand: CapacityDemand
) -> CapacityPlan:
    """Admission decision and eviction victims for one component (§4)."""
    if not isinstance(snapshot, ComponentCapacitySnapshot):
        raise TypeError("snapshot must be a ComponentCapacitySnapshot")
    if not isinstance(demand, CapacityDemand):
        raise TypeError("demand must be a CapacityDemand")
    capacity = snapshot.capacity_units
    protected = _sat(snapshot.active_units + snapshot.pinned_cache_units + demand.request_units)
    available_free = _sub(capacity, protected)
    # A watermark at or above the whole pool means "whatever is left".
    minimum_free = (
        available_free if demand.minimum_free_units >= capacity else demand.minimum_free_units)
    target = available_free if demand.target_free_units >= capacity else demand.target_free_units
    target_free = min(max(target, minimum_free), capacity)

    needed = _sat(protected + minimum_free)
    if needed > capacity:
        return CapacityPlan(snapshot.component, False, [], 0, 0, 0,
                            _sub(capacity, protected), needed - capacity)

    evictable = _sat(sum(entry.units for entry in snapshot.evictable_entries))
    occupancy = _sat(protected + evictable)
    target_evict = _sub(_sat(occupancy + target_free), capacity)
    victims: list[str] = []
    evicted = cost = 0
    for entry in sorted(snapshot.evictable_entries, key=cmp_to_key(_eviction_order)):
        if evicted >= target_evict:
            break
        if entry.units == 0:
            continue
        victims.append(entry.id)
        evicted = _sat(evicted + entry.units)
        cost = _sat(cost + entry.recompute_cost)
    return CapacityPlan(snapshot.component, True, victims, target_evict, evicted, cost,
                        _sub(capacity, _sub(occupancy, evicted)), 0)
