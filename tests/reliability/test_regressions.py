"""Regression tests for defects found by the differential and stateful tests."""
import pytest

from skippy_scheduler import (
    AdmissionPolicy,
    IterationPrediction,
    MemoryComponent,
    PreemptionPolicy,
    Scheduler,
    SchedulerConfig,
    Sequence,
)
from sched_helpers import complete


class NewestFirst(AdmissionPolicy):
    def order(self, candidates, current_turn):
        return [c.index for c in sorted(candidates, key=lambda c: -c.order)]


class LongestPrompt(PreemptionPolicy):
    def select_victim(self, candidates):
        return max(range(len(candidates)), key=lambda i: candidates[i].computed_tokens)


def test_user_written_policies_run_on_the_native_scheduler():
    # The native callbacks used to look the policies up under attribute names that did not
    # exist, so every user policy failed with AttributeError on the first plan.
    s = Scheduler(
        SchedulerConfig(max_active_sequences=2, memory_components=[MemoryComponent("kv", 100, 0, 1, 0)]),
        admission=NewestFirst(),
        preemption=LongestPrompt(),
    )
    for sequence_id, length in (("a", 2), ("b", 3), ("c", 4)):
        s.submit(Sequence(sequence_id, list(range(length)), 1))
    plan = s.plan_iteration()
    assert [w.sequence_id for w in plan.work] == ["c", "b"]
    telemetry = complete(s, plan, [IterationPrediction(0, 5), IterationPrediction(1, 6)])
    assert telemetry.finished_ids == ["c", "b"]
    s.submit(Sequence("d", [1, 2, 3, 4, 5], 4))
    s.submit(Sequence("e", [1], 4))
    plan = s.plan_iteration()
    assert [(w.sequence_id, len(w.tokens)) for w in plan.work] == [("e", 1), ("d", 5)]
    assert s.snapshot().waiting_ids == ["a"]
    # Over budget: the policy picks the sequence with the most computed tokens ("d").
    assert s.preempt_for_component_pressure([101]) == ["d"]
    assert s.snapshot().component_used_bytes == [("kv", 101 - 9)]


def test_radix_twin_stats_saturate_like_the_native_cache():
    # Found by tests/fuzz/fuzz_radix.py: the flat twin summed logical bytes past u64.
    from skippy_scheduler.reference import RadixTwin
    from skippy_scheduler.radix import UnifiedRadixCache

    big = (1 << 64) - 1
    caches = [UnifiedRadixCache(), RadixTwin()]
    for cache in caches:
        cache.insert_resident("s", [1], big, "a")
        cache.insert_resident("s", [2], 5, "b")
    native, twin = caches
    assert twin.stats()["resident_logical_bytes"] == big == native.stats().resident_logical_bytes


@pytest.mark.parametrize("components", [[], [MemoryComponent("kv", 10, 0, 1, 0)]])
def test_pressure_before_any_admission(components):
    # Under UBSan (.ci/run's sanitizer run) this caught memcpy from and to NULL arrays with a
    # zero length: the active set and its scratch copy do not exist before the first admission.
    s = Scheduler(SchedulerConfig(memory_components=components))
    assert s.preempt_for_component_pressure([50]) == []
    assert s.snapshot().component_used_bytes == [("kv", 50)] * len(components)
