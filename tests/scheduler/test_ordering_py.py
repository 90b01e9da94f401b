"""The reference cache-aware ordering (§3.2–§3.4, §6.2)."""
import pytest

from skippy_scheduler import CacheAffinity, CacheAwareCandidate, StageCacheAffinity
from skippy_scheduler.reference import reference_order as order


def select(candidates, turn, aging, grouping):
    ranked = order(candidates, turn, aging, grouping)
    return ranked[0] if ranked else None

U64_MAX = (1 << 64) - 1


def saved(value):
    return CacheAffinity.from_stage(StageCacheAffinity(0, 1, value, 0))


def cand(index, prompt=(), priority=0, saved_cost=0, turn=0, order_=None):
    return CacheAwareCandidate(
        index=index, priority=priority, affinity=saved(saved_cost) if saved_cost else CacheAffinity(),
        prompt_tokens=list(prompt), enqueued_turn=turn, order=index if order_ is None else order_,
    )


def test_cache_value_orders_equal_priority_candidates():
    assert select([cand(0), cand(1, saved_cost=100)], 0, 10, True) == 1


def test_aging_eventually_promotes_a_cold_request():
    cands = [cand(0, turn=0), cand(1, saved_cost=100, turn=11)]
    assert select(cands, 11, 10, True) == 0
    assert select(cands, 11, 10, False) == 0


def test_explicit_priority_precedes_cache_value():
    assert select([cand(0, priority=1), cand(1, saved_cost=1000)], 0, 10, True) == 0


PROMPTS = [[9, 9, 9], [1, 2, 3], [1, 2, 4]]


def test_dfs_weight_groups_the_heaviest_equal_score_prefix_subtree():
    assert order([cand(i, p) for i, p in enumerate(PROMPTS)], 0, 10, True) == [1, 2, 0]


def test_dfs_weight_groups_staggered_arrivals_within_score_band():
    assert order([cand(i, p, turn=i) for i, p in enumerate(PROMPTS)], 3, 4096, True) == [1, 2, 0]


def test_materially_older_work_precedes_prefix_group():
    cands = [cand(i, p, turn=t) for (i, p), t in zip(enumerate(PROMPTS), (0, 9, 10))]
    assert order(cands, 10, 4096, True)[0] == 0


def test_disabling_prefix_grouping_restores_enqueue_order():
    assert order([cand(i, p) for i, p in enumerate(PROMPTS)], 0, 10, False) == [0, 1, 2]


def test_materialized_cache_value_precedes_waiting_prefix_weight():
    cands = [cand(0, [1, 2, 3]), cand(1, [1, 2, 4]), cand(2, [9, 9, 9], saved_cost=100)]
    assert order(cands, 0, 10, True)[0] == 2


def test_long_common_prefix_does_not_drive_recursion_depth():
    cands = [cand(0, [1] * 100_000 + [2]), cand(1, [1] * 100_000 + [3])]
    assert order(cands, 0, 10, True) == [0, 1]


def test_dfs_examples_of_section_3_2():
    prompts = [[1, 2], [1, 2, 3], [1, 2, 4], [5], [1, 2, 3]]
    assert order([cand(i, p) for i, p in enumerate(prompts)], 0, 10, True) == [1, 4, 2, 0, 3]
    prompts = [[7], [3, 1], [3, 2], [8, 1], [8, 2]]
    cands = [cand(i, p, order_=o) for (i, p), o in zip(enumerate(prompts), (10, 9, 8, 7, 6))]
    assert order(cands, 0, 10, True) == [4, 3, 2, 1, 0]


def test_identical_prompts_fall_through_to_effective_score_then_order():
    # Ages 1 and 4 share grouping band 1; the identical prompts tie on the DFS rank, so the
    # older one wins on effective score despite its later enqueue order. The extension
    # [4, 4, 5] ranks before both.
    cands = [cand(0, [4, 4], turn=3), cand(1, [4, 4], turn=0), cand(2, [4, 4, 5], turn=3)]
    assert order(cands, 4, 10, True) == [2, 1, 0]
    same = [cand(0, [4, 4], order_=5), cand(1, [4, 4], order_=2)]
    assert order(same, 0, 10, True) == [1, 0]


def test_deep_branching_without_recursion():
    # A chain of 1 000 nested branch points: each prompt i is [0]*i + [1].
    cands = [cand(i, [0] * i + [1]) for i in range(1000)]
    result = order(cands, 0, 1, True)
    # The bigger (all-zero) branch goes first at every level; the last two are single-prompt
    # branches, ordered by enqueue order.
    assert result == [998, 999] + list(range(997, -1, -1))


def test_scores_saturate_instead_of_overflowing():
    huge = CacheAffinity((StageCacheAffinity(0, U64_MAX, U64_MAX, 0), StageCacheAffinity(1, U64_MAX, 2, 0)))
    assert huge.estimated_saved_cost() == U64_MAX
    cands = [
        CacheAwareCandidate(0, 0, huge, [1], 0, 0),
        CacheAwareCandidate(1, 0, CacheAffinity(), [2], 0, 1),
    ]
    assert order(cands, U64_MAX, U64_MAX, True) == [0, 1]
    assert order(cands, U64_MAX, U64_MAX, False) == [0, 1]


def test_argument_validation():
    with pytest.raises(TypeError):
        order([object()], 0, 1, True)
    with pytest.raises(ValueError):
        order([], -1, 1, True)
    with pytest.raises(TypeError):
        order([], 0, 1, 1)
    assert order([], 0, 1, True) == [] and select([], 0, 1, True) is None
