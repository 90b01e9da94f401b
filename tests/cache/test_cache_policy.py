"""Conformance cases of behaviour.md §3.2, §3.4 and §6.2 for the native ordering."""
import sys

import pytest

from skippy_scheduler import _rank
from skippy_scheduler.cache_policy import (
    CacheAffinity,
    CacheAwareCandidate,
    StageCacheAffinity,
    order_cache_aware_candidates,
    select_cache_aware_candidate,
)

U64_MAX = (1 << 64) - 1


def affinity(saved):
    return CacheAffinity.from_stage(StageCacheAffinity(0, 1, saved, 0, 0))


def cand(index, tokens=(1, 2, 3), *, priority=0, saved=0, turn=0, order=None):
    return CacheAwareCandidate(
        index=index, priority=priority, affinity=affinity(saved), prompt_tokens=list(tokens),
        enqueued_turn=turn, order=index if order is None else order)


def test_cache_value_orders_equal_priority_candidates():
    cands = [cand(0, [1, 2, 3]), cand(1, [4, 5, 6], saved=100)]
    assert select_cache_aware_candidate(cands, 0, 10, True) == 1
    assert select_cache_aware_candidate(cands, 0, 10, False) == 1


def test_aging_eventually_promotes_a_cold_request():
    cands = [cand(0, [1, 2, 3], turn=0), cand(1, [4, 5, 6], saved=100, turn=11)]
    assert select_cache_aware_candidate(cands, 11, 10, True) == 0
    assert select_cache_aware_candidate(cands, 11, 10, False) == 0
    # without aging the hot one wins
    assert select_cache_aware_candidate(cands, 11, 0, False) == 1


def test_explicit_priority_precedes_cache_value():
    cands = [cand(0, [1, 2, 3], priority=1), cand(1, [4, 5, 6], saved=1_000)]
    assert select_cache_aware_candidate(cands, 0, 10, True) == 0
    assert select_cache_aware_candidate(cands, 0, 10, False) == 0


GROUP = [[9, 9, 9], [1, 2, 3], [1, 2, 4]]


def test_dfs_weight_groups_the_heaviest_equal_score_prefix_subtree():
    cands = [cand(i, p) for i, p in enumerate(GROUP)]
    assert order_cache_aware_candidates(cands, 0, 10, True) == [1, 2, 0]


def test_dfs_weight_groups_staggered_arrivals_within_score_band():
    cands = [cand(i, p, turn=t) for i, (p, t) in enumerate(zip(GROUP, [0, 1, 2]))]
    assert order_cache_aware_candidates(cands, 3, 4096, True) == [1, 2, 0]


def test_materially_older_work_precedes_prefix_group():
    cands = [cand(i, p, turn=t) for i, (p, t) in enumerate(zip(GROUP, [0, 9, 10]))]
    assert order_cache_aware_candidates(cands, 10, 4096, True)[0] == 0


def test_disabling_prefix_grouping_restores_enqueue_order():
    cands = [cand(i, p) for i, p in enumerate(GROUP)]
    assert order_cache_aware_candidates(cands, 0, 10, False) == [0, 1, 2]


def test_materialized_cache_value_precedes_waiting_prefix_weight():
    cands = [cand(0, [1, 2, 3]), cand(1, [1, 2, 4]), cand(2, [9, 9, 9], saved=100)]
    assert order_cache_aware_candidates(cands, 0, 10, True)[0] == 2


def test_long_common_prefix_does_not_drive_recursion_depth():
    left = [1] * 100_000 + [2]
    right = [1] * 100_000 + [3]
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(200)  # the native kernel must not need the Python stack either
    try:
        got = order_cache_aware_candidates([cand(0, left), cand(1, right)], 0, 10, True)
    finally:
        sys.setrecursionlimit(old)
    assert got == [0, 1]
    # swapping the orders swaps the equal-size buckets (smallest order first)
    got = order_cache_aware_candidates(
        [cand(0, left, order=5), cand(1, right, order=4)], 0, 10, True)
    assert got == [1, 0]


def test_radix_rank_examples_of_section_3_2():
    prompts = [[1, 2], [1, 2, 3], [1, 2, 4], [5], [1, 2, 3]]
    cands = [cand(i, p) for i, p in enumerate(prompts)]
    assert order_cache_aware_candidates(cands, 0, 10, True) == [1, 4, 2, 0, 3]
    prompts = [[7], [3, 1], [3, 2], [8, 1], [8, 2]]
    cands = [cand(i, p, order=o) for i, (p, o) in enumerate(zip(prompts, [10, 9, 8, 7, 6]))]
    assert order_cache_aware_candidates(cands, 0, 10, True) == [4, 3, 2, 1, 0]


