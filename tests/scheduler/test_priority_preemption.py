"""Preemption for priority (behaviour.md §2.8a), native and twin: who is chosen, how many, the
per-plan budget, the guard against thrashing, and that it is off by default."""
from sched_helpers import complete, make_scheduler, pred, row_ids

from skippy_scheduler import IterationPhase, MemoryComponent, Sequence, SequenceStatus


def running(s, *specs):
    """Submits (id, priority) pairs in order, one plan each, so admission order is their order;
    each plan is completed with a non-final token for its sampling rows."""
    for sid, priority in specs:
        s.submit(Sequence(sid, [1, 2], 50, None, priority).with_admission_tokens(2))
        step(s)


def step(s):
    plan = s.plan_iteration()
    complete(s, plan, [pred(i, 7) for i, w in enumerate(plan.work) if w.sample_last])
    return plan


def preempting(impl, **overrides):
    return make_scheduler(impl, priority_preemption=True, **overrides)


def test_off_by_default_a_full_scheduler_only_queues(impl):
    s = make_scheduler(impl, max_active_sequences=2)
    running(s, ("a", 0), ("b", 0))
    s.submit(Sequence("h", [3], 5, None, 9))
    plan = step(s)
    assert sorted(row_ids(plan)) == ["a", "b"] and plan.preempted == 0
    assert s.snapshot().waiting_ids == ["h"]
    assert s.metrics().preempted == 0 and s.metrics().preempted_priority == 0


def test_the_lowest_priority_then_the_newest_is_chosen(impl):
    s = preempting(impl, max_active_sequences=3)
    running(s, ("old_low", 0), ("mid", 1), ("new_low", 0))
    s.submit(Sequence("h", [3], 5, None, 2))
    plan = step(s)
    assert plan.preempted == 1 and plan.admitted == 1
    assert sorted(s.snapshot().active_ids) == ["h", "mid", "old_low"]
    assert s.snapshot().waiting_ids == ["new_low"]
    assert s.sequence("new_low").status is SequenceStatus.PREEMPTED
    m = s.metrics()
    assert (m.preempted, m.preempted_priority) == (1, 1)


def test_equal_or_higher_priority_is_never_preempted(impl):
    s = preempting(impl, max_active_sequences=2)
    running(s, ("a", 2), ("b", 3))
    s.submit(Sequence("h", [3], 5, None, 2))
    before = s.snapshot()
    plan = step(s)
    assert plan.preempted == 0 and s.snapshot().waiting_ids == ["h"]
    assert sorted(s.snapshot().active_ids) == sorted(before.active_ids)


def test_memory_victims_are_no_more_than_needed(impl):
    # 10 bytes per admission token; 100 available: four runners of 2 tokens hold 80.
    kv = [MemoryComponent("kv", 100, 0, 10, 0)]
    s = preempting(impl, memory_components=kv)
    running(s, ("a", 0), ("b", 0), ("c", 0), ("d", 0))
    # 50 bytes needed, 20 free: two victims (60 free) suffice, the newest two.
    s.submit(Sequence("h", [3], 5, None, 1).with_admission_tokens(5))
    plan = step(s)
    assert plan.preempted == 2 and plan.priority_victims == ("d", "c")
    assert s.snapshot().waiting_ids == ["c", "d"]  # the last victim (c) ends up first
    assert sorted(s.snapshot().active_ids) == ["a", "b", "h"]


def test_no_victim_is_taken_when_victims_cannot_make_room(impl):
    kv = [MemoryComponent("kv", 100, 0, 10, 0)]
    s = preempting(impl, memory_components=kv)
    running(s, ("low", 0), ("high", 5))
    s.submit(Sequence("h", [3], 5, None, 1).with_admission_tokens(9))  # needs 90: only 20 eligible
    plan = s.plan_iteration()
    assert plan.preempted == 0 and plan.admitted == 0 and plan.priority_victims == ()
    assert s.snapshot().waiting_ids == ["h"] and sorted(s.snapshot().active_ids) == ["high", "low"]
    assert s.metrics().preempted == 0


