"""Unified token radix cache (behaviour.md §8) and the affinity a scheduler derives from it.

`UnifiedRadixCache` keeps one compressed token radix tree per namespace (a namespace is a
string; a pipeline uses one per stage, e.g. "stage-0") in native code. Each key can hold a
resident-KV entry and a recurrent-state entry, each with its logical size, recency and active
references; values are arbitrary Python objects the cache keeps alive until they are removed,
evicted or replaced.

Matching rules:

* resident entries back the longest query prefix for which SOME resident entry exists at or
  below the point the query reaches (a longer cached sequence can be sliced); the source is
  the nearest resident descendant in key order, `RadixMatch.stored_tokens` is its key length
  and `RadixMatch.stored_key` its key (the one `release_resident` takes);
* recurrent entries only match exactly: the longest query prefix that is itself a recurrent key.

Clock: inserts, `lookup_*`, `acquire_*`, `release_*` and `*_exact` advance it (`lookup_*`,
`acquire_*` and `*_exact` even on a miss); `peek_*`, `remove_*` and candidates never do.
`epoch()` reads it, so an affinity observation tagged with the epoch goes stale as soon as
the cache changes or is used.

Tokens are a sequence of ints in the int32 range or, without copying, a contiguous int32
buffer (a numpy int32 array). Bad arguments raise TypeError / ValueError before any change.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from ._validate import U32_MAX, check_str, check_uint
from ._radix import RadixCacheCore, RadixEntry, RadixMatch
from .cache_policy import CacheAffinity, StageCacheAffinity

__all__ = [
    "RadixEntry",
    "RadixMatch",
    "RadixStats",
    "UnifiedRadixCache",
    "affinity_from_radix",
]


@dataclass(frozen=True)
class RadixStats:
    """Topology and payload totals of a `UnifiedRadixCache`."""

    namespaces: int = 0
    nodes: int = 0  # non-root nodes
    token_edges: int = 0  # tokens stored on edges (shared prefixes counted once)
    splits: int = 0  # edge splits performed by inserts
    resident_entries: int = 0
    resident_tokens: int = 0  # sum of resident key lengths
    resident_logical_bytes: int = 0
    resident_active_refs: int = 0
    recurrent_entries: int = 0
    recurrent_logical_bytes: int = 0
    recurrent_active_refs: int = 0
    resident_evictions: int = 0
    recurrent_evictions: int = 0


class UnifiedRadixCache(RadixCacheCore):
    """Prefix cache of resident-KV and recurrent-state entries, one radix tree per namespace.

    insert_resident(namespace, tokens, logical_bytes, value) -> previous value or None
        (ValueError for an empty key or when the existing entry has active references);
    insert_resident_if_vacant(...) -> None when stored, else `value` back (nothing changes);
    insert_recurrent(...) -> previous value or None;
    peek_* / lookup_* / acquire_*(namespace, tokens) -> RadixMatch or None;
    release_*(namespace, exact_key) -> bool; resident_exact / recurrent_exact -> value or None;
    remove_*(namespace, exact_key) -> value or None; remove_*_where(predicate) -> count;
    lru_*_candidate() / evict_lru_*() -> RadixEntry or None (victim: no active references,
        smallest (last_used, namespace, tokens)); epoch() -> int; stats() -> RadixStats.
    """

    __slots__ = ()

    def stats(self) -> RadixStats:
        return RadixStats(*self._stats_tuple())

    def resident_entries(self) -> list[RadixEntry]:
        """Every resident entry, in (namespace, tokens) order; no recency change."""
        return self._entries(False)

    def recurrent_entries(self) -> list[RadixEntry]:
        """Every recurrent entry, in (namespace, tokens) order; no recency change."""
        return self._entries(True)

    def remove_resident_where(self, predicate: Callable[[RadixEntry], bool]) -> int:
        """Removes every resident entry the predicate accepts; returns how many went.

        The predicate sees all entries before anything is removed, so an exception from it
        leaves the cache unchanged. Removal is not eviction: counters stay as they are.
        """
        chosen = [entry for entry in self._entries(False) if predicate(entry)]
        return sum(self.remove_resident(e.namespace, e.tokens) is not None for e in chosen)

    def remove_recurrent_where(self, predicate: Callable[[RadixEntry], bool]) -> int:
        """Recurrent counterpart of `remove_resident_where`."""
        chosen = [entry for entry in self._entries(True) if predicate(entry)]
        return sum(self.remove_recurrent(e.namespace, e.tokens) is not None for e in chosen)


def affinity_from_radix(
    cache: UnifiedRadixCache,
    prompt_tokens: Sequence[int],
    *,
    stages: Iterable[tuple[int, str]],
    prefill_cost_per_token: int,
    restore_cost: int = 0,
) -> CacheAffinity:
    """Cache affinity of a prompt from the resident entries of each stage's namespace.

    `stages` lists (stage_index, namespace) pairs. Each namespace is peeked (no clock, recency
    or reference change, so ranking many waiting requests does not heat the cache); a hit
    contributes StageCacheAffinity(stage_index, min(matched, len(prompt)),
    prefill_cost_per_token, restore_cost, cache.epoch()), a miss contributes nothing, so a
    prompt no stage holds gets the empty affinity. This is the scheduler-side use of the cache
    (behaviour.md §5.2 `apply_resident_radix_affinity` is the one-stage case).
    """
    stage_list = [(check_uint("stage_index", stage_index, U32_MAX), check_str("namespace", ns))
                  for stage_index, ns in stages]
    prefill_cost_per_token = check_uint("prefill_cost_per_token", prefill_cost_per_token)
    restore_cost = check_uint("restore_cost", restore_cost)
    prompt_len = len(prompt_tokens)
    epoch = cache.epoch()
    found = []
    for stage_index, namespace in stage_list:
        hit = cache.peek_resident(namespace, prompt_tokens)
        if hit is None:
            continue
        found.append(
            StageCacheAffinity(
                stage_index=stage_index,
                matched_tokens=min(hit.matched_tokens, prompt_len),
                prefill_cost_per_token=prefill_cost_per_token,
                restore_cost=restore_cost,
                cache_epoch=epoch,
            )
        )
    return CacheAffinity(tuple(found))
