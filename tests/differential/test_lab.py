"""The lab's drivers give the same figures on the native scheduler and the pure-Python twin:
the reference scenarios (reports and per-iteration traces), the workload suite under every
policy with memory pressure, and a trace replay with a bounded prefix cache (which also
repeats exactly)."""
from __future__ import annotations

from dataclasses import replace

from lab_support import conversation_rows, mooncake_file
from skippy_scheduler.lab.replay import ReplayOptions, run_replay
from skippy_scheduler.lab.scenarios import SCENARIO_NAMES
from skippy_scheduler.lab.suite import POLICIES, SuiteOptions, run_policy
from skippy_scheduler.lab.traces import BLOCK_TOKENS, open_trace
from skippy_scheduler.lab.workload import WorkloadSpec, generate


def _without_wall(figures: dict) -> dict:
    return {k: v for k, v in figures.items() if k != "wall_s"}


def test_reference_scenarios_give_identical_reports_and_traces(scenario_results):
    twin, native = scenario_results("twin"), scenario_results("native")
    for name in SCENARIO_NAMES:
        assert twin[name].report.as_dict() == native[name].report.as_dict(), name
        assert twin[name].trace == native[name].trace, name


def test_suite_figures_agree_under_every_policy_with_memory_pressure():
    w = generate(WorkloadSpec(requests=300, seed=7, rate=600.0, families=8))
    options = SuiteOptions(max_active=16, max_tokens=1_024, chunk=256, kv_capacity_tokens=6_000)
    preempted = 0
    for policy in POLICIES:
        twin = run_policy(w, policy, "mixed", options, backend="twin")
        native = run_policy(w, policy, "mixed", options, backend="native")
        assert _without_wall(twin.figures) == _without_wall(native.figures), policy
        preempted += native.figures["preemptions"]
    assert preempted > 0  # the memory model took part


def test_replay_figures_agree_and_runs_repeat(tmp_path):
    trace = open_trace(mooncake_file(tmp_path, conversation_rows(60, seed=2)), time_scale=0.1)
    options = ReplayOptions(max_active=3, prefix_cache_tokens=8 * BLOCK_TOKENS)
    figures = [_without_wall(run_replay(trace, "cache-aware-aging", options=options,
                                        backend=backend, progress=False).figures)
               for backend in ("twin", "native", "native")]
    assert figures[0] == figures[1] == figures[2]
    assert figures[0]["stale_refreshes"] > 0 and figures[0]["evictions"] > 0
