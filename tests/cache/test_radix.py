"""UnifiedRadixCache (behaviour.md §8), its affinity helper and the §5.5 radix fixture.

Every behaviour is checked on the native cache; the property test at the end replays random
operation sequences on the native cache and on the flat pure-Python twin (the oracle).
"""
from __future__ import annotations

import dataclasses
import gc
import weakref

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from skippy_scheduler.radix import (
    RadixEntry,
    RadixMatch,
    RadixStats,
    UnifiedRadixCache,
    affinity_from_radix,
)
from skippy_scheduler.reference import RadixTwin
from skippy_scheduler.cache_policy import CacheAffinity, StageCacheAffinity

U64_MAX = (1 << 64) - 1


def make_cache(*entries, kind="resident"):
    """Cache holding (namespace, tokens, bytes, value) entries inserted in order."""
    cache = UnifiedRadixCache()
    for namespace, tokens, nbytes, value in entries:
        getattr(cache, f"insert_{kind}")(namespace, tokens, nbytes, value)
    return cache


# -- insertion ------------------------------------------------------------------------------

def test_insert_returns_previous_value_and_advances_clock():
    cache = UnifiedRadixCache()
    assert cache.epoch() == 0
    assert cache.insert_resident("s", [1, 2], 10, "a") is None
    assert cache.epoch() == 1
    assert cache.insert_resident("s", [1, 2], 20, "b") == "a"
    assert cache.epoch() == 2
    hit = cache.peek_resident("s", [1, 2])
    assert (hit.value, hit.logical_bytes, hit.active_refs) == ("b", 20, 0)
    assert cache.insert_recurrent("s", [1, 2], 5, "r") is None
    assert cache.insert_recurrent("s", [1, 2], 6, "r2") == "r"
    assert cache.epoch() == 4
    assert cache.stats().resident_entries == 1 and cache.stats().recurrent_entries == 1


def test_empty_key_is_rejected_without_state_change():
    cache = UnifiedRadixCache()
    for insert in (cache.insert_resident, cache.insert_resident_if_vacant,
                   cache.insert_recurrent):
        with pytest.raises(ValueError, match="radix cache key must contain at least one token"):
            insert("s", [], 0, "x")
    assert cache.epoch() == 0
    assert cache.stats() == RadixStats()


def test_active_resident_entry_cannot_be_replaced():
    cache = make_cache(("stage", [1], 10, "old"))
    assert cache.acquire_resident("stage", [1]).active_refs == 1
    epoch = cache.epoch()
    with pytest.raises(ValueError, match="cannot replace an active resident radix entry"):
        cache.insert_resident("stage", [1], 20, "replacement")
    assert cache.epoch() == epoch
    assert cache.insert_resident_if_vacant("stage", [1], 20, "rejected") == "rejected"
    assert cache.epoch() == epoch
    existing = cache.lookup_resident("stage", [1])
    assert (existing.value, existing.active_refs) == ("old", 1)
    assert cache.release_resident("stage", [1])
    assert cache.insert_resident("stage", [1], 20, "replacement") == "old"
    # recurrent inserts have no active check
    cache.insert_recurrent("stage", [1], 1, "r")
    cache.acquire_recurrent("stage", [1])
    assert cache.insert_recurrent("stage", [1], 1, "r2") == "r"


def test_insert_if_vacant_inserts_only_into_a_vacant_key():
    cache = UnifiedRadixCache()
    assert cache.insert_resident_if_vacant("s", [4, 5], 3, "first") is None
    assert cache.epoch() == 1
    assert cache.insert_resident_if_vacant("s", [4, 5], 9, "second") == "second"
    assert cache.epoch() == 1
    assert cache.resident_exact("s", [4, 5]) == "first"
    # a node created by a split, or holding only a recurrent entry, is vacant for residents
    cache.insert_recurrent("s", [7, 8], 1, "rec")
    assert cache.insert_resident_if_vacant("s", [7, 8], 2, "res") is None
    cache.insert_resident("s", [4, 6], 1, "sibling")  # splits [4, 5] at [4]
    assert cache.insert_resident_if_vacant("s", [4], 1, "branch") is None
    assert cache.resident_exact("s", [4]) == "branch"


