"""The lab's staged-pipeline model (lab/stages.py) against the closed form and the plain lab.

These are model checks on virtual time (no clock is read): the simulated inter-token gap and
decode rate of a uniform burst must match the closed form within a stated tolerance, and one
stage with one group must be the lab's `simulate` run, time stamp for time stamp.
"""
from __future__ import annotations

import json

import pytest

from skippy_scheduler import QueueFull, SchedulerConfig
from skippy_scheduler.cli import main
from skippy_scheduler.lab.model import LAB_COST, SimRequest, StepCost, burst_requests
from skippy_scheduler.lab.simulate import SimulationError, simulate
from skippy_scheduler.lab.stages import (StagedPipeline, closed_form, run_staged,
                                         staged_table)

COST = LAB_COST  # 50, 2, 100, 20 µs
GAP_TOLERANCE = 0.02  # mean gap: the groups' staggered prefills shift a few gaps only
RATE_TOLERANCE = 0.05  # decode rate: its span also holds the groups' staggered starts


def _assert_same_as_simulate(requests: list[SimRequest], backend: str,
                             config: SchedulerConfig) -> None:
    staged = run_staged(config, StagedPipeline.uniform(1, COST), 1, requests, backend=backend)
    plain = simulate(config, COST, requests, backend=backend)
    assert staged.makespan_us == plain.makespan_us
    assert staged.plans == plain.iterations
    for rid, m in plain.requests.items():
        times = staged.token_times[rid]
        assert len(times) == m.generated
        assert times[0] == m.first_token_us
        assert times[-1] == m.last_token_us
        assert staged.completed_us[rid] == m.completed_us
        gaps = [b - a for a, b in zip(times, times[1:])]
        assert (max(gaps) if gaps else None) == m.max_inter_token_gap_us


def test_one_stage_one_group_is_the_plain_lab(backend: str) -> None:
    _assert_same_as_simulate(burst_requests(12, 64, 32), backend, SchedulerConfig())


def test_one_stage_equals_plain_lab_with_arrivals_and_chunks(backend: str) -> None:
    requests = [SimRequest(f"r{i}", 700 * i, 300 + 37 * i, 5 + i) for i in range(9)]
    config = SchedulerConfig(max_tokens_per_iteration=256, prefill_chunk_tokens=128,
                             max_active_sequences=4, mixed_prefill_decode=True)
    _assert_same_as_simulate(requests, backend, config)


@pytest.mark.parametrize("hop", [0.0, 100.0])
def test_uniform_table_matches_closed_form(backend: str, hop: float) -> None:
    requests = burst_requests(12, 64, 32)
    rows = staged_table(SchedulerConfig(), COST, requests, (1, 2, 3, 4), hop, 0.0,
                        backend=backend)
    assert [(r["stages"], r["groups"]) for r in rows] == [
        (p, g) for p in (1, 2, 3, 4) for g in range(1, p + 1)]
    for r in rows:
        assert r["tokens"] == 12 * 32
        assert r["mean_gap_us"] == pytest.approx(r["form_gap_us"], rel=GAP_TOLERANCE), r
        assert r["decode_tokens_s"] == pytest.approx(r["form_tokens_s"], rel=RATE_TOLERANCE), r
        if r["groups"] == 1:  # one group: every gap is the round trip (float sums)
            assert r["p99_gap_us"] == pytest.approx(r["form_gap_us"], rel=1e-9)
    # More groups never lower the rate of the same pipeline; splitting with a hop costs.
    for p in (2, 3, 4):
        rates = [r["decode_tokens_s"] for r in rows if r["stages"] == p]
        assert rates == sorted(rates)


def test_a_burst_past_a_groups_limit_is_formed_as_waves(backend: str) -> None:
    """A group decodes at most max_active rows at once; a larger burst runs in waves of them,
    and the closed form's b is a wave's rows, not the group's share of the burst."""
    config = SchedulerConfig(max_active_sequences=8, max_waiting_sequences=64)
    rows = staged_table(config, COST, burst_requests(64, 64, 32), (2,), 100.0, 0.0,
                        backend=backend)
    for r in rows:
        pipe = StagedPipeline.uniform(2, StepCost(
            base_us=COST.base_us, per_prefill_token_us=COST.per_prefill_token_us / 2,
            decode_base_us=COST.decode_base_us / 2, per_decode_row_us=COST.per_decode_row_us / 2),
            100.0, 0.0)
        assert r["form_gap_us"] == closed_form(pipe, r["groups"], 8)["gap_us"]
        assert r["mean_gap_us"] == pytest.approx(r["form_gap_us"], rel=0.05), r


