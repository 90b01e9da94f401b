"""Staged serving end to end: stage worker processes over pyzmq, driven by the engine through
`StageHost`, one shared plan per step. Random schedules (arrivals over time, chunked prefill,
mixed rows, preemption with recompute, cancellation, duplicate prompts) at P = 2 and 3: every
request's greedy tokens equal the unsplit model's prompt run alone, and no stage keeps KV for a
request that ended."""
from __future__ import annotations

import json
import random

import pytest

pytest.importorskip("llama_cpp")
pytest.importorskip("zmq")

from skippy_scheduler import SchedulerConfig, Scheduler, TwinScheduler  # noqa: E402
from skippy_scheduler.cost_model import LAB_COST  # noqa: E402
from skippy_scheduler.engine import Engine, Request, VirtualClock  # noqa: E402
from skippy_scheduler.hosts.stages.host import StageFailure  # noqa: E402
from skippy_scheduler.hosts.stages.local import LocalStages  # noqa: E402
from skippy_scheduler.hosts.stages.split import file_identity  # noqa: E402

from stages_common import (MAX_GEN, N_SEQ, lane_outside_the_stages, listen_workers,  # noqa: E402
                           random_trial, stop_workers)

@pytest.fixture(scope="module", params=[2, 3], ids=["P2", "P3"])
def staged(request, splits, model4):
    with LocalStages(splits[request.param], source_model=model4) as local:
        with local.host(n_ctx=N_SEQ * 512, n_seq_max=N_SEQ, n_batch=512, n_threads=1) as host:
            yield host


@pytest.mark.parametrize("impl", [Scheduler, TwinScheduler], ids=["native", "twin"])
def test_random_schedules_on_stages_match_the_unsplit_model_alone(impl, staged, alone):
    counters = dict(completed=0, preempted=0, cancelled=0, mixed=0, recompute=0)
    for seed in range(12):
        random_trial(impl, staged, alone, seed, counters)
    assert counters["completed"] > 40
    assert counters["preempted"] > 2 and counters["recompute"] > 0
    assert counters["mixed"] > 2
    assert counters["cancelled"] >= 1
    assert staged.steps > 100


def test_a_stage_error_undoes_the_plan_on_every_stage(staged, alone):
    """A plan a stage refuses (a lane outside its context) fails with the stage's reason; the
    engine aborts it, the other stages are put back, and serving goes on."""
    scheduler = Scheduler(SchedulerConfig(max_active_sequences=2, max_tokens_per_iteration=64))
    engine = Engine(scheduler, staged, clock=VirtualClock(LAB_COST))
    prompt = [1, 50, 60, 70]
    engine.submit(Request("ok", prompt, 3))
    # Make the host hand out a lane the stages do not have: the first stage refuses the row.
    with lane_outside_the_stages(staged):
        with pytest.raises(StageFailure, match=r"stage 0 failed.*outside \[0, 8\)"):
            engine.step()
        assert staged.active_sequences == []
    staged.sync()
    assert staged.held() == [{}] * len(staged.stages)
    report = engine.run()
    assert report.records[0].tokens == alone(prompt, 3)
    staged.sync()
    assert staged.held() == [{}] * len(staged.stages)


def _cli(*argv):
    from skippy_scheduler import cli

    return cli.main([str(a) for a in argv])


def test_run_with_stages_prints_the_same_json_as_run(tmp_path, capsys, model4, splits, alone):
    prompts = [[1, 5, 6, 7], [1, 300, 301], [1] + list(range(10, 60)), "the cat sat"]
    (tmp_path / "p.json").write_text(json.dumps(prompts))
    common = ["--model", model4, "--prompts", tmp_path / "p.json", "--max-tokens", 6,
              "--threads", 1, "--mixed", "--prefill-chunk", 16]
    assert _cli("run", *common, "--json", tmp_path / "plain.json") == 0
    assert _cli("run", *common, "--stages", splits[3], "--json", tmp_path / "staged.json") == 0
    out = capsys.readouterr().out
    assert "4/4 completed" in out
    plain = json.loads((tmp_path / "plain.json").read_text())
    staged = json.loads((tmp_path / "staged.json").read_text())
    assert staged.keys() == plain.keys()
    assert staged["summary"].keys() == plain["summary"].keys() | {"stage_failure"}
    assert staged["summary"]["stage_failure"] is None
    assert staged["settings"]["stages"] == 3
    for a, b in zip(plain["requests"], staged["requests"]):
        assert a.keys() == b.keys()
        assert a["prompt_tokens"] == b["prompt_tokens"]
        assert a["generated_tokens"] == b["generated_tokens"] == alone(a["prompt_tokens"], 6)
    # Pipelined: three plans in flight on disjoint groups, the same tokens.
    assert _cli("run", *common, "--stages", splits[3], "--inflight", 3,
                "--json", tmp_path / "piped.json") == 0
    piped = json.loads((tmp_path / "piped.json").read_text())
    assert piped["settings"]["pipeline_depth"] == 3
    assert piped["settings"]["disjoint_inflight_plans"] is True
    for a, b in zip(plain["requests"], piped["requests"]):
        assert a["generated_tokens"] == b["generated_tokens"]


