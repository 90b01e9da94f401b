"""Pipelined plans on stage workers: with P stages the engine keeps P plans in flight on
disjoint groups of sequences (`disjoint_inflight_plans`, `StageHost(pipeline_depth=P)`), plan k
in stage 0 while plan k-1 is in stage 1. The random schedules again at P = 2 and 3: every
request's greedy tokens equal the unsplit model's prompt run alone; a stage error undoes every
plan in flight and serving goes on; a killed stage ends every request and leaves nothing held."""
from __future__ import annotations

import pytest

pytest.importorskip("llama_cpp")
pytest.importorskip("zmq")

from skippy_scheduler import MemoryComponent, SchedulerConfig, Scheduler, TwinScheduler  # noqa: E402
from skippy_scheduler.cost_model import LAB_COST  # noqa: E402
from skippy_scheduler.engine import Engine, Request, VirtualClock  # noqa: E402
from skippy_scheduler.hosts.stages.host import StageFailure  # noqa: E402
from skippy_scheduler.hosts.stages.local import LocalStages  # noqa: E402

from stages_common import MAX_GEN, N_SEQ, lane_outside_the_stages, random_trial  # noqa: E402


@pytest.fixture(scope="module", params=[2, 3], ids=["P2", "P3"])
def piped(request, splits, model4):
    with LocalStages(splits[request.param], source_model=model4) as local:
        with local.host(n_ctx=N_SEQ * 512, n_seq_max=N_SEQ, n_batch=512, n_threads=1,
                        pipeline_depth=request.param) as host:
            yield host


def _pipelined(host) -> dict:
    return dict(max_inflight_plans=len(host.stages), disjoint_inflight_plans=True)


@pytest.mark.parametrize("impl", [Scheduler, TwinScheduler], ids=["native", "twin"])
def test_pipelined_random_schedules_match_the_unsplit_model_alone(impl, piped, alone):
    counters = dict(completed=0, preempted=0, cancelled=0, mixed=0, recompute=0)
    for seed in range(100, 110):
        random_trial(impl, piped, alone, seed, counters, **_pipelined(piped))
    assert counters["completed"] > 30
    assert counters["preempted"] > 1 and counters["recompute"] > 0
    assert counters["cancelled"] >= 1
    assert piped.most_in_flight == len(piped.stages)  # the stages had a plan each at once


def _requests(n: int, max_tokens: int = MAX_GEN) -> list[Request]:
    return [Request(f"q{i}", [1] + list(range(20 + i, 34 + 2 * i)), max_tokens)
            for i in range(n)]


def test_a_stage_error_undoes_every_plan_in_flight_and_serving_goes_on(piped, alone):
    """A plan refused by stage 0 while the other plans are in the chain: the error is raised,
    the engine aborts that plan and the later ones, every stage is put back where the failed
    plan found it (the driver's count of each lane's positions is what the stages hold), and
    the requests then finish with their alone tokens."""
    host = piped
    p = len(host.stages)
    scheduler = Scheduler(SchedulerConfig(max_active_sequences=N_SEQ, max_tokens_per_iteration=64,
                                          **_pipelined(host)))
    engine = Engine(scheduler, host, clock=VirtualClock(LAB_COST), max_iterations=2000)
    requests = _requests(6)
    for r in requests:
        engine.submit(r)
    for _ in range(8):  # prefill, then the decode groups take turns
        engine.step()
    assert host.most_in_flight >= 2
    late = Request("late", [1, 7, 8, 9], 3)
    engine.submit(late)
    with lane_outside_the_stages(host):  # the late request's lane is outside every stage's
        with pytest.raises(StageFailure, match=r"stage 0 failed.*outside \[0, 8\)"):
            for _ in range(4 * p):
                engine.step()
    state = host.host_state(detail=True)  # every stage agrees with the driver
    lanes = host._lanes
    held = [lanes.lane_of(i) for i in host.active_sequences]
    want = {lane: lanes.end(lane) - 1 for lane in held if lanes.end(lane)}
    assert dict(state.lane_positions) == want
    for _ in range(2000):
        if not engine.step() and not engine.outstanding:
            break
    by_id = {r.id: r for r in engine.report().records}
    for req in requests + [late]:
        assert by_id[req.id].finish_reason == "length"
        assert by_id[req.id].tokens == alone(req.prompt_tokens, req.max_tokens), req.id
    host.sync()
    assert host.held() == [{}] * p


def test_killing_a_stage_with_plans_in_flight_ends_every_request(splits, model4, alone):
    with LocalStages(splits[3], source_model=model4) as local:
        with local.host(n_ctx=N_SEQ * 512, n_seq_max=N_SEQ, n_batch=512, n_threads=1,
                        pipeline_depth=3) as host:
            scheduler = TwinScheduler(SchedulerConfig(
                max_active_sequences=6, max_tokens_per_iteration=64, prefill_chunk_tokens=8,
                mixed_prefill_decode=True, **_pipelined(host),
                memory_components=[MemoryComponent("kv", 10**9, 0, 1, 0)]))
            requests = [Request(r.id, r.prompt_tokens, 2 if i == 0 else MAX_GEN,
                                arrival_us=i * 300.0) for i, r in enumerate(_requests(8))]

            def kill(engine):
                if engine.iterations == 14:
                    local.kill(1)

            engine = Engine(scheduler, host, clock=VirtualClock(LAB_COST), before_step=kill,
                            max_iterations=2000)
            engine.add_requests(requests)
            report = engine.run()
            reasons = [r.finish_reason for r in report.records]
            assert set(reasons) <= {"length", "failed"} and "failed" in reasons, reasons
            for req, rec in zip(requests, report.records):
                if rec.finish_reason == "length":
                    assert rec.tokens == alone(req.prompt_tokens, req.max_tokens)
            assert "stage 1 was killed by signal 9 (SIGKILL)" in (host.broken or "")
            assert host.most_in_flight >= 2
            snap = scheduler.snapshot()
            assert not snap.active_ids and not snap.waiting_ids
            assert host.active_sequences == []
            host.sync()
            assert host.held() == [{}, {}]  # stages 0 and 2 hold nothing for ended requests