def test_full_pipeline_is_bound_by_the_slowest_stage(backend: str) -> None:
    slow = StepCost(base_us=50, per_prefill_token_us=2, decode_base_us=400, per_decode_row_us=20)
    pipe = StagedPipeline((COST, slow, COST), hop_us=10.0, overhead_us=5.0)
    requests = burst_requests(12, 16, 40)
    for groups in (1, 2, 3):
        form = closed_form(pipe, groups, 12 // groups)
        sim = run_staged(SchedulerConfig(), pipe, groups, requests, backend=backend).summary()
        assert sim["mean_gap_us"] == pytest.approx(form["gap_us"], rel=GAP_TOLERANCE)
        assert sim["decode_tokens_s"] == pytest.approx(form["tokens_s"], rel=RATE_TOLERANCE)
    # With three groups the slow stage is busy all the time: the pipeline is full.
    assert closed_form(pipe, 3, 4)["full"] == 1.0
    assert closed_form(pipe, 1, 12)["full"] == 0.0


def test_every_request_finishes_with_its_tokens(backend: str) -> None:
    requests = [SimRequest(f"r{i}", 50 * i, 20 + i, 1 + i % 5) for i in range(10)]
    report = run_staged(SchedulerConfig(max_active_sequences=2), StagedPipeline.uniform(
        3, COST, hop_us=30.0), 2, requests, backend=backend)
    assert sorted(report.completed_us) == sorted(r.id for r in requests)
    for r in requests:
        times = report.token_times[r.id]
        assert len(times) == r.output_tokens
        assert times == sorted(times) and times[0] > r.arrival_us


def test_bad_pipelines_and_groups_are_refused() -> None:
    with pytest.raises(ValueError, match="tuple of 1-64"):
        StagedPipeline(())
    with pytest.raises(TypeError, match="StepCost"):
        StagedPipeline((COST, "fast"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="hop_us"):
        StagedPipeline((COST,), hop_us=-1.0)
    with pytest.raises(ValueError, match="groups"):
        run_staged(SchedulerConfig(), StagedPipeline((COST,)), 0, burst_requests(1, 4, 4))
    with pytest.raises(ValueError, match="at least one request"):
        run_staged(SchedulerConfig(), StagedPipeline((COST,)), 1, [])


def test_a_refused_submit_or_several_plans_in_flight_end_the_run(backend: str) -> None:
    # A full waiting queue refuses the third request of the burst: the run stops and says which.
    with pytest.raises(SimulationError, match="submit of request-2 failed: .*queue is full") \
            as caught:
        run_staged(SchedulerConfig(max_waiting_sequences=2, max_active_sequences=1),
                   StagedPipeline((COST,)), 1, burst_requests(4, 8, 4), backend=backend)
    assert isinstance(caught.value.__cause__, QueueFull)
    # Each group keeps one plan at a time (the groups are the plans in flight).
    with pytest.raises(ValueError, match="max_inflight_plans must be 1, got 2"):
        run_staged(SchedulerConfig(max_inflight_plans=2), StagedPipeline((COST,)), 1,
                   burst_requests(2, 8, 4), backend=backend)


def test_cli_prints_and_writes_the_table(tmp_path, capsys) -> None:
    out = tmp_path / "staged.json"
    assert main(["lab", "--pipeline-stages", "1,2", "--hop-us", "0",
                 "--pipeline-requests", "4", "--json", str(out)]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if not ln.startswith("#")]
    assert lines[0].split("\t")[:2] == ["stages", "groups"]
    assert [ln.split("\t")[:2] for ln in lines[1:]] == [["1", "1"], ["2", "1"], ["2", "2"]]
    doc = json.loads(out.read_text())
    assert doc["hop_us"] == 0 and len(doc["rows"]) == 3


@pytest.mark.parametrize("argv, message", [
    (["lab", "--hop-us", "5"], "--hop-us needs --pipeline-stages"),
    (["lab", "--pipeline-stages", "2", "--suite"], "a run of its own"),
    (["lab", "--pipeline-stages", "2", "--requests", "3"], "does not apply"),
])
def test_cli_refuses_mixed_runs(argv: list[str], message: str, capsys) -> None:
    assert main(argv) != 0
    assert message in capsys.readouterr().err


def test_cli_refuses_bad_stage_lists(capsys) -> None:
    assert main(["lab", "--pipeline-stages", "0,2"]) != 0
    assert "stage counts must be 1-64" in capsys.readouterr().err
