"""A policy callback that calls back into its scheduler to change it (cancel, submit, plan,
complete, preempt) gets a RuntimeError, and the call that ran the policy fails with nothing
changed, on both schedulers: before, the native one listed a cancelled sequence as waiting and
admitted a freed slot twice, and the twin dropped every sequence."""
from __future__ import annotations

import pytest

from skippy_scheduler import MemoryComponent, SchedulerConfig, Sequence
from skippy_scheduler.policies import FcfsAdmission, PreemptionPolicy

MEMORY = [MemoryComponent("kv", 1000, 0, 1, 0)]


def _run_one_step(s) -> None:
    plan = s.plan_iteration()
    out = plan.outputs
    rows = [r for r in range(len(plan)) if plan.sample_last[r]]
    out.request_indexes[:len(rows)] = rows
    out.predicted_tokens[:len(rows)] = 7
    out.count = len(rows)
    s.complete_iteration(plan)


@pytest.mark.parametrize("call", ["cancel", "submit", "plan", "preempt"])
def test_a_victim_policy_that_changes_the_scheduler_is_refused(impl, call):
    box: dict = {}

    class Meddling(PreemptionPolicy):
        def select_victim(self, candidates):
            s = box["s"]
            {"cancel": lambda: s.cancel(candidates[0].sequence_id),
             "submit": lambda: s.submit(Sequence("x", [1, 2], max_tokens=2)),
             "plan": s.plan_iteration,
             "preempt": lambda: s.preempt_for_component_pressure([0])}[call]()
            return 0

    s = box["s"] = impl(SchedulerConfig(memory_components=MEMORY), preemption=Meddling())
    s.submit(Sequence("a", [1, 2, 3], max_tokens=4))
    _run_one_step(s)
    before = s.snapshot()
    with pytest.raises(RuntimeError, match="inside its admission or preemption policy"):
        s.preempt_for_component_pressure([5000])
    assert s.snapshot() == before
    _run_one_step(s)  # and it goes on
    assert s.sequence("a") is not None


def test_an_admission_policy_that_submits_is_refused(impl):
    box: dict = {}

    class Meddling(FcfsAdmission):
        def order(self, candidates, turn):
            box["s"].submit(Sequence("x", [1, 2], max_tokens=2))
            return super().order(candidates, turn)

    s = box["s"] = impl(SchedulerConfig(), admission=Meddling())
    s.submit(Sequence("a", [1, 2, 3], max_tokens=4))
    s.submit(Sequence("b", [4, 5], max_tokens=4))
    before = s.snapshot()
    with pytest.raises(RuntimeError, match="inside its admission or preemption policy"):
        s.plan_iteration()
    assert s.snapshot() == before
    assert s.live_plans == 0