def test_splits_are_counted_and_longest_prefix_crosses_them():
    cache = make_cache(("model-a", [1, 2, 3, 4], 40, "long"),
                       ("model-a", [1, 2], 20, "shared"),
                       ("model-a", [1, 9], 20, "branch"))
    assert cache.stats().splits == 2
    exact = cache.lookup_resident("model-a", [1, 2, 3, 4, 5])
    assert (exact.matched_tokens, exact.value) == (4, "long")
    shared = cache.lookup_resident("model-a", [1, 2, 8])
    assert (shared.matched_tokens, shared.value) == (2, "shared")
    assert cache.lookup_resident("model-a", [1, 7]).matched_tokens == 1
    assert cache.stats().splits == 2
    stats = cache.stats()
    assert (stats.nodes, stats.token_edges) == (4, 5)  # [1], [2], [3,4], [9]


# -- matching -------------------------------------------------------------------------------

def test_longer_cached_entry_is_sliced_on_mid_edge_divergence():
    cache = make_cache(("model-a", [1, 2, 3, 4], 40, "long"))
    divergent = cache.lookup_resident("model-a", [1, 2, 9, 10])
    assert divergent.matched_tokens == 2
    assert divergent.stored_tokens == 4
    assert divergent.stored_key == (1, 2, 3, 4)
    assert divergent.value == "long"
    shorter = cache.lookup_resident("model-a", [1, 2])
    assert (shorter.matched_tokens, shorter.stored_tokens) == (2, 4)
    assert cache.peek_resident("model-a", [9, 1, 2]) is None


def test_branch_point_divergence_uses_nearest_descendant_in_key_order():
    cache = make_cache(("m", [1, 2, 5, 6], 40, "right"), ("m", [1, 2, 3, 4], 40, "left"))
    hit = cache.peek_resident("m", [1, 2, 7, 8])
    assert hit.matched_tokens == 2
    assert hit.stored_key == (1, 2, 3, 4) and hit.value == "left"
    # deeper descendants: the smaller next token wins even if its entry is deeper
    cache = make_cache(("m", [5, 1, 9, 9], 1, "nine"), ("m", [5, 1, 2, 7, 7], 1, "two"))
    hit = cache.peek_resident("m", [5, 1, 4])
    assert (hit.matched_tokens, hit.stored_tokens, hit.value) == (2, 5, "two")
    # an entry exactly at the reached point is its own nearest descendant
    cache = make_cache(("m", [1, 2, 3], 1, "deep"), ("m", [1, 2], 1, "here"))
    hit = cache.peek_resident("m", [1, 2, 9])
    assert (hit.matched_tokens, hit.stored_key, hit.value) == (2, (1, 2), "here")
    # negative tokens order before positive ones
    cache = make_cache(("m", [1, 5], 1, "pos"), ("m", [1, -5], 1, "neg"))
    assert cache.peek_resident("m", [1, 0]).value == "neg"


def test_match_length_is_the_longest_common_prefix_with_any_resident_key():
    """The walk passes a branch whose resident entry lies off the query path: the common part
    up to that branch is still backed (a recurrent-only subtree further down backs nothing)."""
    cache = UnifiedRadixCache()
    cache.insert_resident("m", [1], 1, "short")
    cache.insert_resident("m", [1, 2, 5], 1, "side")
    cache.insert_recurrent("m", [1, 2, 3], 1, "rec")
    hit = cache.peek_resident("m", [1, 2, 3, 4])
    assert (hit.matched_tokens, hit.stored_key, hit.value) == (2, (1, 2, 5), "side")
    assert cache.peek_recurrent("m", [1, 2, 3, 4]).matched_tokens == 3


