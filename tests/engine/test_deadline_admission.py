"""The engine feeds a request's first-token deadline to admission (docs/behaviour.md §3.3a):
with one lane busy, requests of one priority that arrive together wait in one score band, and
the one with a `ttft_ms` is admitted first, before earlier equal ones; without deadlines they
are admitted in arrival order. Native core and twin alike."""
from __future__ import annotations

import pytest

from skippy_scheduler import SchedulerConfig
from skippy_scheduler.cost_model import LAB_COST
from skippy_scheduler.engine import CostModelHost, Engine, Request, VirtualClock


class LaneLog(CostModelHost):
    """Echoes each row's last input token and logs the order in which sequences get a lane."""

    def __init__(self) -> None:
        super().__init__(token=None)
        self.admitted: list[str] = []

    def execute(self, plan) -> None:  # type: ignore[no-untyped-def]
        for row in range(len(plan)):
            if plan.new_rows[row]:
                self.admitted.append(plan.sequence_ids[row])
        super().execute(plan)


def _admitted(impl, deadlines: dict[str, float]) -> list[str]:
    config = SchedulerConfig(max_active_sequences=1, max_tokens_per_iteration=64,
                             prefill_chunk_tokens=16)
    host = LaneLog()
    engine = Engine(impl(config), host, clock=VirtualClock(LAB_COST))
    waiting = [Request(name, [40 + k, 41 + k, 42 + k], 2, arrival_us=500,
                       ttft_ms=deadlines.get(name))
               for k, name in enumerate(["a", "b", "c", "d"])]
    report = engine.run([Request("busy", list(range(10, 30)), 30, arrival_us=0)] + waiting)
    tokens = {r.id: list(r.tokens) for r in report.records}
    assert tokens["busy"] == [29] * 30
    assert all(tokens[r.id] == [r.prompt_tokens[-1]] * 2 for r in waiting)  # echo host
    return host.admitted


def test_without_deadlines_equal_requests_are_admitted_in_arrival_order(impl):
    assert _admitted(impl, {}) == ["busy", "a", "b", "c", "d"]


@pytest.mark.parametrize("deadlines, want", [
    ({"c": 50.0}, ["busy", "c", "a", "b", "d"]),
    ({"d": 50.0, "b": 80.0}, ["busy", "d", "b", "a", "c"]),
    ({"b": 80.0, "c": 80.0}, ["busy", "b", "c", "a", "d"]),  # equal deadlines: arrival order
])
def test_the_nearest_deadline_is_admitted_first(impl, deadlines, want):
    assert _admitted(impl, deadlines) == want
