"""The lab's priority scenario (docs/lab.md, "Priority that preempts"): a saturating background
and a trickle of priority-1 requests with a prefix store, under admission order, preemption
with recompute and preemption with restore. Virtual time, so the figures are exact."""
from __future__ import annotations

import pytest

from skippy_scheduler.cli import main
from skippy_scheduler.lab.priority import (PRIORITY_COLUMNS, RULES, PriorityScenario,
                                           format_priority_table, run_priority_scenario)

SMALL = PriorityScenario(requests=300, seed=0, urgent_share=0.04)


@pytest.fixture(scope="module")
def runs():
    return {run.policy: run.figures for run in run_priority_scenario(SMALL)}


def test_preemption_cuts_the_urgent_tail_and_keeps_the_background(runs):
    ref = runs["admission-order"]
    assert ref["preempted_priority"] == 0 and ref["urgent"] > 0
    for rule in ("preempt-recompute", "preempt-restore"):
        f = runs[rule]
        assert f["preempted_priority"] > 0
        # (The default scenario, 2 000 requests, is in docs/lab.md.)
        assert f["urgent_p99_ttft_ms"] < 0.5 * ref["urgent_p99_ttft_ms"]
        assert f["background_tokens_per_s"] >= 0.9 * ref["background_tokens_per_s"]
        assert f["requests"] == ref["requests"]


def test_kept_victims_resume_by_restoring_and_the_others_recompute(runs):
    restore, recompute = runs["preempt-restore"], runs["preempt-recompute"]
    assert restore["victims_kept"] > 0 and restore["recomputed_tokens"] == 0
    assert restore["resume_restored_tokens"] > 0
    assert recompute["victims_kept"] == 0 and recompute["recomputed_tokens"] > 0
    assert runs["admission-order"]["recomputed_tokens"] == 0


def test_native_and_twin_give_the_same_figures():
    small = PriorityScenario(requests=100, seed=5, rate=200.0)
    native = run_priority_scenario(small, backend="native")
    twin = run_priority_scenario(small, backend="twin")
    for a, b in zip(native, twin):
        fa = {k: v for k, v in a.figures.items() if k != "wall_s"}
        fb = {k: v for k, v in b.figures.items() if k != "wall_s"}
        assert fa == fb


def test_the_table_has_a_row_per_rule(runs, capsys):
    code = main(["lab", "--suite", "--priority-scenario", "--requests", "80", "--seed", "3"])
    assert code == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("# priority scenario") and lines[1] == "\t".join(PRIORITY_COLUMNS)
    assert [line.split("\t")[0] for line in lines[2:]] == list(RULES)
    assert format_priority_table([]).strip() == lines[1]


def test_the_scenario_refuses_what_it_does_not_read(capsys):
    assert main(["lab", "--suite", "--priority-scenario", "--kv-capacity-tokens", "9"]) == 2
    assert "--kv-capacity-tokens does not apply" in capsys.readouterr().err


def test_a_workload_without_urgent_requests_reports_no_urgent_figure():
    (run,) = run_priority_scenario(PriorityScenario(requests=40, seed=0, urgent_share=0.0),
                                   ["admission-order"])
    f = run.figures
    assert f["urgent"] == 0
    assert f["urgent_p50_ttft_ms"] is None and f["urgent_p99_ttft_ms"] is None
    assert f["background_p50_ttft_ms"] > 0
    row = format_priority_table([run], header=False).split("\t")
    assert row[1:3] == ["-", "-"]