def test_recurrent_matching_needs_an_exact_entry_on_the_path():
    cache = make_cache(("s", [1, 2], 2, "two"), ("s", [1, 2, 3, 4], 4, "four"),
                       kind="recurrent")
    hit = cache.peek_recurrent("s", [1, 2, 3])
    assert (hit.matched_tokens, hit.stored_tokens, hit.stored_key, hit.value) == (
        2, 2, (1, 2), "two")
    hit = cache.peek_recurrent("s", [1, 2, 3, 4, 5])
    assert (hit.matched_tokens, hit.stored_key, hit.value) == (4, (1, 2, 3, 4), "four")
    assert cache.peek_recurrent("s", [1]) is None
    assert cache.peek_recurrent("s", [1, 3]) is None
    assert cache.peek_resident("s", [1, 2]) is None


def test_namespaces_are_hard_boundaries_and_share_nodes_across_kinds():
    cache = make_cache(("model-a", [1, 2, 3], 3, "a"), ("model-b", [1, 2], 2, "b"))
    assert cache.lookup_resident("model-a", [1, 2, 3, 4]).value == "a"
    assert cache.lookup_resident("model-b", [1, 2, 3, 4]).value == "b"
    assert cache.lookup_resident("model-c", [1, 2, 3]) is None

    cache = UnifiedRadixCache()
    cache.insert_resident("stage", [7, 8, 9], 10, "resident")
    cache.insert_recurrent("stage", [7, 8, 9], 20, "recurrent")
    assert cache.lookup_resident("stage", [7, 8, 9, 10]).value == "resident"
    assert cache.lookup_recurrent("stage", [7, 8, 9, 10]).value == "recurrent"
    assert cache.stats() == RadixStats(
        namespaces=1, nodes=1, token_edges=3, resident_entries=1, resident_tokens=3,
        resident_logical_bytes=10, recurrent_entries=1, recurrent_logical_bytes=20)


# -- clock and recency ----------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["resident", "recurrent"])
def test_peeks_do_not_heat_lru_or_move_the_epoch(kind):
    cache = make_cache(("stage", [1, 2], 2, "old"), ("stage", [3, 4], 2, "new"), kind=kind)
    epoch = cache.epoch()
    assert getattr(cache, f"peek_{kind}")("stage", [1, 2, 9]).value == "old"
    assert getattr(cache, f"peek_{kind}")("stage", [8]) is None
    assert getattr(cache, f"peek_{kind}")("nowhere", [1, 2]) is None
    assert cache.epoch() == epoch
    assert getattr(cache, f"lru_{kind}_candidate")().value == "old"
    assert cache.epoch() == epoch
    # a lookup does heat it
    assert getattr(cache, f"lookup_{kind}")("stage", [1, 2, 9]).value == "old"
    assert cache.epoch() == epoch + 1
    assert getattr(cache, f"lru_{kind}_candidate")().value == "new"


def test_lookup_acquire_and_exact_advance_the_clock_even_on_a_miss():
    cache = make_cache(("s", [1], 1, "v"))
    assert cache.epoch() == 1
    assert cache.lookup_resident("s", [2]) is None
    assert cache.lookup_recurrent("s", [1]) is None
    assert cache.lookup_resident("unknown", [1]) is None
    assert cache.acquire_resident("s", [2]) is None
    assert cache.resident_exact("s", [1, 2]) is None
    assert cache.recurrent_exact("s", [1]) is None
    assert cache.epoch() == 7
    assert cache.resident_exact("s", [1]) == "v"
    assert cache.epoch() == 8
    assert cache.lru_resident_candidate().last_used == 8
    # failed releases and removals do not
    assert cache.release_resident("s", [1]) is False
    assert cache.remove_resident("s", [2]) is None
    assert cache.epoch() == 8


