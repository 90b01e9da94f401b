"""§5.6: every model-outcome column of every reference scenario, as printed."""
from __future__ import annotations

import pytest

from skippy_scheduler.lab.report import COLUMNS, format_row, format_table
from skippy_scheduler.lab.scenarios import SCENARIO_NAMES

# behaviour.md §5.6 reference output (the bench column is machine dependent and omitted).
REFERENCE = """
cold-burst-n1 | 1 | 14.262 | 70.12 | 0.000 | 8.992 | 8.992 | 14.262 | 0.170 | 1.00 | 4.29 | 16 | 31 | 0
warm-divergent-n1 | 1 | 5.352 | 186.85 | 0.000 | 0.082 | 0.082 | 5.352 | 0.170 | 1.00 | 0.07 | 1 | 31 | 0
cold-burst-n2 | 2 | 23.074 | 86.68 | 0.000 | 17.184 | 17.184 | 23.074 | 0.190 | 2.00 | 8.58 | 16 | 31 | 0
warm-divergent-n2 | 2 | 6.004 | 333.11 | 0.000 | 0.114 | 0.114 | 6.004 | 0.190 | 2.00 | 0.14 | 1 | 31 | 0
cold-burst-n4 | 4 | 40.698 | 98.28 | 0.000 | 33.568 | 33.568 | 40.698 | 0.230 | 4.00 | 17.15 | 16 | 31 | 0
warm-divergent-n4 | 4 | 7.308 | 547.35 | 0.000 | 0.178 | 0.178 | 7.308 | 0.230 | 4.00 | 0.29 | 1 | 31 | 0
staggered-prefill | 5 | 19.656 | 254.38 | 0.918 | 5.726 | 6.164 | 19.656 | 8.842 | 1.28 | 2.85 | 9 | 63 | 0
staggered-prefill-bounded | 5 | 19.656 | 254.38 | 1.618 | 6.980 | 7.264 | 19.656 | 1.796 | 1.28 | 2.85 | 9 | 63 | 0
staggered-prefill-mixed | 5 | 19.406 | 257.65 | 1.398 | 6.766 | 6.974 | 19.406 | 1.776 | 1.37 | 3.06 | 4 | 58 | 5
radix-fcfs | 3 | 27.882 | 107.60 | 23.084 | 20.534 | 25.332 | 27.882 | 0.170 | 1.00 | 5.58 | 36 | 45 | 0
radix-cache-aware | 3 | 27.882 | 107.60 | 16.340 | 13.790 | 25.332 | 27.882 | 0.170 | 1.00 | 5.58 | 36 | 45 | 0
waiting-prefix-fcfs | 3 | 34.626 | 86.64 | 23.084 | 20.534 | 32.076 | 34.626 | 0.170 | 1.00 | 6.48 | 48 | 45 | 0
waiting-prefix-dfs | 3 | 34.626 | 86.64 | 23.084 | 20.534 | 32.076 | 34.626 | 0.170 | 1.00 | 6.48 | 48 | 45 | 0
"""
ROWS = {line.split(" | ")[0]: line.split(" | ") for line in REFERENCE.strip().splitlines()}


def test_reference_lists_the_thirteen_scenarios_in_order():
    assert list(ROWS) == list(SCENARIO_NAMES)
    assert len(ROWS) == 13


@pytest.mark.parametrize("name", SCENARIO_NAMES)
def test_scenario_row_matches_reference(backend, scenario_results, name):
    row = format_row(scenario_results(backend)[name])
    assert row[:-1] == ROWS[name]  # scenario, requests and the 14 model-outcome columns


def test_table_header_and_shape(backend, scenario_results):
    results = [scenario_results(backend)[n] for n in SCENARIO_NAMES]
    lines = format_table(results).splitlines()
    assert lines[0].split("\t") == list(COLUMNS)
    assert lines[0] == ("scenario\trequests\tmakespan_ms\trequest_s\tp95_queue_ms\tp50_ttft_ms\t"
                        "p95_ttft_ms\tp95_latency_ms\tp95_max_itl_ms\tmean_batch\t"
                        "mean_token_occupancy_pct\tprefill_iterations\tdecode_iterations\t"
                        "mixed_iterations\tbench_us_per_run")
    assert len(lines) == 14
    assert all(len(line.split("\t")) == 15 for line in lines)


def test_radix_per_request_timelines(backend, scenario_results):
    def timeline(name):
        return {rid: (m.first_scheduled_us, m.first_token_us, m.completed_us)
                for rid, m in scenario_results(backend)[name].report.requests.items()}

    assert timeline("radix-fcfs") == {
        "a-cold": (0, 8_992, 11_542), "b-cold": (11_542, 20_534, 23_084),
        "c-hot": (23_084, 25_332, 27_882)}
    assert timeline("radix-cache-aware") == {
        "c-hot": (0, 2_248, 4_798), "a-cold": (4_798, 13_790, 16_340),
        "b-cold": (16_340, 25_332, 27_882)}


def test_radix_fixture_probe(scenario_results, backend):
    from skippy_scheduler.cache_policy import CacheAffinity
    from skippy_scheduler.lab.model import LAB_COST
    from skippy_scheduler.lab.scenarios import radix_requests

    aware = {r.id: r for r in radix_requests(LAB_COST, cache_aware=True)}
    assert aware["c-hot"].prefix_tokens == 3_072
    assert aware["c-hot"].cache_affinity.estimated_saved_cost() == 6_144
    assert aware["c-hot"].cache_affinity.stages[0].cache_epoch == 1
    assert aware["a-cold"].prefix_tokens == 0 and aware["b-cold"].prefix_tokens == 0
    fcfs = {r.id: r for r in radix_requests(LAB_COST, cache_aware=False)}
    assert fcfs["c-hot"].prefix_tokens == 3_072
    assert all(r.cache_affinity == CacheAffinity() for r in fcfs.values())


def test_waiting_prefix_service_orders(backend, scenario_results):
    def order(name):
        requests = scenario_results(backend)[name].report.requests
        return sorted(requests, key=lambda rid: requests[rid].first_scheduled_us)

    assert order("waiting-prefix-fcfs") == ["a-unique", "b-shared", "c-shared"]
    assert order("waiting-prefix-dfs") == ["b-shared", "c-shared", "a-unique"]


@pytest.mark.parametrize("name, gap", [("staggered-prefill", 8_842),
                                       ("staggered-prefill-bounded", 1_796),
                                       ("staggered-prefill-mixed", 1_776)])
def test_decoder_max_gap(backend, scenario_results, name, gap):
    decoder = scenario_results(backend)[name].report.requests["decoder"]
    assert decoder.max_inter_token_gap_us == gap
    assert decoder.generated == 64
