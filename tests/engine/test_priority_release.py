"""The engine hands a priority victim's lane back to the host before the plan that took it runs
(docs/behaviour.md §2.8a): with one lane, a high-priority arrival preempts the running
low-priority request, the host sees `release(low, PREEMPTED)` first, never holds more lanes than
the scheduler allows, and both requests still get their own tokens."""
from __future__ import annotations

from skippy_scheduler import ReleaseReason, SchedulerConfig
from skippy_scheduler.cost_model import LAB_COST
from skippy_scheduler.engine import CostModelHost, Engine, Request, VirtualClock


class LaneHost(CostModelHost):
    """Echoes each row's last input token and tracks which sequences hold a lane."""

    def __init__(self, lanes: int) -> None:
        super().__init__(token=None)
        self.lanes = lanes
        self.held: set[str] = set()
        self.log: list[tuple[str, str]] = []

    def execute(self, plan) -> None:  # type: ignore[no-untyped-def]
        ids = plan.sequence_ids
        for row in range(len(plan)):
            if plan.new_rows[row]:
                self.held.add(ids[row])
                self.log.append(("new", ids[row]))
        assert len(self.held) <= self.lanes, f"lanes held: {sorted(self.held)}"
        super().execute(plan)

    def release(self, sequence_id: str, reason: ReleaseReason = ReleaseReason.FINISHED) -> None:
        self.held.discard(sequence_id)
        self.log.append((reason.name, sequence_id))


def _run(impl, preemption: bool):
    config = SchedulerConfig(max_active_sequences=1, max_tokens_per_iteration=64,
                             prefill_chunk_tokens=16, priority_preemption=preemption)
    host = LaneHost(lanes=1)
    engine = Engine(impl(config), host, clock=VirtualClock(LAB_COST))
    report = engine.run([Request("low", list(range(10, 30)), 40, arrival_us=0),
                         Request("high", [7, 8, 9], 3, arrival_us=500, priority=5)])
    return host, {r.id: r for r in report.records}


def test_a_priority_victim_is_released_before_its_lane_is_reused(impl):
    host, records = _run(impl, preemption=True)
    assert ("PREEMPTED", "low") in host.log
    assert host.log.index(("PREEMPTED", "low")) < host.log.index(("new", "high"))
    assert not host.held
    # The echo model makes each token the previous one: a resume recomputes, tokens unchanged.
    assert list(records["high"].tokens) == [9, 9, 9]
    assert list(records["low"].tokens) == [29] * 40
    assert records["low"].preemptions == 1


def test_without_the_rule_the_high_request_waits_for_the_lane(impl):
    host, records = _run(impl, preemption=False)
    assert all(reason != "PREEMPTED" for reason, _ in host.log)
    assert host.log.index(("FINISHED", "low")) < host.log.index(("new", "high"))
    assert list(records["high"].tokens) == [9, 9, 9]