def test_acquired_entries_are_shared_and_protected_from_eviction():
    cache = make_cache(("stage", [1], 10, "old"), ("stage", [2], 20, "new"))
    first = cache.acquire_resident("stage", [1, 9])
    assert first.active_refs == 1 and first.stored_key == (1,)
    assert cache.acquire_resident("stage", [1, 8]).active_refs == 2
    assert cache.lookup_resident("stage", [1, 7]).active_refs == 2
    evicted = cache.evict_lru_resident()
    assert evicted == RadixEntry("stage", (2,), 20, 2, "new")
    assert cache.stats().resident_evictions == 1

    epoch = cache.epoch()
    assert cache.release_resident("stage", [1])
    assert cache.epoch() == epoch + 1
    assert cache.evict_lru_resident() is None
    assert cache.stats().resident_active_refs == 1
    assert cache.release_resident("stage", [1])
    assert not cache.release_resident("stage", [1])
    assert not cache.release_resident("stage", [1, 9])  # release takes the exact key
    assert cache.evict_lru_resident().value == "old"
    assert cache.stats().resident_evictions == 2
    assert cache.stats().namespaces == 0


def test_recurrent_acquire_release_and_eviction():
    cache = make_cache(("s", [1, 2], 5, "a"), ("s", [3], 6, "b"), kind="recurrent")
    hit = cache.acquire_recurrent("s", [1, 2, 3])
    assert (hit.matched_tokens, hit.active_refs) == (2, 1)
    assert cache.stats().recurrent_active_refs == 1
    assert cache.evict_lru_recurrent().value == "b"
    assert cache.evict_lru_recurrent() is None
    assert cache.release_recurrent("s", [1, 2])
    assert cache.evict_lru_recurrent().tokens == (1, 2)
    stats = cache.stats()
    assert (stats.recurrent_evictions, stats.recurrent_entries, stats.nodes) == (2, 0, 0)


# -- removal --------------------------------------------------------------------------------

def test_removing_a_branch_prunes_and_recompresses_the_tree():
    cache = make_cache(("stage", [1, 2, 3], 3, "left"), ("stage", [1, 2, 4], 3, "right"))
    assert (cache.stats().nodes, cache.stats().token_edges) == (3, 4)
    epoch = cache.epoch()
    assert cache.remove_resident("stage", [1, 2, 4]) == "right"
    assert cache.epoch() == epoch
    assert (cache.stats().nodes, cache.stats().token_edges) == (1, 3)
    assert cache.lookup_resident("stage", [1, 2, 3, 5]).value == "left"
    assert cache.remove_resident("stage", [1, 2, 4]) is None


def test_removing_an_inner_entry_merges_its_single_child():
    cache = make_cache(("s", [1, 2], 2, "inner"), ("s", [1, 2, 3, 4], 4, "leaf"))
    assert (cache.stats().nodes, cache.stats().token_edges) == (2, 4)
    assert cache.remove_resident("s", [1, 2]) == "inner"
    assert (cache.stats().nodes, cache.stats().token_edges) == (1, 4)
    hit = cache.peek_resident("s", [1, 2, 3, 4, 5])
    assert (hit.matched_tokens, hit.stored_key) == (4, (1, 2, 3, 4))
    assert cache.remove_resident("s", [1, 2, 3, 4]) == "leaf"
    assert cache.stats() == RadixStats()  # an extension is not a split


def test_component_removal_keeps_the_other_payload_and_its_node():
    cache = UnifiedRadixCache()
    cache.insert_resident("stage", [1, 2], 10, "resident")
    cache.insert_recurrent("stage", [1, 2], 20, "recurrent")
    assert cache.evict_lru_resident().value == "resident"
    assert cache.lookup_resident("stage", [1, 2]) is None
    assert cache.lookup_recurrent("stage", [1, 2]).value == "recurrent"
    assert cache.stats().nodes == 1
    assert cache.remove_recurrent("stage", [1, 2]) == "recurrent"
    assert cache.stats().namespaces == 0 and cache.stats().nodes == 0