def test_band_boundaries_of_the_grouping_score():
    # aging 1 -> 4 per band; ages 4 and 5 fall in bands 1 and 2, so age 5 goes first ...
    cands = [cand(0, [9, 9, 9], turn=5), cand(1, [1, 2, 3], turn=4), cand(2, [1, 2, 4], turn=4)]
    assert order_cache_aware_candidates(cands, 9, 1, True) == [1, 2, 0]
    cands = [cand(0, [9, 9, 9], turn=4), cand(1, [1, 2, 3], turn=5), cand(2, [1, 2, 4], turn=5)]
    assert order_cache_aware_candidates(cands, 9, 1, True) == [0, 1, 2]
    # ... while ages 1 and 4 share band 1 and the heavier prefix subtree goes first
    cands = [cand(0, [9, 9, 9], turn=5), cand(1, [1, 2, 3], turn=8), cand(2, [1, 2, 4], turn=8)]
    assert order_cache_aware_candidates(cands, 9, 1, True) == [1, 2, 0]


def test_identical_prompts_fall_through_to_effective_score_then_order():
    # same band (ages 1..4), identical prompts: effective score decides, then order
    cands = [cand(0, [5, 5], turn=3, order=0), cand(1, [5, 5], turn=1, order=1),
             cand(2, [5, 5], turn=1, order=2), cand(3, [5, 5, 6], turn=3, order=3)]
    assert order_cache_aware_candidates(cands, 4, 10, True) == [3, 1, 2, 0]


def test_index_values_are_returned_not_positions():
    cands = [cand(40, [1]), cand(7, [2], saved=5)]
    assert order_cache_aware_candidates(cands, 0, 1, True) == [7, 40]
    assert select_cache_aware_candidate([], 0, 1, True) is None
    assert order_cache_aware_candidates([], 0, 1, True) == []


def test_ties_keep_input_position():
    cands = [cand(i, [1, 2], order=0) for i in range(5)]
    assert order_cache_aware_candidates(cands, 0, 1, True) == [0, 1, 2, 3, 4]
    assert order_cache_aware_candidates(cands, 0, 1, False) == [0, 1, 2, 3, 4]


def test_scores_saturate_at_u64_max():
    big = CacheAffinity((StageCacheAffinity(0, U64_MAX, U64_MAX, 0, 0),
                         StageCacheAffinity(1, 2, U64_MAX, 1, 0)))
    a = CacheAwareCandidate(0, 0, big, [1], 0, 1)
    b = CacheAwareCandidate(1, 0, affinity(U64_MAX), [2], 0, 0)
    # both saturate to U64_MAX, so the smaller order wins
    assert order_cache_aware_candidates([a, b], U64_MAX, U64_MAX, False) == [1, 0]
    assert order_cache_aware_candidates([a, b], U64_MAX, U64_MAX, True) == [1, 0]
    # huge ages saturate instead of wrapping around to small scores
    old = CacheAwareCandidate(0, 0, CacheAffinity(), [1], 0, 1)
    hot = CacheAwareCandidate(1, 0, affinity(U64_MAX - 1), [2], U64_MAX, 0)
    assert order_cache_aware_candidates([old, hot], U64_MAX, 2, False) == [0, 1]


def test_band_count_saturates():
    # age 2^64-1: (age + 3) saturates, giving 2^62 - 1 bands, x4 (aging 1) = 2^64 - 4, which
    # loses to a saved cost of 2^64 - 2; one turn younger it is still 2^62 - 1 bands
    old = CacheAwareCandidate(0, 0, CacheAffinity(), [1], 0, 1)
    hot = CacheAwareCandidate(1, 0, affinity(U64_MAX - 1), [2], U64_MAX, 0)
    assert order_cache_aware_candidates([old, hot], U64_MAX, 1, True) == [1, 0]
    hot = CacheAwareCandidate(1, 0, affinity(U64_MAX - 4), [2], U64_MAX, 0)
    assert order_cache_aware_candidates([old, hot], U64_MAX, 1, True) == [0, 1]
    # without grouping the effective score saturates to U64_MAX and the cold one wins
    hot = CacheAwareCandidate(1, 0, affinity(U64_MAX - 1), [2], U64_MAX, 0)
    assert order_cache_aware_candidates([old, hot], U64_MAX, 1, False) == [0, 1]


