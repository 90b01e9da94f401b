"""The cold prefix hold on llama.cpp (docs/behaviour.md §2.3a): a burst of requests sharing a
prefix nobody has computed yet prefills it once, and every request still gets the tokens of its
prompt run alone.

With `cold_prefix_hold_tokens` set, the scheduler admits the first request of a shared-prefix
group and holds its peers; when the leader's prompt is complete the engine has the host keep it
as a resident prefix (`keep_prompt`: a `seq_cp` of the running lane into a holder), and the held
peers are admitted restoring it. The counts come from the scheduler (prefill tokens planned) and
the host (batch entries decoded).
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
HOLDERS = 8
MAX_GEN = 8
KV_BYTES = 10**9
LANE_CELLS = 256


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("model") / "tiny-f32.gguf", seed=11)


@pytest.fixture(scope="module")
def alone(model_path):
    cache: dict[tuple, list[int]] = {}
    with LlamaHost(model_path, n_ctx=2 * 512, n_seq_max=2, n_batch=512, n_threads=1) as plain:
        def run(prompt, max_tokens, sampling=None):
            key = (tuple(prompt), repr(sampling))
            if key not in cache:
                cache[key] = plain.generate_alone(list(prompt), MAX_GEN, sampling)
            return cache[key][:max_tokens]
        yield run


@pytest.fixture(scope="module", params=["streams", "unified"])
def host(model_path, request):
    unified = request.param == "unified"
    capacity = 2048
    n_ctx = (N_SEQ * LANE_CELLS + capacity if unified
             else (N_SEQ + HOLDERS) * LANE_CELLS)
    with LlamaHost(model_path, n_ctx=n_ctx, n_seq_max=N_SEQ, n_batch=512, n_threads=1,
                   prefix_cache_tokens=capacity, prefix_holders=HOLDERS,
                   kv_unified=unified) as h:
        yield h


def _burst(rng: random.Random, groups: int, per_group: int, head_len: int,
           tail_len: int) -> list[list[int]]:
    heads = [[1] + [rng.randrange(3, 384) for _ in range(head_len - 1)] for _ in range(groups)]
    return [head + [rng.randrange(3, 384) for _ in range(tail_len)]
            for head in heads for _ in range(per_group)]


def _empty(store) -> None:
    while store.evict_one() is not None:
        pass
    assert not list(store.resident())


def _run(impl, host, requests, hold: int, **config):
    scheduler = impl(SchedulerConfig(
        max_active_sequences=N_SEQ, max_tokens_per_iteration=512,
        cold_prefix_hold_tokens=hold, **config, **host.sequence_id_settings))
    decoded = host.decoded_tokens
    keeps = host.holders.prompt_keeps
    engine = Engine(scheduler, host, clock=VirtualClock(LAB_COST), max_iterations=5000)
    for req in requests:
        engine.submit(req)
    report = engine.run()
    scheduler.attach_prefix_store(None)  # the store serves the next run's scheduler
    _empty(host.prefix_store)  # every run starts cold
    assert host.active_sequences == [] and host.free_slots == N_SEQ
    return (report, scheduler.metrics(), host.decoded_tokens - decoded,
            host.holders.prompt_keeps - keeps)


@pytest.mark.parametrize("depth", [1, 2])
def test_a_burst_prefills_its_shared_prefix_once(impl, host, alone, depth):
    rng = random.Random(3)
    head, tail = 96, 8
    prompts = _burst(rng, 1, N_SEQ, head, tail)
    requests = [Request(f"r{i}", p, 4) for i, p in enumerate(prompts)]
    _, without, decoded_without, _ = _run(impl, host, requests, 0, prefill_chunk_tokens=256,
                                          max_inflight_plans=depth)
    report, with_hold, decoded_with, keeps = _run(impl, host, requests, 16,
                                                  prefill_chunk_tokens=256,
                                                  max_inflight_plans=depth)
    # Without the hold every request of the burst is admitted at once and prefills all of it.
    assert without.prefill_tokens == N_SEQ * (head + tail)
    # With it the leader prefills its prompt, its prompt is kept while it runs, and its peers
    # restore the shared head: they prefill their own tails only.
    assert keeps == 1
    assert with_hold.prefill_tokens == head + tail + (N_SEQ - 1) * tail
    assert with_hold.restored_tokens == (N_SEQ - 1) * head
    assert decoded_without - decoded_with == (N_SEQ - 1) * head  # the host's own count
    for req, rec in zip(requests, report.records):
        assert rec.tokens == alone(req.prompt_tokens, req.max_tokens), req.id


def test_two_groups_each_prefill_once_and_a_lone_request_is_not_held(impl, host, alone):
    rng = random.Random(4)
    prompts = _burst(rng, 2, 3, 64, 5) + [[1] + [rng.randrange(3, 384) for _ in range(40)]]
    requests = [Request(f"r{i}", p, 3) for i, p in enumerate(prompts)]
    report, m, _, keeps = _run(impl, host, requests, 16, prefill_chunk_tokens=32)
    assert keeps == 2  # one leader per group; the lone request leads nobody
    assert m.prefill_tokens == 2 * (64 + 5) + 4 * 5 + 41
    for req, rec in zip(requests, report.records):
        assert rec.tokens == alone(req.prompt_tokens, req.max_tokens), req.id


@pytest.mark.parametrize("depth", [1, 2])
def test_a_request_arriving_while_the_leader_decodes_restores_its_prompt(impl, host, alone,
                                                                          depth):
    """A late leader (§2.3a): r1 shares r0's 96-token head and arrives once r0 has decoded
    two tokens. r0's prompt is kept from its running lane (`keep_prompt`), and r1 restores the
    head instead of prefilling it; without the hold nothing is resident until r0 finishes."""
    rng = random.Random(5)
    first, second = _burst(rng, 1, 2, 96, 8)
    late = Request("r1", second, 4)

    def run(hold):
        scheduler = impl(SchedulerConfig(
            max_active_sequences=N_SEQ, max_tokens_per_iteration=512, prefill_chunk_tokens=32,
            cold_prefix_hold_tokens=hold, max_inflight_plans=depth,
            **host.sequence_id_settings))
        sent = []

        def arrive(engine):
            if not sent and len(scheduler.sequence("r0").generated_tokens) >= 2:
                engine.submit(late)
                sent.append(True)

        keeps = host.holders.prompt_keeps
        engine = Engine(scheduler, host, clock=VirtualClock(LAB_COST), before_step=arrive,
                        max_iterations=5000)
        engine.submit(Request("r0", first, MAX_GEN))
        report = engine.run()
        scheduler.attach_prefix_store(None)
        _empty(host.prefix_store)
        assert sent and host.active_sequences == [] and host.free_slots == N_SEQ
        for rec, prompt, n in zip(report.records, (first, second), (MAX_GEN, 4)):
            assert rec.tokens == alone(prompt, n), rec.request_id
        return scheduler.metrics(), host.holders.prompt_keeps - keeps

    without, keeps = run(0)
    assert keeps == 0 and without.restored_tokens == 0
    assert without.prefill_tokens == 2 * 104
    with_hold, keeps = run(16)
    assert keeps == 1 and with_hold.restored_tokens == 96
    assert with_hold.prefill_tokens == 104 + 8


def _sampling(rng: random.Random, i: int):
    if i % 3 == 0:
        return SamplingParams(temperature=0.9, seed=rng.randrange(1 << 40), top_k=40,
                              repetition_penalty=1.2, penalty_last_n=64)
    return None


@pytest.mark.parametrize("depth", [1, 2])
def test_random_bursts_with_the_hold_match_alone_runs(impl, host, alone, depth):
    """Bursts of shared-prefix requests under random chunking, mixing, budgets, arrivals,
    preemption and cancellation, with plans in flight or not: the alone tokens every time, and
    the hold did keep prompts."""
    counters = dict(keeps=0, restored=0, completed=0, preempted=0, cancelled=0)
    for seed in range(12):
        rng = random.Random(1000 * depth + seed)
        prompts = _burst(rng, rng.randrange(1, 3), rng.randrange(2, 5), rng.randrange(20, 120),
                         rng.choice([0, 1, 6, 30]))
        rng.shuffle(prompts)
        requests = [Request(f"r{i}", p, rng.randrange(1, MAX_GEN + 1),
                            arrival_us=rng.choice([0.0, 0.0, rng.uniform(0, 20000)]),
                            sampling=_sampling(rng, i))
                    for i, p in enumerate(prompts)]
        scheduler = impl(SchedulerConfig(
            max_active_sequences=rng.randrange(1, N_SEQ + 1),
            max_tokens_per_iteration=rng.choice([16, 64, 512]),
            prefill_chunk_tokens=rng.choice([3, 32, 256]),
            mixed_prefill_decode=rng.random() < 0.5, max_inflight_plans=depth,
            memory_components=[MemoryComponent("kv", KV_BYTES, 0, 1, 0)],
            cold_prefix_hold_tokens=rng.choice([1, 16]),
            cold_prefix_hold_max_steps=rng.choice([3, 64]), **host.sequence_id_settings))
        reserved = {r.id: len(r.prompt_tokens) + r.max_tokens for r in requests}
        pressure = disturbances(rng, scheduler, reserved, KV_BYTES, rng.uniform(0, 0.1),
                                rng.uniform(0, 0.04), counters)
        keeps = host.holders.prompt_keeps
        engine = Engine(scheduler, host, clock=VirtualClock(LAB_COST),
                        before_step=pressure, max_iterations=5000)
        for req in requests:
            engine.submit(req)
        report = engine.run()
        scheduler.attach_prefix_store(None)
        counters["keeps"] += host.holders.prompt_keeps - keeps
        counters["restored"] += scheduler.metrics().restored_tokens
        check_records(requests, report.records, alone, counters, seed)
        store = host.prefix_store
        assert host.active_sequences == [] and host.free_slots == N_SEQ
        assert all(e.pins == 0 for e in store.resident())
        assert store.used_tokens <= store.capacity_tokens
        _empty(store)
    assert counters["completed"] > 30
    assert counters["keeps"] > 5 and counters["restored"] > 0
    assert counters["preempted"] > 0


def test_keep_prompt_refuses_what_the_lane_does_not_hold(host):
    assert host.keep_prompt("nobody", 4) is False


def test_a_keep_the_store_refuses_is_reported_and_not_counted(model_path):
    """`keep_prompt` says whether the prompt is resident afterwards: with the only holder's
    entry pinned (a running restore) the store cannot take another prompt, and the host
    answers False and counts no keep; an unpinned holder is reused, and the keep counts."""
    with LlamaHost(model_path, n_ctx=3 * LANE_CELLS, n_seq_max=2, n_batch=512, n_threads=1,
                   prefix_cache_tokens=LANE_CELLS, prefix_holders=1) as h:
        h.run_rows([("a", [1] + list(range(100, 120)), 0, True),
                    ("b", [1] + list(range(200, 220)), 0, True)])
        keeps = h.holders.prompt_keeps
        assert h.keep_prompt("a", 21)
        assert h.holders.prompt_keeps == keeps + 1
        (entry,) = h.prefix_store.resident()
        h.prefix_store.pin(entry)
        assert not h.keep_prompt("b", 21)
        assert h.holders.prompt_keeps == keeps + 1
        assert [e.length for e in h.prefix_store.resident()] == [21]
        h.prefix_store.unpin(entry)
        assert h.keep_prompt("b", 21)
        assert h.holders.prompt_keeps == keeps + 2
        assert h.keep_prompt("b", 21)  # already resident: still True, counted again
        for k in "ab":
            assert h.release(k)
