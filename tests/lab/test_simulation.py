"""docs/behaviour.md §6.6: the simulation cases and their figures."""
from __future__ import annotations

import pytest

from skippy_scheduler.cache_policy import CacheAffinity
from skippy_scheduler.lab import (LAB_COST, SimRequest, SimulationError, StepCost,
                                  apply_resident_radix_affinity, burst_requests, simulate,
                                  staggered_prefill_requests)
from skippy_scheduler.lab.scenarios import make_config, radix_fixture, replay_all, replay_profile

COST = LAB_COST


def test_cost_model_examples():
    assert COST.duration_us(256, 0) == 562
    assert COST.duration_us(0, 1) == 170
    assert COST.duration_us(0, 2) == 190
    assert COST.duration_us(0, 4) == 230
    assert COST.duration_us(256, 1) == 682
    assert StepCost(0, 0, 0, 0).duration_us(0, 0) == 1  # at least 1 µs


def test_1_simulation_is_deterministic(backend):
    a = simulate(make_config(), COST, burst_requests(4, 512, 16, 0), backend=backend)
    b = simulate(make_config(), COST, burst_requests(4, 512, 16, 0), backend=backend)
    assert a == b
    assert a.as_dict() == b.as_dict()


def test_2_fixture_replay_switch_counts(backend):
    got = {(r.profile, r.mode): r.switches for r in replay_all(backend=backend)}
    assert got == {("warm-affinity", "fcfs"): 1, ("warm-affinity", "dfs"): 1,
                   ("agentic-eviction-pressure", "fcfs"): 15,
                   ("agentic-eviction-pressure", "dfs"): 7}


def test_2b_dfs_replay_order_and_times(backend):
    result = replay_profile("agentic-eviction-pressure", "dfs", backend=backend)
    assert [f for _, f, _ in result.service_order] == [f for f in range(8) for _ in (0, 1)]
    assert [t for t, _, _ in result.service_order] == [306 * i for i in range(16)]


def test_3_prefix_restore_reduces_modeled_ttft(backend):
    cold = simulate(make_config(), COST, burst_requests(4, 4_096, 16, 0), backend=backend)
    warm = simulate(make_config(), COST, burst_requests(4, 4_096, 16, 4_080), backend=backend)
    assert cold.requests["request-0"].ttft_us == 33_568
    assert warm.requests["request-0"].ttft_us == 178
    assert cold.makespan_us == 37_018 and warm.makespan_us == 3_628


def test_4_staggered_prefill_exposes_head_of_line_blocking(backend):
    report = simulate(make_config(), COST, staggered_prefill_requests(), backend=backend)
    decoder = report.requests["decoder"]
    assert report.mixed_iterations == 0
    assert decoder.max_inter_token_gap_us == 8_842 > 4 * 170
    assert decoder.completed_us is not None


def test_5_bounded_prefill_reduces_head_of_line_blocking(backend):
    report = simulate(make_config(max_consecutive_prefill_iterations=1), COST,
                      staggered_prefill_requests(), backend=backend)
    assert report.mixed_iterations == 0
    assert report.requests["decoder"].max_inter_token_gap_us == 1_796
    assert 4 * 1_796 < 8_842


def test_6_mixed_iterations_fill_prefill_capacity(backend):
    bounded = simulate(make_config(max_consecutive_prefill_iterations=1), COST,
                       staggered_prefill_requests(), backend=backend)
    mixed = simulate(make_config(max_consecutive_prefill_iterations=1, mixed_prefill_decode=True),
                     COST, staggered_prefill_requests(), backend=backend)
    assert mixed.mixed_iterations == 5
    assert round(mixed.mean_token_occupancy, 6) == 0.030631
    assert round(bounded.mean_token_occupancy, 6) == 0.028503
    assert mixed.requests["decoder"].max_inter_token_gap_us == 1_776
    assert mixed.makespan_us == 19_406 and bounded.makespan_us == 19_656


def test_7_concurrent_burst_batches_and_completes(backend):
    report = simulate(make_config(), COST, burst_requests(4, 128, 32), backend=backend)
    assert report.mean_batch_size == 4.0
    assert round(report.mean_token_occupancy, 7) == 0.0097046
    assert round(report.throughput_rps, 3) == 487.567
    for m in report.requests.values():
        assert m.queue_wait_us is not None and m.latency_us is not None
        assert m.generated == 32


def _radix_768(cache_aware: bool):
    requests = [SimRequest("a-cold", 0, 1_024, 1, token_offset=10_000),
                SimRequest("b-hot", 0, 1_024, 1)]
    requests = apply_resident_radix_affinity(radix_fixture(768), "stage-0", 0, 2, requests)
    if not cache_aware:
        for r in requests:
            r.cache_affinity = CacheAffinity()
    return requests


def test_8_real_radix_affinity_prioritizes_the_high_value_prefix(backend):
    config = make_config(max_active_sequences=1)
    aware = simulate(config, COST, _radix_768(True), backend=backend)
    fcfs = simulate(config, COST, _radix_768(False), backend=backend)
    assert aware.requests["b-hot"].ttft_us == 562
    assert fcfs.requests["b-hot"].ttft_us == 2_810
    assert aware.requests["b-hot"].queue_wait_us == 0


@pytest.mark.parametrize("requests, message", [
    ([], "at least one request"),
    ([SimRequest("x", 0, 4, 1), SimRequest("x", 5, 4, 1)], "duplicate"),
    ([SimRequest("x", 0, 0, 1)], "no prompt tokens"),
    ([SimRequest("x", 0, 4, 0)], "no output tokens"),
    ([SimRequest("x", 0, 4, 1, prefix_tokens=5)], "more prefix tokens"),
])
def test_simulate_validation_errors(backend, requests, message):
    with pytest.raises(ValueError, match=message):
        simulate(make_config(), COST, requests, backend=backend)


def test_simulate_rejects_non_requests(backend):
    with pytest.raises(TypeError):
        simulate(make_config(), COST, [("x", 0, 4, 1)], backend=backend)


def test_submit_error_aborts_the_simulation(backend):
    requests = [SimRequest(f"r{i}", 0, 4, 1) for i in range(3)]
    with pytest.raises(SimulationError, match="submit of r1"):
        simulate(make_config(max_waiting_sequences=1), COST, requests, backend=backend)


def test_idle_gap_jumps_to_the_next_arrival(backend):
    report = simulate(make_config(), COST, [SimRequest("a", 0, 4, 1), SimRequest("b", 10_000, 4, 1)],
                      backend=backend)
    assert report.requests["b"].first_scheduled_us == 10_000
    assert report.requests["b"].queue_wait_us == 0
    assert report.makespan_us == 10_000 + 58


def test_sim_request_builders():
    r = SimRequest("x", 0, 10, 2).with_prefix_tokens(50)
    assert r.prefix_tokens == 10
    assert SimRequest("y", 0, 3, 1).with_token_offset(7).prompt_ids() == [7, 8, 9]
    assert SimRequest("z", 0, 3, 1, token_offset=2**31 - 2).prompt_ids() == [2**31 - 2, 2**31 - 1,
                                                                             2**31 - 1]
    with pytest.raises(TypeError):
        SimRequest("x", 0, True, 1)
    with pytest.raises(ValueError):
        SimRequest("x", -1, 1, 1)
