"""Admission and preemption policies (behaviour.md §0.3).

A scheduler asks its admission policy for the order of the waiting queue whenever the queue
changed (submit, waiting-cancel, preemption), and its preemption policy for a victim while a
memory component is over its budget. Built-in policies carry a `native_kind` (an
`AdmissionKind` or `PreemptionKind`) so the native scheduler runs them in C; their Python
methods here are the reference that code is checked against. User policies (native_kind None)
are called from Python. `FairShareAdmission` is native with its default inner order and a
Python policy otherwise, so its `native_kind` is set per instance.
"""
from __future__ import annotations

import abc
import enum
import heapq
import math
import numbers
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Hashable, Mapping, Sequence as _Seq

from ._validate import U64_MAX, as_float, check_bool, check_optional_uint
from .cache_policy import CacheAffinity, CacheAwareCandidate

if TYPE_CHECKING:  # pragma: no cover
    from .types import SchedulerConfig, Sequence as SequenceType

__all__ = [
    "AdmissionKind",
    "PreemptionKind",
    "AdmissionPolicy",
    "CacheAwareAdmission",
    "FairShareAdmission",
    "FcfsAdmission",
    "PriorityAdmission",
    "PreemptionPolicy",
    "VictimCandidate",
    "LowestPriorityNewest",
    "FewestComputedTokens",
    "VirtualTokenCounters",
]


class AdmissionKind(enum.IntEnum):
    """The admission orders the native core implements: the values of the C enum
    skippy_admission_policy (abi/skippy_scheduler_decls.h), which the compiled scheduler checks
    at import."""

    CACHE_AWARE = 0
    FCFS = 1
    PRIORITY = 2
    CALLBACK = 3  # none built in: the core asks the policy object for the order
    FAIR_SHARE = 4  # FairShareAdmission with the cache-aware order within a tenant


class PreemptionKind(enum.IntEnum):
    """The victim rules the native core implements: the values of the C enum
    skippy_preemption_policy (abi/skippy_scheduler_decls.h), which the compiled scheduler
    checks at import."""

    LOWEST_PRIORITY_NEWEST = 0
    FEWEST_COMPUTED = 1
    CALLBACK = 2  # none built in: the core asks the policy object for the victim


class AdmissionPolicy(abc.ABC):
    """Orders the waiting queue; the scheduler admits front to back as capacity allows."""

    # The order the core runs instead of calling `order` (None: it calls `order`).
    native_kind: AdmissionKind | None = None

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

    native_kind = AdmissionKind.CACHE_AWARE
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
        from .reference.ordering import reference_order

        return reference_order(candidates, current_turn, aging, grouping)

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

    native_kind = AdmissionKind.FCFS

    def order(self, candidates: list[CacheAwareCandidate], current_turn: int) -> list[int]:
        return [c.index for c in sorted(candidates, key=lambda c: c.order)]


class PriorityAdmission(AdmissionPolicy):
    """Highest priority first, then enqueue order."""

    native_kind = AdmissionKind.PRIORITY

    def order(self, candidates: list[CacheAwareCandidate], current_turn: int) -> list[int]:
        return [c.index for c in sorted(candidates, key=lambda c: (-c.priority, c.order))]


@dataclass(frozen=True)
class _TenantAffinity(CacheAffinity):
    """A cache affinity that also names the sequence's tenant and a stable key for it."""

    tenant: Hashable = None
    key: Hashable = None