def test_run_on_running_workers_and_refusals(tmp_path, capsys, model4, splits):
    (tmp_path / "p.json").write_text(json.dumps([[1, 5, 6, 7], [1, 9]]))
    with LocalStages(splits[2]) as local:
        addrs = ",".join(local.addresses)
        assert _cli("run", "--model", model4, "--prompts", tmp_path / "p.json", "--max-tokens",
                    3, "--stage-addresses", addrs, "--json", tmp_path / "o.json") == 0
        doc = json.loads((tmp_path / "o.json").read_text())
        assert [len(r["generated_tokens"]) for r in doc["requests"]] == [3, 3]
        # The stages in the wrong order, or stages of another model: refused with the reason.
        wrong = ",".join(reversed(local.addresses))
        assert _cli("run", "--model", model4, "--prompts", tmp_path / "p.json",
                    "--stage-addresses", wrong) == 2
        assert "given as stage" in capsys.readouterr().err
    from skippy_scheduler.hosts.tiny_model import write_tiny_llama
    from stages_common import SHAPE

    other = write_tiny_llama(tmp_path / "other.gguf", seed=9, shape=SHAPE)
    assert file_identity(other) != file_identity(model4)
    assert _cli("run", "--model", other, "--prompts", tmp_path / "p.json", "--stages",
                splits[2]) == 2
    assert "another model" in capsys.readouterr().err
    assert _cli("run", "--model", model4, "--stages", tmp_path) == 2
    assert "stage-0.gguf" in capsys.readouterr().err


def test_split_command(tmp_path, capsys, model4):
    assert _cli("split", "--model", model4, "--layers", "0-2,3-3", "--out", tmp_path / "s") == 0
    out = capsys.readouterr().out
    assert "stage-0.gguf\tlayers 0-2" in out and "stage-1.gguf\tlayers 3-3" in out
    assert _cli("split", "-m", model4, "--stages", 9, "--out", tmp_path / "t") == 2
    assert "cannot split 4 layers into 9 stages" in capsys.readouterr().err


def test_a_malformed_frame_is_refused_by_a_worker_and_changes_nothing(staged):
    from skippy_scheduler.hosts.stages.wire import encode_plan

    scheduler = Scheduler(SchedulerConfig(max_active_sequences=2, max_tokens_per_iteration=64))
    engine = Engine(scheduler, staged, clock=VirtualClock(LAB_COST))
    engine.submit(Request("keep", [1, 40, 41, 42, 43], 8))
    engine.step()
    staged.sync()
    before = staged.held()
    assert before[0] and before == [before[0]] * len(staged.stages)
    good = encode_plan(step=777, serial=0, row_offsets=[0, 1], row_lanes=[5], tokens=[9],
                       positions=[0], sample_last=[1], phases=[0], new_rows=[0], release_lanes=[0])
    for bad in (good[:-1], bytes(good) + b"\0", b"\x00" * 64):
        staged._out[0].send_multipart([b"plan", bad, staged.driver_frame])
        parts = staged._recv("waiting for the refusal")
        assert parts[0] == b"err" and b"WireError" in parts[1]
    staged.sync()
    assert staged.held() == before
    engine.cancel("keep")


def test_killing_a_stage_mid_run_ends_every_request(splits, model4, alone):
    """Stage 1 of 3 is killed while requests run: every request ends (the ones done before
    with their tokens, the others failed), the surviving stages hold no KV, the scheduler has
    nothing left, and the host says what happened."""
    with LocalStages(splits[3], source_model=model4) as local:
        with local.host(n_ctx=N_SEQ * 512, n_seq_max=N_SEQ, n_batch=512, n_threads=1) as host:
            scheduler = Scheduler(SchedulerConfig(max_active_sequences=4,
                                                  max_tokens_per_iteration=64,
                                                  prefill_chunk_tokens=8,
                                                  mixed_prefill_decode=True))
            prompts = [[1] + list(range(10 + i, 30 + 3 * i)) for i in range(8)]
            requests = [Request(f"k{i}", p, 2 if i == 0 else MAX_GEN, arrival_us=i * 500.0)
                        for i, p in enumerate(prompts)]

            def kill(engine):
                if engine.iterations == 12:
                    local.kill(1)

            engine = Engine(scheduler, host, clock=VirtualClock(LAB_COST), before_step=kill,
                            max_iterations=2000)
            engine.add_requests(requests)
            report = engine.run()
            reasons = [r.finish_reason for r in report.records]
            assert set(reasons) <= {"length", "failed"} and "failed" in reasons, reasons
            assert reasons[0] == "length"
            for req, rec in zip(requests, report.records):
                if rec.finish_reason == "length":
                    assert rec.tokens == alone(req.prompt_tokens, req.max_tokens)
            assert "stage 1 was killed by signal 9 (SIGKILL)" in (host.broken or "")
            assert host.live == {0, 2}
            snap = scheduler.snapshot()
            assert not snap.active_ids and not snap.waiting_ids
            assert host.active_sequences == []
            host.sync()
            assert host.held() == [{}, {}]  # stages 0 and 2 hold nothing for ended requests


