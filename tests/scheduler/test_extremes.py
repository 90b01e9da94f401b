"""Saturating arithmetic at the type limits (§1.0, §7.15): nothing wraps, nothing raises."""
from sched_helpers import affinity, complete, make_scheduler, pred, row_ids

from skippy_scheduler import MemoryComponent, PrefixRestore, Sequence

U64_MAX = (1 << 64) - 1
U32_MAX = (1 << 32) - 1


def test_reservations_saturate_instead_of_wrapping(impl):
    s = make_scheduler(impl, memory_components=[MemoryComponent("huge", U64_MAX, 0, U64_MAX, U64_MAX)])
    s.submit(Sequence("a", [1], 1, None, 1))
    s.submit(Sequence("b", [2], 1, None, 1))
    plan = s.plan_iteration()
    # U64_MAX + U64_MAX saturates to U64_MAX, which still fits the available U64_MAX.
    assert plan.admitted == 2
    assert s.snapshot().component_used_bytes == [("huge", U64_MAX)]
    telemetry = complete(s, plan, [pred(0, 5), pred(1, 6)])
    assert telemetry.finished_ids == ["a", "b"]
    assert telemetry.component_used_bytes == [("huge", 0)]
    assert telemetry.component_available_bytes == [("huge", U64_MAX)]


def test_a_reservation_above_capacity_waits_forever_without_blocking_others(impl):
    s = make_scheduler(impl, memory_components=[MemoryComponent("kv", 1000, 0, 1, 0)])
    s.submit(Sequence("giant", [1], U32_MAX, None, 1).with_admission_tokens(U64_MAX))
    s.submit(Sequence("small", [2], 1, None, 1))
    plan = s.plan_iteration()
    assert row_ids(plan) == ["small"] and s.snapshot().waiting_ids == ["giant"]


def test_extreme_priorities_and_aging(impl):
    s = make_scheduler(impl, max_active_sequences=1, cache_aging_cost_per_iteration=U64_MAX)
    s.submit(Sequence("low", [1], 1, None, 0).with_cache_affinity(affinity(U64_MAX, matched=U64_MAX)))
    s.submit(Sequence("top", [2], 1, None, U64_MAX))
    s.plan_iteration()
    assert s.snapshot().active_ids == ["top"]


def test_huge_restore_and_max_tokens(impl):
    s = make_scheduler(impl)
    s.submit(Sequence("a", [1, 2, 3], U32_MAX, None, 1).with_prefix_restore(PrefixRestore("p", U64_MAX)))
    plan = s.plan_iteration()
    assert [(list(w.tokens), list(w.positions)) for w in plan.work] == [([3], [2])]
    complete(s, plan, [pred(0, (1 << 31) - 1)])
    plan = s.plan_iteration()
    assert [(list(w.tokens), list(w.positions)) for w in plan.work] == [([(1 << 31) - 1], [3])]


def test_extreme_pressure_values(impl):
    s = make_scheduler(impl, memory_components=[MemoryComponent("kv", 100, 0, 1, 0)])
    s.submit(Sequence("a", [1], 3, None, 1))
    s.plan_iteration()
    assert s.preempt_for_component_pressure([U64_MAX]) == ["a"]
    assert s.snapshot().component_used_bytes == [("kv", U64_MAX - 4)]
    assert s.preempt_for_component_pressure([0, U64_MAX]) == []
    assert s.snapshot().component_used_bytes == [("kv", 0)]
