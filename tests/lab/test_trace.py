"""§5.7 per-iteration trace: format and the staggered-prefill-mixed pattern."""
from __future__ import annotations

import re

ROW = r"[\w-]+:(Prefill|Recompute|Decode):\d+@\d+\*?"
ITERATION = re.compile(rf"^it=(\d+) t=(\d+) dur=(\d+) admitted=(\d+) tokens=(\d+) \| {ROW}( {ROW})*$")
REQUEST = re.compile(r"^req ([\w-]+): arrival=(\d+|None) first_sched=(\d+|None) "
                     r"first_tok=(\d+|None) done=(\d+|None) gen=(\d+) max_gap=(\d+|None)$")


def _iterations(trace):
    return [line for line in trace if line.startswith("it=")]


def _rows(line):
    return [tuple(cell.split(":")) for cell in line.split(" | ", 1)[1].split(" ")]


def test_every_trace_line_has_the_documented_shape(backend, scenario_results):
    for name, result in scenario_results(backend).items():
        trace = result.trace
        assert trace[0] == f"### scenario {name}"
        its = _iterations(trace)
        assert len(its) == result.report.iterations
        assert [int(ITERATION.match(line).group(1)) for line in its] == list(range(len(its)))
        reqs = trace[1 + len(its):]
        assert len(reqs) == len(result.report.requests)
        assert [REQUEST.match(line).group(1) for line in reqs] == sorted(result.report.requests)
        # time is contiguous: each iteration starts where the previous one ended, or later
        ends = [int(ITERATION.match(l).group(2)) + int(ITERATION.match(l).group(3)) for l in its]
        starts = [int(ITERATION.match(l).group(2)) for l in its]
        assert all(s >= e for s, e in zip(starts[1:], ends))
        assert ends[-1] == result.report.makespan_us


def test_staggered_prefill_mixed_pattern(backend, scenario_results):
    trace = scenario_results(backend)["staggered-prefill-mixed"].trace
    its = _iterations(trace)

    def phases(n):
        return {row[1] for row in _rows(its[n])}

    assert phases(11) == {"Prefill"}  # 2 live decode rows, only the 1-row baseline known
    assert phases(12) == {"Decode"} and len(_rows(its[12])) == 2  # calibrates 2 rows
    assert phases(13) == {"Decode", "Prefill"}  # now mixed
    assert its[7] == ("it=7 t=1134 dur=682 admitted=1 tokens=257 | decoder:Decode:1@38* "
                      "prefill-0:Prefill:256@0")
    assert its[13] == ("it=13 t=7174 dur=1726 admitted=0 tokens=770 | decoder:Decode:1@43* "
                       "prefill-0:Decode:1@1025* prefill-1:Prefill:256@768* "
                       "prefill-2:Prefill:256@512 prefill-3:Prefill:256@256")
    assert trace[-5] == ("req decoder: arrival=0 first_sched=0 first_tok=114 done=19406 gen=64 "
                         "max_gap=1776")


def test_single_token_request_prints_none_gap(backend):
    from skippy_scheduler.lab import LAB_COST, SimRequest, simulate
    from skippy_scheduler.lab.scenarios import make_config

    trace: list[str] = []
    simulate(make_config(), LAB_COST, [SimRequest("solo", 0, 8, 1)], backend=backend,
             trace=trace)
    assert trace == ["it=0 t=0 dur=66 admitted=1 tokens=8 | solo:Prefill:8@0*",
                     "req solo: arrival=0 first_sched=0 first_tok=66 done=66 gen=1 max_gap=None"]


def test_radix_cache_aware_trace_starts_with_the_restored_suffix(backend, scenario_results):
    its = _iterations(scenario_results(backend)["radix-cache-aware"].trace)
    assert its[0] == "it=0 t=0 dur=562 admitted=1 tokens=256 | c-hot:Prefill:256@3072"


def test_fractional_cost_model_trace_values(backend):
    from skippy_scheduler.lab import SimRequest, StepCost, simulate
    from skippy_scheduler.lab.scenarios import make_config

    trace: list[str] = []
    cost = StepCost(12.5, 0.75, 30.25, 4.1)
    simulate(make_config(), cost, [SimRequest("solo", 0, 8, 2)], backend=backend, trace=trace)
    assert trace == ["it=0 t=0 dur=18.5 admitted=1 tokens=8 | solo:Prefill:8@0*",
                     "it=1 t=18.5 dur=46.85 admitted=0 tokens=1 | solo:Decode:1@8*",
                     "req solo: arrival=0 first_sched=0 first_tok=18.5 done=65.35 gen=2 "
                     "max_gap=46.85"]