def test_remove_where_sees_entries_and_counts_removals():
    cache = make_cache(("b", [1, 2], 2, 10), ("a", [5], 1, 11), ("a", [1, 2, 3], 3, 12),
                       ("b", [9], 1, 13))
    cache.insert_recurrent("a", [1, 2, 3], 7, 99)
    seen = []

    def odd(entry):
        assert isinstance(entry, RadixEntry)
        seen.append((entry.namespace, entry.tokens))
        return entry.value % 2 == 1

    epoch = cache.epoch()
    assert cache.remove_resident_where(odd) == 2
    assert seen == [("a", (1, 2, 3)), ("a", (5,)), ("b", (1, 2)), ("b", (9,))]
    assert cache.epoch() == epoch
    assert [e.value for e in cache.resident_entries()] == [12, 10]
    assert cache.stats().resident_evictions == 0
    assert cache.recurrent_exact("a", [1, 2, 3]) == 99

    def boom(entry):
        raise RuntimeError("predicate failed")

    with pytest.raises(RuntimeError):
        cache.remove_resident_where(boom)
    assert cache.stats().resident_entries == 2
    assert cache.remove_recurrent_where(lambda e: e.logical_bytes == 7) == 1
    assert cache.stats().recurrent_entries == 0


# -- LRU victim -----------------------------------------------------------------------------

def test_lru_victim_is_least_recently_used_unreferenced_entry():
    cache = make_cache(("s", [3], 1, "c"), ("s", [1], 1, "a"), ("s", [2], 1, "b"))
    assert cache.lru_resident_candidate() == RadixEntry("s", (3,), 1, 1, "c")
    cache.lookup_resident("s", [3])
    assert cache.lru_resident_candidate().value == "a"
    cache.acquire_resident("s", [1])
    assert cache.lru_resident_candidate().value == "b"
    assert cache.evict_lru_resident().value == "b"
    assert cache.evict_lru_resident().value == "c"
    assert cache.evict_lru_resident() is None  # "a" is still referenced
    assert cache.stats().resident_entries == 1
    assert cache.stats().resident_evictions == 2


def test_lru_ties_break_on_namespace_then_token_path():
    """Clocks saturate at 2**64 - 1 (never wrap), so entries touched there tie on last_used."""
    cache = UnifiedRadixCache()
    cache._set_epoch(U64_MAX - 1)
    cache.insert_resident("stage-1", [0], 1, "first-at-max")
    cache.insert_resident("stage-0", [5, 1], 1, "b")
    cache.insert_resident("stage-0", [5], 1, "a")
    cache.insert_resident("stage-0", [-3], 1, "neg")
    assert cache.epoch() == U64_MAX
    assert {e.last_used for e in cache.resident_entries()} == {U64_MAX}
    order = [cache.evict_lru_resident().value for _ in range(4)]
    assert order == ["neg", "a", "b", "first-at-max"]
    assert cache.stats().resident_evictions == 4
    # the namespace order is byte order ("Z" < "a")
    cache.insert_recurrent("a", [0], 1, "lower")
    cache.insert_recurrent("Z", [9], 1, "upper")
    assert cache.lru_recurrent_candidate().value == "upper"


# -- stats and validation -------------------------------------------------------------------

def test_stats_fields():
    cache = UnifiedRadixCache()
    cache.insert_resident("x", [1, 2, 3], 30, "r1")
    cache.insert_resident("x", [1, 2, 4, 5], 40, "r2")
    cache.insert_resident("y", [1], 1 << 70 >> 7, "big")
    cache.insert_recurrent("x", [1, 2], 12, "e")
    cache.acquire_resident("x", [1, 2, 3])
    cache.acquire_recurrent("x", [1, 2, 9])
    cache.insert_recurrent("y", [2], 1, "gone")
    cache.evict_lru_recurrent()
    assert cache.stats() == RadixStats(
        namespaces=2, nodes=4, token_edges=6, splits=1, resident_entries=3,
        resident_tokens=8, resident_logical_bytes=70 + (1 << 63), resident_active_refs=1,
        recurrent_entries=1, recurrent_logical_bytes=12, recurrent_active_refs=1,
        resident_evictions=0, recurrent_evictions=1)
    assert [f.name for f in dataclasses.fields(RadixStats)] == [
        "namespaces", "nodes", "token_edges", "splits", "resident_entries", "resident_tokens",
        "resident_logical_bytes", "resident_active_refs", "recurrent_entries",
        "recurrent_logical_bytes", "recurrent_active_refs", "resident_evictions",
        "recurrent_evictions"]


