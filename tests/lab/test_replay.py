"""Trace replay: the prefix cache serves what is resident, bounded-cache invariants, stale
affinity refreshes, preemption with restores, fairness across tenants, backend parity."""
from __future__ import annotations

import numpy as np
import pytest

from skippy_scheduler.lab.replay import ReplayOptions, jain_index, run_replay
from skippy_scheduler.policies import AdmissionKind
from skippy_scheduler.lab.traces import BLOCK_TOKENS, blocks_for, open_trace
from lab_support import MOONCAKE_CONV, TRACES, conversation_rows, mooncake_file

def check_served_blocks(trace, backend, options, policy="fcfs"):
    """Replay with an unbounded cache and compare every request's restore at admission with a
    count made here from the plans alone: a block is resident once a prefill row has fed
    through its end (the last, partial block once the prompt is fed). A request is admitted in
    the plan after which it first shows in the scheduler's active set (it may get its first
    row later, when the token budget allows)."""
    info = {r.id: (list(r.blocks), r.input_length) for r in trace}
    resident: set = set()
    expected: dict = {}
    first_position: dict = {}
    scheduler = []

    def on_plan(plan, start, duration):
        ids = plan.sequence_ids
        phases = bytes(plan.phases)
        offsets = plan.row_offsets
        positions = plan.positions
        for rid in scheduler[0].snapshot().active_ids:
            if rid not in expected:  # admissions see what was resident before this plan
                blocks, n = info[rid]
                lead = 0
                for b in blocks:
                    if b not in resident:
                        break
                    lead += 1
                expected[rid] = min(BLOCK_TOKENS * lead, n)
        for i, rid in enumerate(ids):
            first_position.setdefault(rid, int(positions[offsets[i]]))
        for i, rid in enumerate(ids):
            if phases[i] != 2:
                blocks, n = info[rid]
                end = int(positions[offsets[i + 1] - 1]) + 1
                full = len(blocks) if end >= n else end // BLOCK_TOKENS
                resident.update(blocks[:full])

    run = run_replay(trace, policy, options=options, backend=backend, progress=False,
                     on_plan=on_plan, host_hook=lambda host: scheduler.append(host.scheduler))
    restored = run.per_request["restored_tokens"]
    ids = list(info)
    assert len(restored) == len(ids) == len(expected)
    for k, rid in enumerate(ids):
        assert restored[k] == expected[rid], rid
        assert first_position[rid] == min(expected[rid], info[rid][1] - 1), rid
    n_in = sum(n for _, n in info.values())
    assert run.figures["hit_rate"] == pytest.approx(restored.sum() / n_in)
    return run


def test_unbounded_cache_serves_exactly_the_resident_blocks(tmp_path, backend):
    trace = open_trace(mooncake_file(tmp_path, conversation_rows()), time_scale=0.3)
    for policy, active in (("fcfs", 2), ("cache-aware-aging", 3), ("fair-share", 4)):
        run = check_served_blocks(trace, backend, ReplayOptions(max_active=active,
                                                                prefix_cache_tokens=None),
                                  policy)
        assert run.figures["hit_rate"] > 0.3 and run.figures["evictions"] == 0
    # Requests waited while others computed their prefix: served only through a refresh.
    assert run.figures["stale_refreshes"] > 0


def test_unbounded_cache_on_the_conversation_trace(backend):
    if not MOONCAKE_CONV.is_file():
        pytest.skip(f"public trace not found in {TRACES} (set SKIPPY_TRACES_DIR)")
    trace = open_trace(str(MOONCAKE_CONV), limit=250 if backend == "native" else 60,
                       time_scale=0.2)
    run = check_served_blocks(trace, backend, ReplayOptions(prefix_cache_tokens=None))
    assert run.figures["completed"] == trace.stats.requests


def test_bounded_cache_stays_within_capacity_and_never_evicts_a_pinned_block(tmp_path,
                                                                              backend):
    trace = open_trace(mooncake_file(tmp_path, conversation_rows(90, seed=5)),
                       time_scale=0.2)
    cap = 6 * BLOCK_TOKENS
    victims = []
    stores = []

    def hook(host):
        stores.append(host.prefix.store)

        def on_evict(entry):
            # Pinned while a request runs: the deepest block it has fed (the host's pin) and
            # the deepest block of its restore (the scheduler's); no victim is either.
            pinned = {id(live.progress) for live in host.live.values()
                      if live.progress is not None}
            victims.append((id(entry) in pinned, entry.children))

        host.prefix.store.backend.on_evict = on_evict

    def on_plan(plan, start, duration):
        assert stores[0].used_tokens <= cap

    run = run_replay(trace, "cache-aware-aging", options=ReplayOptions(
        max_active=4, prefix_cache_tokens=cap), backend=backend, progress=False,
        on_plan=on_plan, host_hook=hook)
    f = run.figures
    assert f["completed"] == f["requests"] == 90
    assert f["evictions"] == len(victims) > 30
    assert all(v == (False, 0) for v in victims)
    assert 0 < f["hit_rate"] < 0.8
    assert stores[0].used_tokens <= cap


