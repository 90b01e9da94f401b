"""Preemption for priority on llama.cpp (docs/behaviour.md §2.8a, §2.12): low-priority streams
fill every lane, high-priority requests arrive and take lanes from them, and every sequence
still gets exactly the tokens it gets alone, greedy and seeded.

With a prefix store, a victim's release keeps its lane's KV (prompt and generated tokens) under
a holder, and its resume restores all of it: the resume's new row starts at the victim's
replay length, the scheduler counts those tokens in `restored_tokens`, and nothing is
recomputed. Under a store too small to keep them, victims' entries are evicted and the resumes
fall back to recomputing, with the same tokens.
"""
from __future__ import annotations

import random
from dataclasses import replace

import pytest

pytest.importorskip("llama_cpp")

from skippy_scheduler import ReleaseReason, SchedulerConfig  # noqa: E402
from skippy_scheduler.cost_model import LAB_COST  # noqa: E402
from skippy_scheduler.engine import Engine, Request, VirtualClock  # noqa: E402
from skippy_scheduler.hosts.llama import LlamaHost  # noqa: E402
from skippy_scheduler.hosts.tiny_model import write_tiny_llama  # noqa: E402
from skippy_scheduler.sampling import SamplingParams  # noqa: E402

LANES = 3
MAX_GEN = 24


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("model") / "tiny-f32.gguf", seed=7)


@pytest.fixture(scope="module")
def alone(model_path):
    with LlamaHost(model_path, n_ctx=512, n_seq_max=1, n_batch=512, n_threads=1) as plain:
        cache: dict[tuple, list[int]] = {}

        def run(prompt, max_tokens, sampling=None):
            key = (tuple(prompt), repr(sampling))
            if key not in cache:
                cache[key] = plain.generate_alone(list(prompt), MAX_GEN, sampling)
            return cache[key][:max_tokens]
        yield run


class Watched(LlamaHost):
    """A LlamaHost that notes, per sequence, the positions its lane held when it was let go for
    a preemption and what each of its new rows restored (the plan's own figures)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.released_at: dict[str, list[int]] = {}
        self.new_rows: dict[str, list[int]] = {}

    def execute(self, plan):  # type: ignore[no-untyped-def]
        ids = plan.sequence_ids
        for r in range(len(plan)):
            if plan.new_rows[r]:
                self.new_rows.setdefault(ids[r], []).append(int(plan.restored_tokens[r]))
        return super().execute(plan)

    def release(self, sequence_id, reason=ReleaseReason.FINISHED):  # type: ignore[no-untyped-def]
        if reason is ReleaseReason.PREEMPTED:
            self.released_at.setdefault(sequence_id, []).append(self.kv_tokens(sequence_id))
        return super().release(sequence_id, reason)


def _host(model_path, capacity: int, holders: int, unified: bool = False) -> Watched:
    """A KV stream per lane and per holder (the default layout), 256 cells each; or one unified
    cache of the lanes' cells plus the capacity, shared by lanes and holders."""
    n_ctx = LANES * 256 + capacity if unified else (LANES + holders) * 256
    return Watched(model_path, n_ctx=n_ctx, n_seq_max=LANES, n_batch=256, n_threads=1,
                   prefix_cache_tokens=capacity, prefix_holders=holders, kv_unified=unified)


def _sampling(rng: random.Random, i: int):
    if i % 3 == 0:
        return None
    if i % 3 == 1:
        return SamplingParams(temperature=0.9, seed=rng.randrange(1 << 40), top_k=40)
    return SamplingParams(temperature=0.7, seed=rng.randrange(1 << 40), repetition_penalty=1.2,
                          penalty_last_n=16)


def _workload(seed: int) -> list[Request]:
    """LANES long low-priority streams at t = 0, then high-priority requests arriving while
    they decode (some at priority 2, above the priority-1 ones)."""
    rng = random.Random(seed)
    out = []
    for i in range(LANES + 1):
        prompt = [1] + [rng.randrange(3, 384) for _ in range(rng.randrange(6, 40))]
        out.append(Request(f"low{i}", prompt, MAX_GEN, arrival_us=0.0, priority=0,
                           sampling=_sampling(rng, i)))
    for j in range(4):
        prompt = [1] + [rng.randrange(3, 384) for _ in range(rng.randrange(3, 20))]
        out.append(Request(f"high{j}", prompt, rng.randrange(2, 8),
                           arrival_us=4000.0 + 6000.0 * j, priority=1 + j % 2,
                           sampling=_sampling(rng, j + 1)))
    return out