def test_logical_bytes_sum_saturates():
    cache = make_cache(("s", [1], U64_MAX, "a"), ("s", [2], 5, "b"))
    assert cache.stats().resident_logical_bytes == U64_MAX


@pytest.mark.parametrize("call, exc", [
    (lambda c: c.insert_resident(b"s", [1], 1, "v"), TypeError),
    (lambda c: c.insert_resident(None, [1], 1, "v"), TypeError),
    (lambda c: c.insert_resident("s", [1, True], 1, "v"), TypeError),
    (lambda c: c.insert_resident("s", [1, "2"], 1, "v"), TypeError),
    (lambda c: c.insert_resident("s", [1, 2.0], 1, "v"), TypeError),
    (lambda c: c.insert_resident("s", None, 1, "v"), TypeError),
    (lambda c: c.insert_resident("s", 5, 1, "v"), TypeError),
    (lambda c: c.insert_resident("s", [1, 2 ** 31], 1, "v"), ValueError),
    (lambda c: c.insert_resident("s", [-(2 ** 31) - 1], 1, "v"), ValueError),
    (lambda c: c.insert_resident("s", [1, 2 ** 80], 1, "v"), ValueError),
    (lambda c: c.insert_resident("s", [1], -1, "v"), ValueError),
    (lambda c: c.insert_resident("s", [1], 1 << 64, "v"), ValueError),
    (lambda c: c.insert_resident("s", [1], True, "v"), TypeError),
    (lambda c: c.insert_recurrent("s", [1], 1.5, "v"), TypeError),
    (lambda c: c.insert_recurrent("s", [1], np.True_, "v"), TypeError),
    (lambda c: c.insert_recurrent("s", np.array([True]), 1, "v"), TypeError),
    (lambda c: c.insert_recurrent("s", [1], np.int64(-1), "v"), ValueError),
    (lambda c: c.peek_resident("s", [1, None]), TypeError),
    (lambda c: c.lookup_resident(3, [1]), TypeError),
    (lambda c: c.acquire_recurrent("s", [2 ** 31]), ValueError),
    (lambda c: c.remove_resident("s", ["x"]), TypeError),
    (lambda c: c.release_resident("s", [object()]), TypeError),
    (lambda c: c.insert_resident("\ud800", [1], 1, "v"), ValueError),
])
def test_bad_arguments_raise_before_any_change(call, exc):
    cache = make_cache(("s", [1, 2], 2, "v"))
    cache.acquire_resident("s", [1, 2])
    before = (cache.epoch(), cache.stats(), cache.resident_entries())
    with pytest.raises(exc):
        call(cache)
    assert (cache.epoch(), cache.stats(), cache.resident_entries()) == before


def test_token_inputs_int32_buffers_numpy_scalars_and_extremes():
    cache = UnifiedRadixCache()
    key = np.arange(100, dtype=np.int32)
    cache.insert_resident("s", key, 100, "np")
    assert cache.peek_resident("s", list(range(50))).matched_tokens == 50
    assert cache.peek_resident("s", np.arange(120, dtype=np.int64)).matched_tokens == 100
    assert cache.peek_resident("s", key[::2]).matched_tokens == 1  # strided: copied
    assert cache.peek_resident("s", tuple(np.arange(10, dtype=np.int16))).matched_tokens == 10
    assert cache.peek_resident("s", range(7)).matched_tokens == 7
    extremes = [-(2 ** 31), 2 ** 31 - 1, 0]
    cache.insert_recurrent("s", extremes, 1, "edge")
    assert cache.recurrent_exact("s", np.array(extremes, dtype=np.int32)) == "edge"
    assert cache.recurrent_entries()[0].tokens == tuple(extremes)
    assert cache.peek_resident("s", []) is None
    assert cache.insert_resident("s", [3], np.uint64(2 ** 64 - 1), "numpy bytes") is None
    assert cache.peek_resident("s", [3]).logical_bytes == 2 ** 64 - 1
    assert cache.lookup_resident("s", np.array([], dtype=np.int32)) is None