class VirtualTokenCounters:
    """State and rules of fair-share admission (virtual token counters, as in VTC).

    Kept in one small class so that a native implementation can mirror it rule for rule:

    * **Service.** Each tenant has a counter, 0 at first. Serving a tenant `p` prefill tokens and
      `d` decode tokens adds `(prefill_cost * p + decode_cost * d) / weight(tenant)` to it
      (`charge`); a heavier weight makes the counter grow more slowly, so the tenant gets a
      proportionally larger share.
    * **Lift.** When a tenant returns to the queue (none of its queued requests was queued at
      the previous observation), its counter is raised to the smallest counter among the
      tenants that stayed queued, so idle time is not banked as credit. If no tenant stayed
      (the queue had drained), the floor is the smallest counter among the tenants queued at
      the previous observation. A counter never decreases.
    * **Order.** The tenant with the lowest counter goes first; ties go to the tenant whose
      next request was enqueued first. While a ranking is built, each pick adds its request's
      expected prefill charge (uncached prompt tokens) to a scratch copy of its tenant's counter,
      so one ranking interleaves tenants the way successive picks would.
    """

    def __init__(self, weights: Mapping[Hashable, float] | None = None, *,
                 prefill_cost: float = 1.0, decode_cost: float = 2.0,
                 default_weight: float = 1.0) -> None:
        for name, value in (("prefill_cost", prefill_cost), ("decode_cost", decode_cost)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(as_float(value)) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        self.prefill_cost = float(prefill_cost)
        self.decode_cost = float(decode_cost)
        self.default_weight = self.check_weight("default_weight", default_weight)
        self.weights = {t: self.check_weight(f"weights[{t!r}]", w)
                        for t, w in dict(weights or {}).items()}
        self.counters: dict[Hashable, float] = {}
        self.lifts = 0
        self._queued_keys: set[Hashable] = set()
        self._queued_tenants: set[Hashable] = set()

    @staticmethod
    def check_weight(name: str, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, numbers.Real) \
                or not math.isfinite(as_float(value)) or value <= 0:
            raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        return float(value)

    def blank(self) -> "VirtualTokenCounters":
        """Counters with these settings (costs, weights) and no service or observation yet."""
        return VirtualTokenCounters(self.weights, prefill_cost=self.prefill_cost,
                                    decode_cost=self.decode_cost,
                                    default_weight=self.default_weight)

    def weight(self, tenant: Hashable) -> float:
        return self.weights.get(tenant, self.default_weight)

    def counter(self, tenant: Hashable) -> float:
        return self.counters.get(tenant, 0.0)

    def cost(self, tenant: Hashable, prefill_tokens: float = 0, decode_tokens: float = 0) -> float:
        """What serving these tokens adds to the tenant's counter."""
        return (self.prefill_cost * prefill_tokens + self.decode_cost * decode_tokens) \
            / self.weight(tenant)

    def charge(self, tenant: Hashable, prefill_tokens: float = 0, decode_tokens: float = 0) -> None:
        """The tenant was served these tokens."""
        self.counters[tenant] = self.counter(tenant) + self.cost(tenant, prefill_tokens,
                                                                 decode_tokens)

    def observe_queue(self, queued: Mapping[Hashable, _Seq[Hashable]]) -> list[Hashable]:
        """Apply the lift rule to `queued` (tenant -> keys of its queued requests), then
        remember it as the previous observation. Returns the tenants that were lifted."""
        before = self._queued_keys
        returning = [t for t, keys in queued.items() if not any(k in before for k in keys)]
        back = set(returning)
        staying = [t for t in queued if t not in back]
        if staying:
            floor = min(self.counter(t) for t in staying)
        elif self._queued_tenants:
            floor = min(self.counter(t) for t in self._queued_tenants)
        else:
            floor = None
        lifted = []
        if floor is not None:
            for t in returning:
                if self.counter(t) < floor:
                    self.counters[t] = floor
                    lifted.append(t)
        self.lifts += len(lifted)
        self._queued_keys = {k for keys in queued.values() for k in keys}
        self._queued_tenants = set(queued)
        return lifted

    def interleave(self, queues: Mapping[Hashable, _Seq[tuple[int, int, float]]]) -> list[int]:
        """Merge per-tenant queues of (index, enqueue order, prefill tokens), each already in
        the tenant's own order, lowest counter first (the class docstring's Order rule)."""
        heap = []
        for seq, (tenant, items) in enumerate(queues.items()):
            if items:
                heap.append((self.counter(tenant), items[0][1], seq, tenant, 0))
        heapq.heapify(heap)
        out: list[int] = []
        while heap:
            value, _, seq, tenant, pos = heapq.heappop(heap)
            items = queues[tenant]
            index, _, prefill = items[pos]
            out.append(index)
            pos += 1
            if pos < len(items):
                value += self.cost(tenant, prefill_tokens=prefill)
                heapq.heappush(heap, (value, items[pos][1], seq, tenant, pos))
        return out


class FairShareAdmission(AdmissionPolicy):
    """Tenant fairness: the waiting tenant with the least weighted service goes first.

    The rules (service counters, the lift of a returning tenant, lowest counter first) are those
    of `VirtualTokenCounters`. Within a tenant, requests keep the order of `within` (default:
    cache-aware admission, §3, resolved against the scheduler's config).

    **Native** (docs/behaviour.md §3.6). With the default inner order (`within` exactly a
    `CacheAwareAdmission`) the policy's `native_kind` is `AdmissionKind.FAIR_SHARE`: the
    scheduler (native core or twin) keeps its own counters, seeded with this policy's weights and
    costs, and reads them back through `scheduler.tenant_counters()`. A sequence's tenant is its
    `Sequence.tenant`; a request's expected prefill is its prompt minus its prefix restore; the
    scheduler charges every row of a completed plan to the row's tenant itself, so no host call
    is needed (and `charge` on this object changes nothing the scheduler reads).

    **Python.** With any other `within` the scheduler calls `order` at every ranking, and this
    object's `counters` are the state:
    * **Tenants.** A candidate's tenant is its sequence's `Sequence.tenant` or, for a sequence
      submitted with `with_cache_affinity(FairShareAdmission.tag(affinity, tenant, key))`, the
      tagged tenant; `key` (a stable name of the request, its id) keeps the request's identity
      across preemptions. Untagged sequences without a tenant form one default tenant (None).
    * **Service.** Whoever runs the plans reports served tokens with `charge(tenant, prefill,
      decode)`. Counters advance only through it.

    Either way the policy is consulted whenever the waiting queue changed (submit, cancel,
    preemption); a ranking of an empty queue observes nothing.
    """

    def __init__(self, weights: Mapping[Hashable, float] | None = None, *,
                 within: AdmissionPolicy | None = None, prefill_cost: float = 1.0,
                 decode_cost: float = 2.0, counters: VirtualTokenCounters | None = None) -> None:
        if counters is None:
            counters = VirtualTokenCounters(weights, prefill_cost=prefill_cost,
                                            decode_cost=decode_cost)
        elif weights is not None:
            raise ValueError("give weights or counters, not both")
        if not isinstance(counters, VirtualTokenCounters):
            raise TypeError("counters must be a VirtualTokenCounters")
        if within is None:
            within = CacheAwareAdmission()
        if not isinstance(within, AdmissionPolicy):
            raise TypeError("within must be an AdmissionPolicy")
        self.counters = counters
        self.within = within
        # Only the built-in inner order runs in the core: a subclass may change its method.
        self.native_kind = AdmissionKind.FAIR_SHARE if type(within) is CacheAwareAdmission \
            else None

    @staticmethod
    def tag(affinity: CacheAffinity | None, tenant: Hashable, key: Hashable) -> CacheAffinity:
        """`affinity` (or the empty one) carrying the sequence's tenant and stable key."""
        stages = affinity.stages if affinity is not None else ()
        return _TenantAffinity(stages, tenant, key)

    @staticmethod
    def tenant_of(candidate: CacheAwareCandidate) -> Hashable:
        if candidate.tenant is not None:
            return candidate.tenant
        return getattr(candidate.affinity, "tenant", None)

    @staticmethod
    def tenant_of_sequence(seq: "SequenceType") -> Hashable:
        """The tenant a scheduler ranks and charges `seq` under: `seq.tenant`, else a tag's."""
        if seq.tenant is not None:
            return seq.tenant
        return getattr(seq.cache_affinity, "tenant", None)

    @staticmethod
    def key_of(candidate: CacheAwareCandidate) -> Hashable:
        key = getattr(candidate.affinity, "key", None)
        return ("enqueue-order", candidate.order) if key is None else key

    def charge(self, tenant: Hashable, prefill_tokens: float = 0, decode_tokens: float = 0) -> None:
        self.counters.charge(tenant, prefill_tokens, decode_tokens)

    def resolved(self, config: "SchedulerConfig") -> "FairShareAdmission":
        # The counters are shared, so a host charging this object charges the scheduler's copy.
        return FairShareAdmission(within=self.within.resolved(config), counters=self.counters)

    def _within_order(self, candidates: list[CacheAwareCandidate], current_turn: int) -> list[int]:
        within = self.within
        if type(within) is CacheAwareAdmission:
            # The native ranking kernel gives the order CacheAwareAdmission.order's reference
            # walk gives (the ordering tests check them against each other), without walking
            # long shared prompts token by token in Python.
            from .cache_policy import order_cache_aware_candidates

            aging = within.aging_cost_per_turn
            grouping = within.group_waiting_prefixes
            return order_cache_aware_candidates(
                candidates, current_turn, within._DEFAULT_AGING if aging is None else aging,
                True if grouping is None else grouping)
        return within.order(candidates, current_turn)

    def order(self, candidates: list[CacheAwareCandidate], current_turn: int) -> list[int]:
        return self.rank(candidates, current_turn,
                         [self.tenant_of(c) for c in candidates],
                         [self.key_of(c) for c in candidates],
                         [max(len(c.prompt_tokens) - c.affinity.matched_tokens(), 0)
                          for c in candidates])

    def rank(self, candidates: list[CacheAwareCandidate], current_turn: int,
             tenants: _Seq[Hashable], keys: _Seq[Hashable], uncached: _Seq[int]) -> list[int]:
        """`order` with each candidate's tenant, stable request key and expected prefill
        tokens given (lists parallel to `candidates`): apply the lift rule, then interleave the
        tenants' inner orders."""
        if not candidates:
            return []  # nothing queued is not an observation (the lift rule's drained case)
        position = {c.index: k for k, c in enumerate(candidates)}
        queues: dict[Hashable, list[tuple[int, int, float]]] = {}
        queued: dict[Hashable, list[Hashable]] = {}
        for index in self._within_order(candidates, current_turn):
            k = position[index]
            tenant = tenants[k]
            queues.setdefault(tenant, []).append((index, candidates[k].order, uncached[k]))
            queued.setdefault(tenant, []).append(keys[k])
        self.counters.observe_queue(queued)
        return self.counters.interleave(queues)

    def __repr__(self) -> str:
        return (f"FairShareAdmission(within={self.within!r}, "
                f"weights={self.counters.weights!r})")


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