def _run(impl, host: Watched, requests: list[Request], depth: int, mixed: bool = False):
    config = SchedulerConfig(max_active_sequences=LANES, max_tokens_per_iteration=host.n_batch,
                             prefill_chunk_tokens=32, max_inflight_plans=depth,
                             priority_preemption=True, priority_preemption_guard_steps=4,
                             mixed_prefill_decode=mixed, **host.sequence_id_settings)
    scheduler = impl(config)
    # Mixed: prompt tokens so dear that the first mixed plan switches §2.6's gate off; from
    # then on only the preempting plans mix (§2.8a point 6).
    cost = replace(LAB_COST, per_prefill_token_us=5000) if mixed else LAB_COST
    engine = Engine(scheduler, host, clock=VirtualClock(cost), max_iterations=4000)
    report = engine.run(requests)
    scheduler.attach_prefix_store(None)  # the host's store serves the next run's scheduler
    return scheduler.metrics(), {r.id: r for r in report.records}


def _check_tokens(requests, records, alone):
    for req in requests:
        rec = records[req.id]
        expected = alone(req.prompt_tokens, req.max_tokens, req.sampling)
        if rec.finish_reason == "stop":
            assert rec.tokens + expected[len(rec.tokens):][:1] == expected, req.id
        else:
            assert rec.finish_reason == "length", (req.id, rec.finish_reason)
            assert rec.tokens == expected, req.id


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("layout", ["streams", "unified"])
def test_priority_victims_resume_from_their_kept_kv_with_their_alone_tokens(impl, model_path,
                                                                          alone, depth, layout):
    capacity = 4096 if layout == "streams" else 1024
    with _host(model_path, capacity, holders=8, unified=layout == "unified") as host:
        victims = resumed = 0
        for seed in range(3):
            host.released_at.clear()
            host.new_rows.clear()
            requests = _workload(seed)
            m, records = _run(impl, host, requests, depth)
            _check_tokens(requests, records, alone)
            assert m.preempted_priority == m.preempted > 0
            assert m.recompute_tokens == 0  # every resume restored everything it had computed
            prompts = {r.id: len(r.prompt_tokens) for r in requests}
            for sid, released in host.released_at.items():
                starts = host.new_rows[sid][1:]  # the first new row is the first admission
                assert len(starts) == len(released) == records[sid].preemptions
                prompt = prompts[sid]
                for held, start in zip(released, starts):
                    # The lane held the replay (plus, at depth 2, the pending token that an
                    # in-flight row had fed); the resume restores the whole replay.
                    assert held - (depth - 1) <= start <= held and start > prompt
                victims += len(released)
                resumed += sum(starts)
            # Resumes are restores: restored_tokens holds each resume's replay.
            assert m.restored_tokens >= sum(sum(host.new_rows[s][1:]) for s in host.released_at)
        assert victims >= 3 and resumed > 0
        assert all(e.pins == 0 for e in host.prefix_store.resident())
        assert host.active_sequences == [] and host.free_slots == LANES


def test_without_room_for_the_victims_kv_resumes_recompute_with_the_same_tokens(impl,
                                                                              model_path,
                                                                              alone):
    # One holder and 64 tokens of capacity: a victim's replay rarely fits, and when one does the
    # next victim's evicts it.
    with _host(model_path, capacity=64, holders=1) as host:
        recomputed = preempted = 0
        for seed in range(3):
            requests = _workload(seed)
            m, records = _run(impl, host, requests, depth=1)
            _check_tokens(requests, records, alone)
            recomputed += m.recompute_tokens
            preempted += m.preempted_priority
        assert preempted >= 3 and recomputed > 0


def test_without_preemption_high_priority_waits_for_a_lane(impl, model_path, alone):
    with _host(model_path, capacity=4096, holders=8) as host:
        requests = _workload(0)
        config = SchedulerConfig(max_active_sequences=LANES, max_tokens_per_iteration=host.n_batch,
                                 prefill_chunk_tokens=32, **host.sequence_id_settings)
        scheduler = impl(config)
        report = Engine(scheduler, host, clock=VirtualClock(LAB_COST)).run(requests)
        scheduler.attach_prefix_store(None)
        records = {r.id: r for r in report.records}
        _check_tokens(requests, records, alone)
        assert scheduler.metrics().preempted == 0
        # The first high-priority request started only when a low stream ended.
        first_end = min(records[f"low{i}"].finished_us for i in range(LANES))
        assert records["high0"].first_scheduled_us >= first_end


def test_preempting_plans_that_mix_keep_every_sequence_s_alone_tokens(impl, model_path, alone):
    with _host(model_path, 4096, holders=8) as host:
        for seed in range(3):
            requests = _workload(seed)
            m, records = _run(impl, host, requests, depth=1, mixed=True)
            _check_tokens(requests, records, alone)
            assert m.preempted_priority > 0 and m.recompute_tokens == 0
        assert host.active_sequences == [] and host.free_slots == LANES
