"""Prefix KV reuse on llama.cpp: restored sequences get exactly the tokens they get alone.

The host keeps each released sequence's KV cells as a resident prefix under a holder sequence id
(a unified KV cache shares the cells), and a sequence admitted with a restore copies them into
its lane, so only the suffix is prefilled. Random schedules over shared-prefix prompt sets
(arrivals over time, chunked prefill, mixed rows, preemption, cancellation, duplicates that hit
the whole prompt, and a capacity tight enough to evict) must give every sequence the greedy
tokens of its prompt run alone, and the tests check that restores and evictions happened.
"""
from __future__ import annotations

import random

import pytest

pytest.importorskip("llama_cpp")

from alone_checks import check_records, disturbances  # noqa: E402  (tests/support)
from skippy_scheduler import MemoryComponent, SchedulerConfig  # noqa: E402
from skippy_scheduler.cost_model import LAB_COST  # noqa: E402
from skippy_scheduler.engine import Engine, Request, VirtualClock  # noqa: E402
from skippy_scheduler.hosts.llama import LlamaHost  # noqa: E402
from skippy_scheduler.hosts.tiny_model import write_tiny_llama  # noqa: E402
from skippy_scheduler.sampling import SamplingParams  # noqa: E402

N_SEQ = 6
MAX_GEN = 10
KV_BYTES = 10**9


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("model") / "tiny-f32.gguf", seed=7)


@pytest.fixture(scope="module")
def plain(model_path):
    with LlamaHost(model_path, n_ctx=N_SEQ * 512, n_seq_max=N_SEQ, n_batch=512,
                   n_threads=1) as h:
        yield h


@pytest.fixture(scope="module")
def alone(plain):
    cache: dict[tuple, list[int]] = {}

    def run(prompt, max_tokens, sampling=None):
        # Seeded draws depend on the position only, so a shorter run is a prefix of this one.
        key = (tuple(prompt), repr(sampling))
        if key not in cache:
            cache[key] = plain.generate_alone(list(prompt), MAX_GEN, sampling)
        return cache[key][:max_tokens]
    return run


def _sampling(rng: random.Random, i: int):
    """Greedy, seeded sampling, penalties (whose window must see the restored prefix too), and
    end-of-generation suppressed (a sampler chain without a token window)."""
    kind = i % 5
    if kind in (0, 1):
        return None
    if kind == 2:
        return SamplingParams(temperature=rng.uniform(0.5, 1.5), seed=rng.randrange(1 << 40),
                              top_k=rng.choice([0, 40]))
    if kind == 3:
        return SamplingParams(temperature=0.8, seed=rng.randrange(1 << 40),
                              repetition_penalty=1.3, presence_penalty=0.4,
                              penalty_last_n=rng.choice([4, 64]))
    return SamplingParams(temperature=0.0, ignore_eos=True)


def _reuse_host(model_path, capacity: int, holders: int, lane_cells: int = 512,
                unified: bool = True, stage_ahead: bool = False) -> LlamaHost:
    """Unified: the lanes' cells plus the capacity, shared; else one stream per lane and per
    holder (lane_cells each)."""
    n_ctx = N_SEQ * lane_cells + capacity if unified else (N_SEQ + holders) * lane_cells
    return LlamaHost(model_path, n_ctx=n_ctx, n_seq_max=N_SEQ, n_batch=512, n_threads=1,
                     prefix_cache_tokens=capacity, prefix_holders=holders, kv_unified=unified,
                     stage_ahead=stage_ahead)


# Both KV layouts: holders sharing cells of one unified cache, and a stream per lane and holder
# with whole-stream copies (the default).
LAYOUTS = pytest.fixture(scope="module", params=["unified", "streams"])


@LAYOUTS
def roomy(model_path, request):
    with _reuse_host(model_path, 4096, 12, unified=request.param == "unified") as h:
        yield h


@LAYOUTS
def roomy_ahead(model_path, request):
    with _reuse_host(model_path, 4096, 12, unified=request.param == "unified",
                     stage_ahead=True) as h:
        yield h