def stale_trace(tmp_path):
    # z leaves blocks 1, 2 resident. a starts at 10 ms; b arrives during a's first chunk and
    # waits (one slot) holding a match of blocks 1, 2. a's third and fourth chunks do not fit
    # beside them (capacity: four blocks) and evict block 2, then block 1.
    return mooncake_file(tmp_path, [(0, [1, 2], 1), (10, [5, 6, 7, 8], 3),
                                    (11, [1, 2, 3], 1)])


@pytest.mark.parametrize("policy", ["fcfs", "cache-aware-aging", "fair-share"])
def test_an_evicted_match_is_refreshed_before_admission(tmp_path, backend, policy):
    restores = {}

    def on_plan(plan, start, duration):
        for i, rid in enumerate(plan.sequence_ids):
            restores.setdefault(rid, int(plan.positions[plan.row_offsets[i]]))

    run = run_replay(open_trace(stale_trace(tmp_path)), policy, options=ReplayOptions(
        max_active=1, prefix_cache_tokens=4 * BLOCK_TOKENS), backend=backend, progress=False,
        on_plan=on_plan)
    f = run.figures
    # Two refreshes: after the first eviction b still matches block 1, after the second nothing.
    assert f["stale_refreshes"] == 2
    assert run.per_request["restored_tokens"].tolist() == [0, 0, 0]
    assert restores == {"r0": 0, "r1": 0, "r2": 0}  # b prefills from 0: nothing was left
    assert f["evictions"] == 5 and f["hit_rate"] == 0.0
    # With room for everything the match holds and b restores its two blocks.
    run = run_replay(open_trace(stale_trace(tmp_path)), policy, options=ReplayOptions(
        max_active=1, prefix_cache_tokens=None), backend=backend, progress=False)
    assert run.per_request["restored_tokens"].tolist() == [0, 0, 2 * BLOCK_TOKENS]
    assert run.figures["stale_refreshes"] == 0


def test_a_match_that_grows_while_waiting_is_refreshed(tmp_path, backend):
    path = mooncake_file(tmp_path, [(0, [1, 2, 3], 4), (0, [1, 2, 3, 4], 1),
                                    (0, [1, 2, 3, (9, 100)], 1)])
    run = run_replay(open_trace(path), "fcfs", options=ReplayOptions(
        max_active=1, prefix_cache_tokens=None), backend=backend, progress=False)
    assert run.per_request["restored_tokens"].tolist() == [0, 1536, 1536]
    # The first request's three chunks make a block resident each; both waiters grow thrice.
    assert run.figures["stale_refreshes"] == 6


def test_preempted_requests_keep_their_restore(tmp_path, backend):
    rows = conversation_rows(80, seed=11)
    trace = open_trace(mooncake_file(tmp_path, rows), time_scale=0.05)
    biggest = max(blocks_for(r.input_length) * BLOCK_TOKENS for r in trace)
    run = run_replay(trace, "fcfs", options=ReplayOptions(
        max_active=8, kv_capacity_tokens=biggest + 600, reserve_output_tokens=2,
        prefix_cache_tokens=24 * BLOCK_TOKENS), backend=backend, progress=False)
    f = run.figures
    assert f["completed"] == 80 and f["preemptions"] > 0 and f["recomputed_tokens"] > 0
    assert f["hit_rate"] > 0


def test_a_prompt_larger_than_memory_is_a_clear_error(tmp_path):
    path = mooncake_file(tmp_path, [(0, [1, 2], 1)])
    with pytest.raises(RuntimeError, match="kv-capacity-tokens"):
        run_replay(open_trace(path), "fcfs", options=ReplayOptions(kv_capacity_tokens=600),
                   progress=False)


def test_figures_are_consistent(tmp_path, backend):
    trace = open_trace(mooncake_file(tmp_path, conversation_rows(50, seed=8)), time_scale=0.5)
    run = run_replay(trace, "fcfs", options=ReplayOptions(max_active=4), backend=backend,
                     progress=False)
    f = run.figures
    assert f["requests"] == f["completed"] == 50 and f["tenants"] == 1
    assert f["jain_index"] is None and f["tenant_service_tokens_per_s"] == {}
    assert 0 < f["utilisation"] <= 1
    assert f["p50_ttft_ms"] <= f["p90_ttft_ms"] <= f["p99_ttft_ms"]
    assert f["p50_queue_ms"] <= f["p90_queue_ms"] <= f["p99_queue_ms"]
    outputs = sum(r.output_length for r in trace)
    assert f["output_tokens_per_s"] == pytest.approx(outputs / f["makespan_s"])
    assert f["hit_tokens"] == run.per_request["restored_tokens"].sum()


