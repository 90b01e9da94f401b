"""The lab library at its edges: the priority scenario's progress bar, figures that are
undefined (no inter-token gap, no preemption) and per-tenant service of a burst."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

import skippy_scheduler.lab.priority as priority
from skippy_scheduler.cost_model import DECODE_PHASE
from skippy_scheduler.lab.priority import PriorityScenario, run_priority_scenario
from skippy_scheduler.lab.suite import SUITE_COLUMNS, format_suite
from skippy_scheduler.lab.driver import LabRun
from skippy_scheduler.lab.tails import TAIL_COLUMNS, format_tails, tail_figures
from skippy_scheduler.lab.tenants import TenantService


class _Bar:
    made: list["_Bar"] = []

    def __init__(self, total, label, *, enabled=None, **kwargs):
        self.total, self.label, self.enabled = total, label, enabled
        self.done: list[int] = []
        self.closed = False
        _Bar.made.append(self)

    def update(self, done):
        self.done.append(done)

    def close(self):
        self.closed = True


def test_priority_scenario_has_a_progress_bar(monkeypatch, backend):
    _Bar.made = []
    monkeypatch.setattr(priority, "Progress", _Bar)
    scenario = PriorityScenario(requests=200)
    runs = run_priority_scenario(scenario, ("admission-order", "preempt-restore"),
                                 backend=backend, progress=True)
    assert [bar.label for bar in _Bar.made] == ["priority/admission-order",
                                                "priority/preempt-restore"]
    for bar, run in zip(_Bar.made, runs):
        assert bar.total == 200 and bar.enabled is True and bar.closed
        assert run.figures["iterations"] > 512 and bar.done  # drive reports every 512 steps
        assert bar.done == sorted(bar.done) and 0 <= bar.done[-1] <= 200


def _timeline(generated, gaps):
    generated = np.asarray(generated, dtype=np.int64)
    max_gap = np.zeros(len(generated))
    at = 0
    for i, n in enumerate(generated.tolist()):
        if n > 1:
            max_gap[i] = max(gaps[at:at + n - 1])
        at += max(n - 1, 0)
    return SimpleNamespace(generated=generated, gaps_us=np.asarray(gaps, dtype=np.float64),
                           max_gap_us=max_gap)


def test_tails_without_a_gap_are_undefined():
    figures = tail_figures(_timeline([1, 1, 1], []), 1.5, ["a", "a", "b"], "tenant")
    assert figures["max_itl_ms"] is None
    assert figures["max_itl_ms_by_group"] == {"a": None, "b": None}
    assert figures["stalls"] == 0
    run = LabRun("fcfs", "mixed", {"policy": "fcfs", "mode": "mixed",
                                   "p50_itl_ms": None, "p99_itl_ms": None,
                                   "p99_max_itl_ms": None, "p50_ttft_ms": 1.0,
                                   "p99_ttft_ms": 2.0, "goodput_fraction": 1.0})
    run.tails = figures
    row = dict(zip(TAIL_COLUMNS, format_tails([run]).splitlines()[1].split("\t")))
    assert [row[k] for k in ("p50_itl_ms", "p99_itl_ms", "max_itl_ms", "p99_max_itl_ms")] \
        == ["-"] * 4


def test_tails_of_a_group_without_a_gap():
    figures = tail_figures(_timeline([3, 1], [1000.0, 3000.0]), 1.5, ["a", "b"], "tenant")
    assert figures["max_itl_ms"] == 3.0
    assert figures["max_itl_ms_by_group"] == {"a": 3.0, "b": None}


def test_suite_table_prints_an_undefined_figure_as_a_dash():
    figures = {column: 0.5 for column in SUITE_COLUMNS}
    figures.update(policy="fcfs", mode="mixed", preemptions=0, recomputed_tokens=0,
                   iterations=3, prefix_hit_rate_readmit=None, p50_itl_ms=None)
    row = dict(zip(SUITE_COLUMNS,
                   format_suite([LabRun("fcfs", "mixed", figures)]).splitlines()[1]
                   .split("\t")))
    assert row["prefix_hit_rate_readmit"] == "-" and row["p50_itl_ms"] == "-"
    assert row["prefix_hit_rate_first"] == "0.5000"


def _decode_plan(rows):
    return SimpleNamespace(row_offsets=np.arange(rows + 1))


def _serve(service, tenants, now):
    service.account(_decode_plan(len(tenants)), bytes([DECODE_PHASE]) * len(tenants),
                    tenants, now)


def test_tenant_service_of_a_burst_is_over_the_whole_run():
    service = TenantService()
    service.enabled = True
    for name in ("t0", "t1", "t2", "t3"):
        service.index(name)
    for _ in range(4):
        service.arrived(0.0)
    service.stream_done = True
    # one plan at a time serves two of the four tenants; the window (the arrivals, all at 0)
    # closes at the first plan, before anyone was served
    for step in range(10):
        _serve(service, [2 * (step % 2), 2 * (step % 2) + 1], 100.0 * step)
    n, rates, jain = service.figures(1000.0)
    assert n == 4
    assert rates == {name: pytest.approx(5 / 1e-3) for name in ("t0", "t1", "t2", "t3")}
    assert jain == pytest.approx(1.0)
    assert service.window == "run"


def test_tenant_service_over_the_arrivals_when_they_span_iterations():
    service = TenantService()
    service.enabled = True
    for name in ("t0", "t1"):
        service.index(name)
    service.arrived(0.0)
    service.arrived(250.0)
    service.stream_done = True
    for step in range(10):  # tenant 0 alone until the window closes at 300 µs
        _serve(service, [0] if step < 3 else [0, 1], 100.0 * step)
    _, rates, jain = service.figures(1000.0)
    assert rates == {"t0": pytest.approx(3 / 300e-6), "t1": 0.0}
    assert jain == pytest.approx(0.5)
    assert service.window == "arrivals"