@LAYOUTS
def tight(model_path, request):
    # The KV cache itself is tight too: room for the lanes' longest sequences (at most 101
    # positions each) plus the store's capacity (unified), or one stream per lane and holder
    # (256 cells, llama.cpp's smallest), so KV held beyond what the layout provides makes a
    # decode fail for want of a cell.
    unified = request.param == "unified"
    lane_cells = 128 if unified else 256
    with _reuse_host(model_path, 256, 3, lane_cells=lane_cells, unified=unified) as h:
        assert h.n_ctx == (N_SEQ * 128 + 256 if unified else (N_SEQ + 3) * 256)
        yield h


def _prompts(rng: random.Random, n: int) -> list[list[int]]:
    heads = [[1] + [rng.randrange(3, 384) for _ in range(rng.randrange(8, 70))]
             for _ in range(rng.randrange(1, 4))]
    out: list[list[int]] = []
    for _ in range(n):
        if out and rng.random() < 0.2:
            out.append(list(rng.choice(out)))  # the same prompt again: a full-prompt hit
            continue
        head = rng.choice(heads)
        cut = rng.randrange(1, len(head) + 1) if rng.random() < 0.3 else len(head)
        out.append(head[:cut] + [rng.randrange(3, 384) for _ in range(rng.choice([0, 1, 4, 20]))])
    return out


def _trial(impl, host, alone, seed: int, counters: dict, depth: int = 1) -> None:
    rng = random.Random(seed)
    prompts = _prompts(rng, rng.randrange(4, 12))
    requests = [Request(f"r{i}", p, rng.randrange(1, MAX_GEN + 1),
                        arrival_us=rng.choice([0.0, rng.uniform(0, 30000)]),
                        priority=rng.randrange(2), sampling=_sampling(rng, i))
                for i, p in enumerate(prompts)]
    budget = rng.choice([8, 16, 64, 512])
    config = SchedulerConfig(
        max_active_sequences=rng.randrange(1, N_SEQ + 1), max_tokens_per_iteration=budget,
        prefill_chunk_tokens=rng.choice([1, 3, 8, 32, 256]),
        mixed_prefill_decode=rng.random() < 0.5,
        memory_components=[MemoryComponent("kv", KV_BYTES, 0, 1, 0)],
        max_inflight_plans=depth, **host.sequence_id_settings)
    scheduler = impl(config)
    reserved = {r.id: len(r.prompt_tokens) + r.max_tokens for r in requests}
    p_preempt, p_cancel = rng.uniform(0, 0.15), rng.uniform(0, 0.05)

    pressure = disturbances(rng, scheduler, reserved, KV_BYTES, p_preempt, p_cancel, counters)
    store = host.prefix_store
    evictions_before = store.evictions
    replaced_before = host.holders.replaced
    engine = Engine(scheduler, host, clock=VirtualClock(LAB_COST), before_step=pressure,
                    max_iterations=5000)
    for req in requests:
        engine.submit(req)
    report = engine.run()
    scheduler.attach_prefix_store(None)  # the host's store serves the next trial's scheduler
    check_records(requests, report.records, alone, counters, seed)
    m = scheduler.metrics()
    counters["restored"] += m.restored_tokens
    counters["prefilled"] += m.prefill_tokens
    counters["stale"] += m.stale_refreshes
    counters["evictions"] += store.evictions - evictions_before
    counters["replaced"] += host.holders.replaced - replaced_before
    # Nothing left behind: every lane is free and no entry is still pinned.
    assert host.active_sequences == [] and host.free_slots == N_SEQ
    assert all(e.pins == 0 for e in store.resident())
    assert store.used_tokens <= store.capacity_tokens
    assert all(N_SEQ <= e.holder < N_SEQ + host.prefix_holders for e in store.resident())


def _counters():
    return dict(completed=0, preempted=0, cancelled=0, restored=0, prefilled=0, stale=0,
                evictions=0, replaced=0)