def test_index_objects_may_reenter_the_cache():
    cache = make_cache(("s", [1, 2, 3], 3, "v"))

    class Sneaky:
        def __index__(self):
            cache.peek_resident("s", [9, 9, 9, 9, 9, 9])
            return 3

    assert cache.peek_resident("s", [1, 2, Sneaky()]).matched_tokens == 3


def test_values_are_released_on_removal_eviction_and_replacement():
    class Payload:
        pass

    cache = UnifiedRadixCache()
    refs = []
    for i in range(4):
        value = Payload()
        refs.append(weakref.ref(value))
        cache.insert_resident("s", [i], 1, value)
    del value
    cache.insert_resident("s", [0], 1, "replacement")  # the caller drops the returned value
    assert refs[0]() is None
    cache.remove_resident("s", [1])
    assert refs[1]() is None
    cache.evict_lru_resident()  # [2]: the oldest left
    assert refs[2]() is None
    assert cache.remove_resident_where(lambda e: e.tokens == (3,)) == 1
    assert refs[3]() is None
    # a value that refers back to its cache forms a cycle the collector can break
    cache.insert_resident("s", [9], 1, cache)
    probe = weakref.ref(cache)
    del cache
    gc.collect()
    assert probe() is None


def test_match_and_entry_values():
    match = RadixMatch(2, 4, 40, 1, "v", stored_key=[1, 2, 3, 4])
    assert match.stored_key == (1, 2, 3, 4)
    assert match == RadixMatch(2, 4, 40, 1, "v", [1, 2, 3, 4])
    assert match != RadixMatch(2, 4, 40, 1, "v", [1, 2, 3, 5])
    assert "matched_tokens=2" in repr(match)
    entry = RadixEntry("ns", [1, 2], 3, 4, None)
    assert entry.tokens == (1, 2) and "namespace='ns'" in repr(entry)