@pytest.fixture(scope="module", params=[2, 3], ids=["P2", "P3"])
def staged_reuse(request, splits, model4):
    with LocalStages(splits[request.param], source_model=model4) as local:
        with local.host(n_ctx=(N_SEQ + 6) * 512, n_seq_max=N_SEQ, n_batch=512, n_threads=1,
                        prefix_cache_tokens=300, prefix_holders=6) as host:
            yield host


def test_prefix_reuse_on_stages_gives_the_unsplit_tokens(staged_reuse, alone):
    """Requests share prefixes (and some repeat a whole prompt); finished sequences' KV stays
    in every stage's holders and later ones restore from it: tokens equal the unsplit model's
    alone runs, prompt tokens are really restored, evictions happen (a small store)."""
    host = staged_reuse
    restored = evictions = 0
    for seed in range(6):
        rng = random.Random(1000 + seed)
        stems = [[1] + [rng.randrange(3, 384) for _ in range(rng.randrange(16, 60))]
                 for _ in range(3)]
        requests = []
        for i in range(8):
            prompt = list(rng.choice(stems))
            if rng.random() < 0.7:
                prompt += [rng.randrange(3, 384) for _ in range(rng.randrange(1, 20))]
            requests.append(Request(f"p{i}", prompt, rng.randrange(1, MAX_GEN + 1),
                                    arrival_us=i * 800.0))
        config = SchedulerConfig(max_active_sequences=rng.randrange(1, 4),
                                 max_tokens_per_iteration=64, prefill_chunk_tokens=16,
                                 mixed_prefill_decode=True, **host.sequence_id_settings)
        scheduler = Scheduler(config)
        engine = Engine(scheduler, host, clock=VirtualClock(LAB_COST), max_iterations=3000)
        engine.add_requests(requests)
        report = engine.run()
        for req, rec in zip(requests, report.records):
            assert rec.finish_reason == "length"
            assert rec.tokens == alone(req.prompt_tokens, req.max_tokens), (seed, req.id)
        restored += scheduler.metrics().restored_tokens
        evictions = host.prefix_store.evictions
        scheduler.attach_prefix_store(None)  # the store serves the next trial's scheduler
        host.sync()
        assert host.held() == [{}] * len(host.stages)  # lanes empty; holders hold prefixes
        kept = host.held(holders=True)
        assert kept == [kept[0]] * len(host.stages)  # every stage holds the same prefixes
    assert restored > 200 and evictions > 0


@pytest.mark.parametrize("impl", [Scheduler, TwinScheduler], ids=["native", "twin"])
def test_random_schedules_with_prefix_reuse_on_stages(impl, staged_reuse, alone):
    """The random schedules again (preemption, cancellation, duplicates) with holders on every
    stage: a preempted sequence's KV is kept and restored, a duplicate prompt restores whole."""
    counters = dict(completed=0, preempted=0, cancelled=0, mixed=0, recompute=0)
    for seed in range(300, 308):
        random_trial(impl, staged_reuse, alone, seed, counters)
    assert counters["completed"] > 25 and counters["preempted"] > 1
    assert counters["restored"] > 50


def test_workers_on_tcp_loopback(tmp_path, model4, splits, alone):
    """`stage --listen tcp://127.0.0.1:*` workers (ports chosen by the system, read from the
    line each prints), driven with --stage-addresses; the driver listens on loopback too."""
    procs, addresses = listen_workers(tmp_path, splits[2])
    try:
        prompts = [[1, 7, 8, 9], [1, 20, 21]]
        (tmp_path / "p.json").write_text(json.dumps(prompts))
        assert _cli("run", "--model", model4, "--prompts", tmp_path / "p.json", "--max-tokens",
                    4, "--stage-addresses", ",".join(addresses), "--json",
                    tmp_path / "o.json") == 0
        doc = json.loads((tmp_path / "o.json").read_text())
        for p, r in zip(prompts, doc["requests"]):
            assert r["generated_tokens"] == alone(p, 4)
    finally:
        stop_workers(procs)


def test_the_stage_host_meets_the_host_contract(staged_reuse):
    from skippy_scheduler.engine.contract import attach

    hooks = attach(staged_reuse)
    assert hooks.prefix_store is staged_reuse.prefix_store is not None
    assert hooks.release_all is not None and hooks.host_state is not None
    state = staged_reuse.host_state(detail=True)
    assert state.active == () and state.lane_positions == {} and state.lanes == N_SEQ