def test_random_schedules_with_prefix_reuse_match_alone_runs(impl, roomy, alone):
    counters = _counters()
    for seed in range(24):
        _trial(impl, roomy, alone, seed, counters)
    assert counters["completed"] > 80
    assert counters["restored"] > counters["prefilled"] // 4 > 0
    assert counters["preempted"] > 3 and counters["cancelled"] > 0
    # With a stream per holder, finished keys replaced holders they shared most of (and the
    # outputs above still equal the alone runs); a unified cache never replaces.
    assert (counters["replaced"] > 0) == (not roomy.settings["kv_unified"])


def test_prefix_reuse_with_plans_staged_ahead_at_depth_two_matches_alone_runs(impl, roomy_ahead,
                                                                             alone):
    # Two plans in flight, each staged while the one before decodes: the releases that keep
    # finished sequences' prefixes run between the two, after the staging.
    before = (roomy_ahead.staged_ahead, roomy_ahead.staged_ahead_past_calls)
    counters = _counters()
    for seed in range(12):
        _trial(impl, roomy_ahead, alone, seed, counters, depth=2)
    assert counters["completed"] > 40 and counters["restored"] > 0
    ran, past_calls = (a - b for a, b in zip(
        (roomy_ahead.staged_ahead, roomy_ahead.staged_ahead_past_calls), before))
    assert ran > 20 and past_calls > 0


def test_random_schedules_under_a_tight_prefix_capacity_evict_and_still_match(impl, tight,
                                                                              alone):
    counters = _counters()
    for seed in range(100, 124):
        _trial(impl, tight, alone, seed, counters)
    assert counters["completed"] > 80
    assert counters["restored"] > 0 and counters["evictions"] > 0
    assert (counters["replaced"] > 0) == (not tight.settings["kv_unified"])


def test_reuse_settings_are_checked(model_path):
    with pytest.raises(ValueError, match="prefix_holders"):
        LlamaHost(model_path, n_ctx=1024, n_seq_max=250, prefix_cache_tokens=256,
                  prefix_holders=16)
    with pytest.raises(ValueError, match="prefix_cache_tokens"):
        LlamaHost(model_path, n_ctx=1024, n_seq_max=2, prefix_cache_tokens=-1)


def test_engine_refuses_a_scheduler_whose_reserved_ids_are_not_the_holders(impl, roomy):
    scheduler = impl(SchedulerConfig(max_active_sequences=2))  # reserves [240, 256)
    with pytest.raises(ValueError, match="sequence_id_settings"):
        Engine(scheduler, roomy)


def test_resident_prefixes_hold_no_more_cells_than_the_store_counts(impl, model_path, alone):
    """Six cold requests of one group compute six copies of its prefix; what the store keeps of
    them must share the parent's cells, or the uncounted copies crowd out the next wave: six
    different long prompts that fill every lane of a KV cache sized lanes + store capacity."""
    rng = random.Random(5)
    head = [1] + [rng.randrange(3, 384) for _ in range(59)]
    first = [head + [rng.randrange(3, 384) for _ in range(4)] for _ in range(N_SEQ)]
    second = [[1] + [rng.randrange(3, 384) for _ in range(120)] for _ in range(N_SEQ)]
    with _reuse_host(model_path, 256, 8, lane_cells=128, unified=True) as host:
        scheduler = impl(SchedulerConfig(max_active_sequences=N_SEQ, max_tokens_per_iteration=512,
                                         prefill_chunk_tokens=512, **host.sequence_id_settings))
        seen = {"children": 0}

        def watch(plan, start_us, duration_us):
            children = sum(e.parent is not None for e in host.prefix_store.resident())
            seen["children"] = max(seen["children"], children)

        engine = Engine(scheduler, host, clock=VirtualClock(LAB_COST), max_iterations=2000,
                        on_plan=watch)
        requests = [Request(f"a{i}", p, 4) for i, p in enumerate(first)]
        requests += [Request(f"b{i}", p, 4, arrival_us=1e9) for i, p in enumerate(second)]
        for req in requests:
            engine.submit(req)
        report = engine.run()
        for req, rec in zip(requests, report.records):
            expected = alone(req.prompt_tokens, req.max_tokens)
            assert rec.tokens == expected[:len(rec.tokens)], req.id
        assert seen["children"] >= 3  # the group's keys were kept under one shared parent
        scheduler.attach_prefix_store(None)