def test_the_per_plan_budget_bounds_preemptions(impl):
    s = preempting(impl, max_active_sequences=3, max_priority_preemptions_per_step=1)
    running(s, ("a", 0), ("b", 0), ("c", 0))
    s.submit(Sequence("h1", [3], 5, None, 4))
    s.submit(Sequence("h2", [3], 5, None, 4))
    plan = step(s)
    assert plan.preempted == 1 and "h1" in s.snapshot().active_ids
    assert s.snapshot().waiting_ids[:1] == ["c"]
    plan = step(s)
    assert plan.preempted == 1 and "h2" in s.snapshot().active_ids
    assert s.metrics().preempted_priority == 2


def test_a_zero_budget_disables_it(impl):
    s = preempting(impl, max_active_sequences=1, max_priority_preemptions_per_step=0)
    running(s, ("a", 0))
    s.submit(Sequence("h", [3], 5, None, 4))
    assert step(s).preempted == 0 and s.snapshot().waiting_ids == ["h"]


def test_a_victim_is_guarded_for_the_configured_number_of_plans(impl):
    s = preempting(impl, max_active_sequences=1, priority_preemption_guard_steps=3)
    running(s, ("a", 0))                           # plan 0
    s.submit(Sequence("h", [3], 1, None, 9))       # one token: ends at its first sample
    plan = step(s)                                 # plan 1: a preempted for h, h ends
    assert plan.preempted == 1 and row_ids(plan) == ["h"]
    plan = step(s)                                 # plan 2: a resumes
    assert row_ids(plan) == ["a"]
    s.submit(Sequence("m", [4], 5, None, 5))
    assert step(s).preempted == 0                  # plan 3: 2 plans since: guarded
    assert s.snapshot().waiting_ids == ["m"]
    plan = step(s)                                 # plan 4: 3 plans since: no longer
    assert plan.preempted == 1 and row_ids(plan) == ["m"]
    assert s.metrics().preempted_priority == 2


def test_a_victim_resumes_by_recompute_with_its_tokens(impl):
    s = preempting(impl, max_active_sequences=1)
    running(s, ("a", 0))
    step(s)  # a decodes: prompt [1, 2] + generated [7, 7]
    s.submit(Sequence("h", [3], 1, None, 9))
    step(s)
    plan = step(s)
    assert row_ids(plan) == ["a"]
    row = plan.work[0]
    # The replay is the prompt and the confirmed tokens but the last, which is decoded next.
    assert list(row.tokens) == [1, 2, 7] and list(row.positions) == [0, 1, 2]
    assert list(s.sequence("a").generated_tokens) == [7, 7]


def _mixing_allowed(impl, lanes):
    """Mixing on, no decode-only duration observed yet: the reference gate (§2.6) would plan a
    waiting prompt's prefill alone."""
    return preempting(impl, max_active_sequences=lanes, mixed_prefill_decode=True,
                      max_consecutive_prefill_iterations=1)


def test_the_preempting_plan_runs_the_decode_rows_beside_the_prefill(impl):
    s = _mixing_allowed(impl, 2)
    running(s, ("a", 0), ("b", 0))
    step(s)  # both decode
    s.submit(Sequence("h", [3, 4, 5], 5, None, 9))
    plan = step(s)
    assert plan.preempted == 1 and plan.priority_victims == ("b",)
    # §2.8a point 6: a mixed plan, so `a` does not pause for h's prompt.
    assert {w.sequence_id: w.phase for w in plan.work} == {
        "a": IterationPhase.DECODE, "h": IterationPhase.PREFILL}
    assert s.mixed_prefill_viable  # the gate is neither read nor changed


def test_an_admission_that_preempts_nothing_keeps_the_reference_gate(impl):
    s = _mixing_allowed(impl, 3)
    running(s, ("a", 0), ("b", 0))
    step(s)
    s.submit(Sequence("c", [3, 4, 5], 5, None, 9))  # a free lane: admitted, nobody preempted
    plan = step(s)
    assert plan.preempted == 0
    assert {w.sequence_id: w.phase for w in plan.work} == {"c": IterationPhase.PREFILL}


def test_without_mixing_the_preempting_plan_is_prefill_only(impl):
    s = preempting(impl, max_active_sequences=2, max_consecutive_prefill_iterations=1)
    running(s, ("a", 0), ("b", 0))
    step(s)
    s.submit(Sequence("h", [3, 4, 5], 5, None, 9))
    plan = step(s)
    assert plan.preempted == 1
    assert {w.sequence_id: w.phase for w in plan.work} == {"h": IterationPhase.PREFILL}
