"""Workload suite: seeded generator, fast loop bookkeeping, policies, memory pressure."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from skippy_scheduler.lab import LAB_COST, SimRequest, simulate
from skippy_scheduler.lab.suite import (POLICIES, SUITE_COLUMNS, SuiteOptions, format_suite,
                                        run_policy, run_suite)
from skippy_scheduler.lab.workload import MARKER_BASE, WorkloadSpec, generate

SMALL = WorkloadSpec(requests=300, seed=7, rate=600.0, families=8)
OPTIONS = SuiteOptions(max_active=16, max_tokens=1_024, chunk=256)


def test_generator_is_seeded_and_deterministic():
    a, b = generate(SMALL), generate(SMALL)
    for name in ("arrival_us", "family", "family_prefix", "suffix_len", "output_len", "priority"):
        assert np.array_equal(getattr(a, name), getattr(b, name))
    c = generate(replace(SMALL, seed=8))
    assert not np.array_equal(a.arrival_us, c.arrival_us)


def test_generator_shapes_and_bounds():
    spec = WorkloadSpec(requests=20_000, seed=1, rate=250.0)
    w = generate(spec)
    assert np.all(np.diff(w.arrival_us) >= 0) and w.arrival_us[0] == 0
    mean_gap = np.diff(w.arrival_us).mean()
    assert abs(mean_gap - 1e6 / spec.rate) / (1e6 / spec.rate) < 0.03  # Poisson at the rate
    assert w.output_len.min() >= 1 and w.output_len.max() <= spec.output_max
    assert w.suffix_len.min() >= 1 and w.suffix_len.max() <= spec.suffix_max
    assert spec.prefix_min <= w.family_prefix.min() and w.family_prefix.max() <= spec.prefix_max
    share = (w.family >= 0).mean()
    assert abs(share - spec.family_share) < 0.02
    counts = np.bincount(w.family[w.family >= 0], minlength=spec.families)
    assert counts[0] > 10 * counts[-1]  # Zipf-like: hot and cold families
    assert abs((w.priority > 0).mean() - spec.priority_share) < 0.02
    assert np.median(w.output_len) == pytest.approx(spec.output_median, rel=0.1)


def test_prompts_share_family_prefixes_and_end_with_the_marker():
    w = generate(SMALL)
    members = np.flatnonzero(w.family == w.family[w.family >= 0][0])
    p, q = w.prompt(int(members[0])), w.prompt(int(members[1]))
    k = int(w.family_prefix[w.family[members[0]]])
    assert np.array_equal(p[:k], q[:k]) and p[k] != q[k]
    assert p[-1] == MARKER_BASE + members[0]
    assert len(p) == w.prompt_len[members[0]]
    loner = int(np.flatnonzero(w.family < 0)[0])
    assert len(w.prompt(loner)) == w.suffix_len[loner]


@pytest.mark.parametrize("bad", [dict(requests=0), dict(rate=0.0), dict(family_share=1.5),
                                 dict(requests=300_000)])
def test_generator_validation(bad):
    with pytest.raises(ValueError):
        generate(replace(SMALL, **bad))


def test_suite_loop_matches_the_reference_loop(backend):
    """Without families the suite's fast, array-based loop must time every request exactly like
    `simulate` (§5.4) does for the same requests."""
    spec = replace(SMALL, families=0, priority_share=0.0, requests=200)
    w = generate(spec)
    run = run_policy(w, "cache-aware-aging", "mixed", OPTIONS, backend=backend)
    requests = [SimRequest(w.request_id(r), int(w.arrival_us[r]), int(w.prompt_len[r]),
                           int(w.output_len[r]), token_offset=r * 10_000) for r in range(w.n)]
    report = simulate(OPTIONS.config("mixed"), LAB_COST, requests, backend=backend)
    per = run.per_request
    for r in range(w.n):
        m = report.requests[w.request_id(r)]
        assert per["first_scheduled_us"][r] == m.first_scheduled_us
        assert per["first_token_us"][r] == m.first_token_us
        assert per["completed_us"][r] == m.completed_us
        assert per["max_inter_token_gap_us"][r] == (m.max_inter_token_gap_us or 0)
    assert run.figures["iterations"] == report.iterations
    assert run.figures["mean_batch"] == pytest.approx(report.mean_batch_size)
    assert run.figures["makespan_s"] * 1e6 == report.makespan_us


def _figures_without_wall(run):
    return {k: v for k, v in run.figures.items() if k != "wall_s"}


def test_runs_are_deterministic_and_count_prefix_hits(backend):
    w = generate(SMALL)
    a = run_policy(w, "cache-aware-aging", "phase", OPTIONS, backend=backend)
    b = run_policy(w, "cache-aware-aging", "phase", OPTIONS, backend=backend)
    assert _figures_without_wall(a) == _figures_without_wall(b)
    f = a.figures
    assert f["prefix_hits_first"] > 0.3 * SMALL.requests
    assert f["prefix_hits_first"] == int(a.per_request["prefix_restore"].sum())
    assert f["preemptions"] == 0 and f["recomputed_tokens"] == 0
    assert np.array_equal(a.per_request["generated"], w.output_len)
    assert f["p50_ttft_ms"] <= f["p90_ttft_ms"] <= f["p99_ttft_ms"]
    assert 0 < f["goodput_rps"] <= f["throughput_rps"]
    nofam = run_policy(generate(replace(SMALL, families=0)), "fcfs", "phase", OPTIONS,
                       backend=backend)
    assert nofam.figures["prefix_hits_first"] == 0


def test_memory_pressure_forces_preemption_and_recompute(backend):
    options = replace(OPTIONS, kv_capacity_tokens=6_000, reserve_output_tokens=8)
    run = run_policy(generate(SMALL), "fcfs", "phase", options, backend=backend)
    f = run.figures
    assert f["preemptions"] > 0
    assert f["recomputed_tokens"] > 0
    assert f["readmissions"] == f["preemptions"]
    assert 0 <= f["prefix_hits_readmit"] <= f["readmissions"]
    assert np.array_equal(run.per_request["generated"], generate(SMALL).output_len)


def test_priority_policy_serves_priority_requests_sooner(backend):
    spec = replace(SMALL, requests=400, rate=2_000.0, priority_share=0.2)
    w = generate(spec)
    urgent = w.priority > 0
    fcfs = run_policy(w, "fcfs", "phase", OPTIONS, backend=backend)
    prio = run_policy(w, "priority", "phase", OPTIONS, backend=backend)
    assert np.median(prio.ttft_us[urgent]) < 0.5 * np.median(fcfs.ttft_us[urgent])


def test_policies_and_modes_on_one_trace(backend):
    runs = run_suite(generate(replace(SMALL, requests=150)), options=OPTIONS, backend=backend)
    assert [(r.policy, r.mode) for r in runs] == [(p, m) for m in ("phase", "mixed")
                                                  for p in POLICIES]
    table = format_suite(runs).splitlines()
    assert table[0].split("\t") == list(SUITE_COLUMNS)
    assert len(table) == 9 and all(len(l.split("\t")) == len(SUITE_COLUMNS) for l in table)


def test_suite_cli(tmp_path, capsys, backend):
    import json

    from skippy_scheduler.cli import main

    out_json = tmp_path / "suite.json"
    code = main(["lab", "--suite", "--scheduler", backend, "--requests", "120", "--seed", "3",
                 "--rate", "500", "--max-active", "8", "--policy", "fcfs", "--mixed",
                 "--ttft-target-ms", "40", "--json", str(out_json)])
    out = capsys.readouterr().out.splitlines()
    assert code == 0
    assert out[0].startswith(f"# backend={backend} seed=3 rate=500.0/s")
    # The legend names the cost model and what goodput_rps counts, with the targets used.
    assert out[2].startswith("# virtual time from the cost model iteration_overhead_us=50,"
                             "prefill_token_us=2,decode_batch_us=100,decode_sequence_us=20 ")
    assert "goodput_rps = requests/s with TTFT ≤ 40 ms and mean inter-token gap ≤ 1.5 ms" \
        in out[2]
    assert out[3].split("\t") == list(SUITE_COLUMNS)
    assert out[4].startswith("fcfs\tmixed\t") and len(out) == 5
    doc = json.loads(out_json.read_text())
    assert doc["workload"]["requests"] == 120 and doc["runs"][0]["requests"] == 120
    # The top-level keys docs/lab.md lists; options are the run's settings only.
    assert list(doc) == ["backend", "cost_model", "workload", "options", "runs"]
    assert set(doc["options"]) == {"max_active", "max_tokens", "chunk", "kv_capacity_tokens",
                                   "reserve_output_tokens", "ttft_target_ms", "itl_target_ms"}


def test_suite_cli_rejects_unknown_policy(capsys):
    from skippy_scheduler.cli import main

    assert main(["lab", "--suite", "--policy", "lifo"]) == 2
    assert "unknown policy 'lifo'" in capsys.readouterr().err