def test_fcfs_and_priority_modes():
    cands = [cand(0, [1], priority=0, order=3), cand(1, [1, 2], priority=2, order=5, saved=9),
             cand(2, [3], priority=2, order=1), cand(3, [4], priority=0, order=0, saved=50)]
    packed = _rank.PackedCandidates(cands)
    assert packed.order(0, 1, True, _rank.MODE_FCFS) == [3, 2, 0, 1]
    assert packed.order(0, 1, True, _rank.MODE_PRIORITY) == [2, 1, 3, 0]
    assert packed.order(0, 1, True, _rank.MODE_CACHE_AWARE) == [1, 2, 3, 0]
    with pytest.raises(ValueError):
        packed.order(0, 1, True, 9)


def test_numpy_and_array_prompts_are_accepted():
    import array

    import numpy as np

    cands = [CacheAwareCandidate(0, 0, CacheAffinity(), np.array([1, 2, 4], dtype=np.int32), 0, 0),
             CacheAwareCandidate(1, 0, CacheAffinity(), array.array("i", [9]), 0, 1),
             CacheAwareCandidate(2, 0, CacheAffinity(), (1, 2, 3), 0, 2)]
    assert order_cache_aware_candidates(cands, 0, 1, True) == [0, 2, 1]


@pytest.mark.parametrize(
    "tokens, exc",
    [([1, 2**31], ValueError), ([-(2**31) - 1], ValueError), ([1, True], TypeError),
     ([1.0], TypeError), (["1"], TypeError), ("abc", TypeError), (5, TypeError),
     ([2**70], ValueError)],
)
def test_prompt_tokens_must_be_i32_ints(tokens, exc):
    c = CacheAwareCandidate(0, 0, CacheAffinity(), tokens, 0, 0)
    with pytest.raises(exc):
        order_cache_aware_candidates([c], 0, 1, True)


def test_i32_extremes_are_accepted_and_ordered():
    cands = [cand(0, [-(2**31), 5]), cand(1, [2**31 - 1]), cand(2, [-(2**31), 6])]
    assert order_cache_aware_candidates(cands, 0, 1, True) == [0, 2, 1]


@pytest.mark.parametrize(
    "field, value, exc",
    [("index", -1, ValueError), ("priority", -1, ValueError), ("priority", 2**64, ValueError),
     ("enqueued_turn", 1.5, TypeError), ("order", None, TypeError), ("priority", True, TypeError),
     ("affinity", None, TypeError)],
)
def test_candidate_fields_are_validated(field, value, exc):
    fields = dict(index=0, priority=0, affinity=CacheAffinity(), prompt_tokens=[1],
                  enqueued_turn=0, order=0)
    fields[field] = value
    with pytest.raises(exc):
        order_cache_aware_candidates([CacheAwareCandidate(**fields)], 0, 1, True)


def test_arguments_are_validated():
    good = [cand(0)]
    with pytest.raises(TypeError):
        order_cache_aware_candidates([object()], 0, 1, True)
    with pytest.raises(TypeError):
        order_cache_aware_candidates(None, 0, 1, True)
    with pytest.raises(ValueError):
        order_cache_aware_candidates(good, -1, 1, True)
    with pytest.raises(ValueError):
        order_cache_aware_candidates(good, 0, 2**64, True)
    with pytest.raises(TypeError):
        order_cache_aware_candidates(good, 0, 1, 1)
    with pytest.raises(TypeError):
        select_cache_aware_candidate(good, "0", 1, True)


def test_numpy_integers_are_accepted_like_python_ints():
    import numpy as np

    cands = [CacheAwareCandidate(np.int64(0), np.uint64(0), CacheAffinity(),
                                 [np.int32(1), np.int64(2)], np.uint32(0), np.int16(1)),
             CacheAwareCandidate(1, 0, affinity(5), np.array([1, 3], dtype=np.int64), 0, 0)]
    assert order_cache_aware_candidates(cands, np.uint64(1), np.int8(1), True) == [1, 0]
    with pytest.raises(TypeError):
        order_cache_aware_candidates(cands, 1, 1, np.bool_(True))
    with pytest.raises(TypeError):
        order_cache_aware_candidates([cand(0, [np.bool_(True)])], 1, 1, True)