def test_jain_index():
    assert jain_index([1, 1, 1, 1]) == 1.0
    assert jain_index([1, 0, 0, 0]) == 0.25
    assert jain_index([5]) is None and jain_index([0, 0]) is None


def heavy_and_light(tmp_path):
    """One heavy tenant sending 70 % of the requests and four light ones, faster than the
    server can serve them while they arrive."""
    rng = np.random.default_rng(4)
    rows = []
    for k in range(240):
        tenant = "heavy" if rng.random() < 0.7 else f"light{int(rng.integers(4))}"
        rows.append((k, [10_000 + 4 * k, 10_001 + 4 * k], int(rng.integers(20, 60)), tenant))
    return mooncake_file(tmp_path, rows, "tenants.jsonl")


def test_fair_share_evens_out_service_between_heavy_and_light_tenants(tmp_path, backend):
    trace = open_trace(heavy_and_light(tmp_path), time_scale=0.5)
    options = ReplayOptions(max_active=4, prefix_cache_tokens=0)
    hosts = {}
    runs = {p: run_replay(trace, p, options=options, backend=backend, progress=False,
                          host_hook=lambda host, p=p: hosts.setdefault(p, host))
            for p in ("fcfs", "fair-share")}
    fcfs, fair = runs["fcfs"].figures, runs["fair-share"].figures
    # The scheduler ran fair share natively and charged every tenant itself; the host charged
    # nothing.
    host = hosts["fair-share"]
    assert host.tenants.fair_share.native_kind is AdmissionKind.FAIR_SHARE
    counters = host.scheduler.tenant_counters()
    assert set(counters) == {None, "heavy", "light0", "light1", "light2", "light3"}
    assert all(counters[t] > 0 for t in counters if t is not None)
    assert host.tenants.fair_share.counters.counters == {}
    assert fcfs["tenants"] == fair["tenants"] == 5
    assert fair["utilisation"] > 0.9  # saturated: policies decide who is served
    assert fair["jain_index"] > fcfs["jain_index"] + 0.15
    heavy_share = {name: run.figures["tenant_service_tokens_per_s"]["heavy"]
                   / sum(run.figures["tenant_service_tokens_per_s"].values())
                   for name, run in runs.items()}
    assert heavy_share["fair-share"] < heavy_share["fcfs"]
    # Every light tenant gets more service under fair share than under FCFS.
    for t in ("light0", "light1", "light2", "light3"):
        assert fair["tenant_service_tokens_per_s"][t] > fcfs["tenant_service_tokens_per_s"][t]


def test_the_slo_figures_split_every_request_and_an_slo_told_reaches_the_scheduler(tmp_path,
                                                                                  backend):
    """Every request is within the SLO or missed for one reason; with slo_told each sequence
    carries a first-token deadline ttft_target_ms after its arrival and the inter-token target
    (seen on the scheduler's active set), and an SLO with a zero target is refused."""
    trace = open_trace(mooncake_file(tmp_path, conversation_rows(40, seed=3)), time_scale=0.2)
    seen: dict = {}
    sched: list = []

    def on_plan(plan, start, duration):
        for rid in sched[0].snapshot().active_ids:
            s = sched[0].sequence(rid)
            seen.setdefault(rid, (s.ttft_deadline, s.itl_target))

    for told in (False, True):
        seen.clear()
        sched.clear()
        options = ReplayOptions(max_active=4, ttft_target_ms=40.0, itl_target_ms=2.0,
                                slo_told=told)
        run = run_replay(trace, "fcfs", "slack", options=options, backend=backend,
                         progress=False, on_plan=on_plan,
                         host_hook=lambda host: sched.append(host.scheduler))
        f = run.figures
        missed = f["slo_missed_ttft"] + f["slo_missed_gaps"] + f["slo_missed_both"]
        assert round(f["slo_fraction"] * f["requests"]) + missed == f["requests"] == 40
        assert f["slo_goodput_rps"] == pytest.approx(
            f["slo_fraction"] * f["requests"] / f["makespan_s"])
        arrival = {r.id: r.arrival_us for r in trace}
        if told:
            assert seen and all(d == pytest.approx(arrival[rid] / 1e6 + 0.040) and i == 0.002
                                for rid, (d, i) in seen.items())
        else:
            assert seen and all(v == (None, None) for v in seen.values())
    with pytest.raises(ValueError, match="itl-target-ms > 0"):
        ReplayOptions(ttft_target_ms=40.0, itl_target_ms=0.0, slo_told=True).validate()
