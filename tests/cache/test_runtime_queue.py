"""Server cache-runtime queue (behaviour.md §8b)."""
from types import SimpleNamespace

import pytest

from skippy_scheduler.cache_policy import CacheAffinity, StageCacheAffinity
from skippy_scheduler.runtime_queue import (
    CacheRuntimeQueue,
    CacheRuntimeTelemetry,
    should_serve_cache_runtime,
)


def hit(matched, epoch=0, cost=1, stage=0):
    return CacheAffinity.from_stage(StageCacheAffinity(stage, matched, cost, 0, epoch))


COLD = CacheAffinity()


@pytest.mark.parametrize(
    "cache, work, last, expected",
    [(True, True, False, True), (True, True, True, False), (True, False, True, True),
     (False, True, False, False), (False, False, False, False), (True, False, False, True),
     (False, True, True, False)],
)
def test_alternation_truth_table(cache, work, last, expected):
    assert should_serve_cache_runtime(cache, work, last) is expected


def test_alternation_arguments_are_bools():
    with pytest.raises(TypeError):
        should_serve_cache_runtime(1, True, False)


def test_hot_operation_runs_before_cold():
    q = CacheRuntimeQueue(4096, True)
    q.push("cold", [1, 2, 3], 0, COLD)
    q.push("hot", [4, 5, 6], 0, hit(32))
    q.advance_turn()
    op, t = q.pop_next()
    assert op == "hot"
    assert t == CacheRuntimeTelemetry(32, 32, 1, 1, 0, False)
    assert q.pop_next()[0] == "cold"
    assert q.pop_next() is None and len(q) == 0


def test_shared_waiting_prefixes_stay_adjacent_across_turns():
    q = CacheRuntimeQueue(4096, True)
    q.push("unique", [9, 9, 9], 0, COLD)
    q.advance_turn()
    q.push("shared-a", [1, 2, 3], 0, COLD)
    q.advance_turn()
    q.push("shared-b", [1, 2, 4], 0, COLD)
    q.advance_turn()
    assert q.turn == 3 and len(q) == 3
    popped = [q.pop_next() for _ in range(3)]
    assert [op for op, _ in popped] == ["shared-a", "shared-b", "unique"]
    assert [t.age_turns for _, t in popped] == [2, 1, 3]


def test_without_grouping_the_oldest_runs_first():
    q = CacheRuntimeQueue(4096, False)
    for turn, (name, prompt) in enumerate([("unique", [9]), ("a", [1, 2]), ("b", [1, 3])]):
        q.push(name, prompt, 0, COLD)
        q.advance_turn()
    assert [q.pop_next()[0] for _ in range(3)] == ["unique", "a", "b"]


def test_stale_affinity_is_refreshed_before_selection():
    q = CacheRuntimeQueue(4096, True)
    q.push("stale-hot", [1, 2, 3], 0, hit(32, epoch=1), refresh=lambda: CacheAffinity())
    q.push("fresh-hot", [4, 5, 6], 0, COLD, refresh=lambda: hit(64, epoch=2))
    q.advance_turn()
    op, t = q.pop_next()
    assert op == "fresh-hot"
    assert t.stale_affinity_fallback is True and t.cache_epoch == 2
    assert t.matched_tokens == 64 and t.saved_cost == 64 and t.stage_hits == 1
    op, t = q.pop_next()
    assert op == "stale-hot" and t.stale_affinity_fallback and t.matched_tokens == 0


def test_unchanged_refresh_is_not_stale_and_epoch_is_the_newest_stage():
    aff = CacheAffinity((StageCacheAffinity(0, 0, 5, 0, 7), StageCacheAffinity(1, 3, 5, 1, 4)))
    q = CacheRuntimeQueue(1, True)
    q.push("op", [1], 0, aff, refresh=lambda: CacheAffinity(tuple(aff.stages)))
    op, t = q.pop_next()
    assert t == CacheRuntimeTelemetry(3, 14, 0, 1, 7, False)


def test_priority_precedes_cache_value_and_new_pushes_rerank():
    q = CacheRuntimeQueue(10, True)
    q.push("hot", [1], 0, hit(1000))
    q.push("urgent", [2], 1, COLD)
    assert q.pop_next()[0] == "urgent"
    q.push("hotter", [3], 0, hit(2000))
    assert [q.pop_next()[0] for _ in range(2)] == ["hotter", "hot"]


def test_from_config_reads_the_scheduler_fields():
    cfg = SimpleNamespace(cache_aging_cost_per_iteration=4096, group_waiting_prefixes=False)
    q = CacheRuntimeQueue.from_config(cfg)
    q.push("unique", [9], 0, COLD)
    q.advance_turn()
    q.push("a", [1, 2], 0, COLD)
    q.push("b", [1, 3], 0, COLD)
    assert [q.pop_next()[0] for _ in range(3)] == ["unique", "a", "b"]

    class Normalizing:
        cache_aging_cost_per_iteration = 0
        group_waiting_prefixes = True

        def normalized(self):
            return SimpleNamespace(cache_aging_cost_per_iteration=1, group_waiting_prefixes=True)

    assert isinstance(CacheRuntimeQueue.from_config(Normalizing()), CacheRuntimeQueue)


def test_bad_input_changes_nothing():
    q = CacheRuntimeQueue(1, True)
    with pytest.raises(TypeError):
        CacheRuntimeQueue(1, 1)
    with pytest.raises(ValueError):
        CacheRuntimeQueue(-1, True)
    with pytest.raises(ValueError):
        q.push("x", [2**31], 0, COLD)
    with pytest.raises(TypeError):
        q.push("x", [1], 0, None)
    with pytest.raises(ValueError):
        q.push("x", [1], -1, COLD)
    with pytest.raises(TypeError):
        q.push("x", [1], 0, COLD, refresh=5)
    assert len(q) == 0
    q.push("a", [1], 0, hit(5), refresh=lambda: "not an affinity")
    q.push("b", [2], 0, hit(1), refresh=lambda: hit(9))
    with pytest.raises(TypeError):
        q.pop_next()
    assert len(q) == 2  # nothing popped, nothing replaced