def test_pipelined_prefix_reuse_gives_the_unsplit_tokens(splits, model4, alone):
    with LocalStages(splits[2], source_model=model4) as local:
        with local.host(n_ctx=(N_SEQ + 6) * 512, n_seq_max=N_SEQ, n_batch=512, n_threads=1,
                        prefix_cache_tokens=300, prefix_holders=6, pipeline_depth=2) as host:
            counters = dict(completed=0, preempted=0, cancelled=0, mixed=0, recompute=0)
            for seed in range(400, 406):
                random_trial(Scheduler, host, alone, seed, counters, **_pipelined(host))
            assert counters["completed"] > 15 and counters["restored"] > 20
            assert host.most_in_flight == 2
            kept = host.held(holders=True)
            assert kept == [kept[0]] * 2  # both stages hold the same prefixes


@pytest.mark.parametrize("impl", [Scheduler, TwinScheduler], ids=["native", "twin"])
def test_sampled_sequences_on_pipelined_stages_equal_their_alone_runs(impl, piped, unsplit):
    """Seeded sampling on the last stage (temperature, top-k/p, penalties, ignore_eos), with
    preemption and recompute and P plans in flight: every request's tokens are the unsplit
    model's alone run with the same sampling."""
    import random

    from skippy_scheduler.sampling import SamplingParams

    rng = random.Random(7)
    preempted = 0
    for trial in range(3):
        requests = []
        for i in range(6):
            prompt = [1] + [rng.randrange(3, 384) for _ in range(rng.randrange(2, 40))]
            params = rng.choice([
                SamplingParams(temperature=rng.uniform(0.6, 1.3), seed=rng.randrange(1 << 32)),
                SamplingParams(temperature=0.8, top_k=12, top_p=0.9, seed=rng.randrange(100),
                               presence_penalty=0.4, repetition_penalty=1.1),
                SamplingParams(temperature=0.0, ignore_eos=True),
                None])
            requests.append(Request(f"t{trial}-{i}", prompt, rng.randrange(2, MAX_GEN + 1),
                                    sampling=params, arrival_us=i * 400.0))
        scheduler = impl(SchedulerConfig(max_active_sequences=4, max_tokens_per_iteration=32,
                                         prefill_chunk_tokens=8, mixed_prefill_decode=True,
                                         memory_components=[MemoryComponent("kv", 10**9, 0, 1,
                                                                            0)],
                                         **_pipelined(piped)))

        def pressure(engine):
            nonlocal preempted
            if rng.random() < 0.1:
                preempted += len(engine.preempt([10**9 + 1]))
                engine.preempt([0])

        engine = Engine(scheduler, piped, clock=VirtualClock(LAB_COST), before_step=pressure,
                        max_iterations=3000)
        engine.add_requests(requests)
        report = engine.run()
        for req, rec in zip(requests, report.records):
            want = unsplit.generate_alone(list(req.prompt_tokens), req.max_tokens, req.sampling)
            if rec.finish_reason == "stop":
                assert unsplit.is_eog(want[-1]), (req.id, want)
                want = want[:-1]
            else:
                assert rec.finish_reason == "length", (req.id, rec.finish_reason)
            assert rec.tokens == want, (req.id, req.sampling)
        assert piped.host_state(detail=True).samplers == 0  # every chain went with its request
    assert preempted > 0


def test_kv_memory_per_stage_bounds_admission(splits, model4, alone):
    """Each stage's KV cache is a memory component (its cells x the bytes a position takes in
    its layers): with 512 cells per stage and requests reserving 180 positions, at most two run
    at once, pipelined, and every request gets its alone tokens."""
    with LocalStages(splits[3], source_model=model4) as local:
        with local.host(n_ctx=512, n_seq_max=N_SEQ, n_batch=512, n_threads=1,
                        pipeline_depth=3) as host:
            components = host.memory_components
            assert [c.name for c in components] == ["kv-stage-0", "kv-stage-1", "kv-stage-2"]
            layers = [s.layer_end - s.layer_start for s in host.stages]
            per_layer = {c.bytes_per_token // n for c, n in zip(components, layers)}
            assert len(per_layer) == 1 and per_layer.pop() > 0  # the same layers, by count
            scheduler = Scheduler(SchedulerConfig(
                max_active_sequences=N_SEQ, max_tokens_per_iteration=64,
                memory_components=components, **_pipelined(host)))
            most = []

            def watch(engine):
                most.append(len(scheduler.snapshot().active_ids))

            requests = [Request(f"m{i}", [1] + list(range(30 + i, 200 + i)), MAX_GEN)
                        for i in range(5)]
            engine = Engine(scheduler, host, clock=VirtualClock(LAB_COST), before_step=watch,
                            max_iterations=3000)
            report = engine.run(requests)
            assert max(most) == 2
            for req, rec in zip(requests, report.records):
                want = alone(req.prompt_tokens, req.max_tokens)
                assert rec.tokens == (want[:-1] if rec.finish_reason == "stop" else want)