def test_long_keys_deep_chains_and_pool_compaction():
    """Thousands of nested keys make a chain thousands of nodes deep: walks are iterative."""
    cache = UnifiedRadixCache()
    depth = 3000
    for n in range(1, depth + 1):
        cache.insert_resident("deep", range(n), n, n)
    stats = cache.stats()
    assert (stats.nodes, stats.token_edges, stats.splits) == (depth, depth, 0)
    assert cache.peek_resident("deep", range(depth + 5)).value == depth
    assert cache.peek_resident("deep", [0, 1, 2, 7]).value == 3
    assert cache.lru_resident_candidate().value == 1
    assert len(cache.resident_entries()) == depth
    # removing every second entry merges chains into non-contiguous spans, forcing compaction
    for n in range(1, depth + 1, 2):
        assert cache.remove_resident("deep", range(n)) == n
    stats = cache.stats()
    assert (stats.nodes, stats.token_edges) == (depth // 2, depth)
    for n in range(2, depth + 1, 2):
        hit = cache.peek_resident("deep", range(n))
        assert (hit.matched_tokens, hit.value) == (n, n)
    assert cache.peek_resident("deep", [0]).stored_key == (0, 1)
    while cache.evict_lru_resident() is not None:
        pass
    assert cache.stats() == RadixStats(resident_evictions=depth // 2)


# -- the lab's radix fixture (§5.5) and the affinity helper (§5.2) --------------------------

def radix_fixture():
    cache = UnifiedRadixCache()
    cache.insert_resident("stage-0", list(range(3072)), 3072, "shared-prefix")
    return cache


def test_lab_radix_fixture():
    cache = radix_fixture()
    assert cache.epoch() == 1
    hot = cache.peek_resident("stage-0", list(range(4096)))
    assert (hot.matched_tokens, hot.stored_tokens, hot.logical_bytes, hot.value) == (
        3072, 3072, 3072, "shared-prefix")
    assert cache.peek_resident("stage-0", list(range(10_000, 14_096))) is None
    assert cache.peek_resident("stage-0", list(range(20_000, 24_096))) is None
    assert cache.epoch() == 1


def test_affinity_from_radix_matches_the_lab_fixture():
    cache = radix_fixture()
    hot = affinity_from_radix(cache, list(range(4096)), stages=[(0, "stage-0")],
                              prefill_cost_per_token=2)
    assert hot == CacheAffinity.from_stage(StageCacheAffinity(
        stage_index=0, matched_tokens=3072, prefill_cost_per_token=2, restore_cost=0,
        cache_epoch=1))
    assert hot.estimated_saved_cost() == 6144
    cold = affinity_from_radix(cache, list(range(10_000, 14_096)), stages=[(0, "stage-0")],
                               prefill_cost_per_token=2)
    assert cold == CacheAffinity()
    assert cache.epoch() == 1


def test_affinity_from_radix_per_stage_hits():
    cache = radix_fixture()
    cache.insert_resident("stage-1", list(range(100)), 100, "stage-1 prefix")
    prompt = np.arange(64, dtype=np.int32)
    affinity = affinity_from_radix(
        cache, prompt, stages=[(0, "stage-0"), (1, "stage-1"), (2, "stage-2")],
        prefill_cost_per_token=3, restore_cost=10)
    assert affinity.stages == (
        StageCacheAffinity(0, 64, 3, 10, 2),
        StageCacheAffinity(1, 64, 3, 10, 2),
    )
    assert affinity.estimated_saved_cost() == 2 * (64 * 3 - 10)
    assert cache.lru_resident_candidate().value == "shared-prefix"  # peeks did not heat it
    with pytest.raises(TypeError):
        affinity_from_radix(cache, prompt, stages=[("0", "stage-0")], prefill_cost_per_token=1)
    with pytest.raises(ValueError):
        affinity_from_radix(cache, prompt, stages=[(0, "stage-0")], prefill_cost_per_token=-1)
    with pytest.raises(TypeError):
        affinity_from_radix(cache, prompt, stages=[(0, 0)], prefill_cost_per_token=1)
    numpy_ints = affinity_from_radix(cache, prompt, stages=[(np.uint32(1), "stage-1")],
                                     prefill_cost_per_token=np.int64(3))
    assert numpy_ints.stages == (StageCacheAffinity(1, 64, 3, 0, 2),)
    assert type(numpy_ints.stages[0].prefill_cost_per_token) is int


# -- property test against the flat twin ----------------------------------------------------

keys = st.lists(st.integers(-2, 3), min_size=0, max_size=6)
namespaces = st.sampled_from(["a", "b", "Z"])
ops = st.one_of(
    st.tuples(st.sampled_from(["insert_resident", "insert_resident_if_vacant",
                               "insert_recurrent"]), namespaces, keys,
              st.integers(0, 100)),
    st.tuples(st.sampled_from([
        "peek_resident", "peek_recurrent", "lookup_resident", "lookup_recurrent",
        "acquire_resident", "acquire_recurrent", "release_resident", "release_recurrent",
        "resident_exact", "recurrent_exact", "remove_resident", "remove_recurrent"]),
        namespaces, keys),
    st.tuples(st.sampled_from(["evict_lru_resident", "evict_lru_recurrent",
                               "lru_resident_candidate", "lru_recurrent_candidate"])),
    st.tuples(st.sampled_from(["remove_resident_where", "remove_recurrent_where"]),
              st.integers(2, 5)),
)


def _run(cache, op, step):
    name, *args = op
    try:
        if name.startswith("insert"):
            namespace, key, nbytes = args
            return getattr(cache, name)(namespace, key, nbytes, f"v{step}")
        if name.endswith("_where"):
            (mod,) = args
            return getattr(cache, name)(lambda e: e.logical_bytes % mod == 0)
        return getattr(cache, name)(*args)
    except ValueError as exc:
        return ("ValueError", str(exc))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(ops, max_size=60))
def test_native_cache_matches_flat_twin(sequence):
    native, twin = UnifiedRadixCache(), RadixTwin()
    for step, op in enumerate(sequence):
        assert _run(native, op, step) == _run(twin, op, step), op
        assert native.epoch() == twin.epoch()
        assert dataclasses.asdict(native.stats()) == twin.stats(), op
    assert native.resident_entries() == twin.resident_entries()
    assert native.recurrent_entries() == twin.recurrent_entries()
