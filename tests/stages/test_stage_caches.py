"""Prefix holders with a capacity per stage: the scheduler restores only what every stage holds,
a prefix one stage alone let go is recomputed (and the affinity read before it was evicted is
refreshed), and tokens stay the unsplit model's alone runs. Real stage processes over pyzmq."""
from __future__ import annotations

import random

import pytest

pytest.importorskip("llama_cpp")
pytest.importorskip("zmq")

from skippy_scheduler import SchedulerConfig, Scheduler, TwinScheduler  # noqa: E402
from skippy_scheduler.cost_model import LAB_COST  # noqa: E402
from skippy_scheduler.engine import Engine, Request, VirtualClock  # noqa: E402
from skippy_scheduler.hosts.stages.holders import (  # noqa: E402
    StageHolders, check_stage_capacities)
from skippy_scheduler.hosts.stages.local import LocalStages  # noqa: E402

from stages_common import MAX_GEN, N_SEQ, random_trial  # noqa: E402

CAP = 300


def _host(local: LocalStages, caps, **kw):
    return local.host(n_ctx=(N_SEQ + 6) * 512, n_seq_max=N_SEQ, n_batch=512, n_threads=1,
                      prefix_cache_tokens=CAP, prefix_holders=6, stage_prefix_cache_tokens=caps,
                      **kw)


@pytest.fixture(scope="module", params=[2, 3], ids=["P2", "P3"])
def uneven(request, splits, model4):
    """The last stage keeps at most 120 tokens of prefixes, the others 300."""
    p = request.param
    with LocalStages(splits[p], source_model=model4) as local:
        with _host(local, [CAP] * (p - 1) + [120]) as host:
            yield host


def _run(host, requests, max_active=1):
    scheduler = Scheduler(SchedulerConfig(
        max_active_sequences=max_active, max_tokens_per_iteration=64, prefill_chunk_tokens=16,
        mixed_prefill_decode=True, **host.sequence_id_settings))
    engine = Engine(scheduler, host, clock=VirtualClock(LAB_COST), max_iterations=3000)
    engine.add_requests(requests)
    try:
        report = engine.run()
    finally:
        scheduler.attach_prefix_store(None)  # the store serves the next run's scheduler
    return report, scheduler.metrics()


def _check_stages_agree(host) -> None:
    """Every stage holds the same holders, the scheduler's store holds only entries every
    stage's own store holds, and no stage's store is over its capacity."""
    host.sync()
    assert host.held() == [{}] * len(host.stages)  # lanes empty
    kept = host.held(holders=True)
    assert kept == [kept[0]] * len(host.stages)
    holders = host.holders
    assert isinstance(holders, StageHolders)
    for k, shadow in enumerate(holders.stage_stores):
        assert shadow.used_tokens <= holders.stage_capacities[k]
        mine = {tuple(e.key) for e in shadow.resident()}
        assert {tuple(e.key) for e in host.prefix_store.resident()} == mine, k
    # What the driver thinks every holder keeps is what the stages report.
    want = {e.holder: e.length for e in host.prefix_store.resident()}
    assert {h: n for h, n in kept[0].items() if h >= host.n_seq_max} == want


def test_unequal_capacities_give_the_unsplit_tokens(uneven, alone):
    """Shared stems, repeats, several sequences at once: the small stage evicts (and so the
    scheduler's store with it), the others alone never would; tokens are the alone runs'."""
    host = uneven
    restored = 0
    for seed in range(5):
        rng = random.Random(2000 + seed)
        stems = [[1] + [rng.randrange(3, 384) for _ in range(rng.randrange(16, 60))]
                 for _ in range(3)]
        requests = []
        for i in range(8):
            prompt = list(rng.choice(stems))
            if rng.random() < 0.7:
                prompt += [rng.randrange(3, 384) for _ in range(rng.randrange(1, 20))]
            requests.append(Request(f"u{i}", prompt, rng.randrange(1, MAX_GEN + 1),
                                    arrival_us=i * 800.0))
        report, metrics = _run(host, requests, max_active=rng.randrange(1, 4))
        for req, rec in zip(requests, report.records):
            want = alone(req.prompt_tokens, req.max_tokens)
            if rec.finish_reason == "stop":  # the alone run ends at the same end token
                assert want and host.is_eog(want[-1]), (seed, req.id, want)
                want = want[:-1]
            else:
                assert rec.finish_reason == "length"
            assert rec.tokens == want, (seed, req.id)
        restored += metrics.restored_tokens
        _check_stages_agree(host)
    holders = host.holders
    assert restored > 100
    assert holders.stage_evictions[-1] > 0  # the small stage let prefixes go by itself
    assert holders.stage_evictions[:-1] == [0] * (len(host.stages) - 1)
    assert host.memory_components[-1].resident_bytes < host.memory_components[0].resident_bytes


def _evicted_in_one_stage(host, alone):
    """A, then B and C waiting (B first, by priority); C repeats A's prompt. B's release
    makes room for B's prefix; C's affinity was read while A's prefix was resident."""
    rng = random.Random(7)
    a = [1] + [rng.randrange(3, 384) for _ in range(59)]
    b = [1] + [rng.randrange(3, 384) for _ in range(59)]
    _run(host, [Request("a", a, 4, arrival_us=0.0)])
    report, metrics = _run(host, [Request("b", b, 4, arrival_us=0.0, priority=1),
                                  Request("c", a, 4, arrival_us=0.0)])
    by_id = {r.id: r for r in report.records}
    assert by_id["b"].first_token_us < by_id["c"].first_token_us  # B ran first
    assert by_id["c"].tokens == alone(a, 4) and by_id["b"].tokens == alone(b, 4)
    return metrics.restored_tokens


def test_a_prefix_one_stage_evicted_is_recomputed(splits, model4, alone):
    """With room for one 63-token prefix on stage 1 only, B's prefix pushes A's out of stage
    1 (stage 0 keeps room for both): C, which repeats A's prompt and had A's prefix as its
    affinity when it arrived, restores nothing of it and recomputes, with A's tokens. With
    the same capacity on both stages C restores A's prefix."""
    with LocalStages(splits[2], source_model=model4) as local:
        with _host(local, [CAP, 80]) as host:
            restored = _evicted_in_one_stage(host, alone)
            # A's prefix went for B's, then B's for C's (A's again), on stage 1 only.
            assert host.holders.stage_evictions == [0, 2]
            _check_stages_agree(host)
        assert restored <= 2  # B and C: at most the BOS every prompt starts with, each
        with _host(local, [CAP, CAP]) as host:
            assert _evicted_in_one_stage(host, alone) >= 59


def test_per_stage_capacities_are_checked_before_anything_starts():
    assert check_stage_capacities(None, 64, 3) == [64, 64, 64]
    assert check_stage_capacities([64, 8], 64, 2) == [64, 8]
    with pytest.raises(ValueError, match="for 3 stages"):
        check_stage_capacities([64, 8], 64, 3)
    with pytest.raises(ValueError, match="from 1 to prefix_cache_tokens"):
        check_stage_capacities([65, 8], 64, 2)
    with pytest.raises(ValueError, match="from 1 to prefix_cache_tokens"):
        check_stage_capacities([0, 8], 64, 2)
    with pytest.raises(ValueError, match="need prefix_cache_tokens"):
        check_stage_capacities([8, 8], 0, 2)


def test_run_with_a_capacity_per_stage(tmp_path, capsys, model4, splits, alone):
    """`run --stages DIR --stage-prefix-cache-tokens A,B`: the unsplit tokens, the capacities
    in the settings; a count that does not match the stages is refused with the reason."""
    import json

    from skippy_scheduler import cli

    stem = [1] + list(range(10, 70))
    prompts = [stem + [5], [1] + list(range(100, 160)), stem + [6, 7], stem + [8]]
    (tmp_path / "p.json").write_text(json.dumps(prompts))
    common = ["run", "--model", model4, "--prompts", tmp_path / "p.json", "--max-tokens", 4,
              "--threads", 1, "--max-active", 1, "--prefix-cache-tokens", 200,
              "--stages", splits[2]]
    assert cli.main([str(a) for a in common + ["--stage-prefix-cache-tokens", "200,70",
                                               "--json", tmp_path / "o.json"]]) == 0
    doc = json.loads((tmp_path / "o.json").read_text())
    assert doc["settings"]["stage_prefix_cache_tokens"] == [200, 70]
    lanes = 256  # one lane of 256 cells (the longest prompt and 4 tokens, padded)
    # Each context: the lane's cells and its own holders' (one cache holds both, so they
    # share cells), whatever the holders' streams would take in one llama.cpp context.
    assert doc["settings"]["stage_cells"] == [lanes + 256, lanes + 256]
    for r in doc["requests"]:
        assert r["generated_tokens"] == alone(r["prompt_tokens"], 4)
    assert cli.main([str(a) for a in common + ["--stage-prefix-cache-tokens", "300,70",
                                               "--prefix-cache-tokens", 300,
                                               "--json", tmp_path / "o2.json"]]) == 0
    doc = json.loads((tmp_path / "o2.json").read_text())
    assert doc["settings"]["stage_cells"] == [lanes + 512, lanes + 256]
    for r in doc["requests"]:
        assert r["generated_tokens"] == alone(r["prompt_tokens"], 4)
    assert cli.main([str(a) for a in common + ["--stage-prefix-cache-tokens", "200,70,70"]]) == 2
    assert "3 per-stage prefix cache capacities for 2 stages" in capsys.readouterr().err
    assert cli.main([str(a) for a in common + ["--stage-prefix-cache-tokens", "201,70"]]) == 2
    assert "at most --prefix-cache-tokens (200)" in capsys.readouterr().err


def test_each_stage_measures_what_the_scheduler_budgets(uneven):
    """Mid-run, every stage reports the KV cells and bytes llama.cpp holds for each sequence:
    the lanes' cells are the positions the driver counts, and the bytes per position (the
    measured slope between lanes of different lengths) are the stage's memory component's
    `bytes_per_token`, by the stage's own layer count. After the run the holders' cells are
    the entries of the store, within the stage's capacity."""
    host = uneven
    rng = random.Random(11)
    requests = [Request(f"m{i}", [1] + [rng.randrange(3, 384) for _ in range(20 + 17 * i)], 8,
                        arrival_us=0.0) for i in range(3)]
    scheduler = Scheduler(SchedulerConfig(
        max_active_sequences=3, max_tokens_per_iteration=512, prefill_chunk_tokens=256,
        mixed_prefill_decode=True, **host.sequence_id_settings))
    engine = Engine(scheduler, host, clock=VirtualClock(LAB_COST), max_iterations=100)
    engine.add_requests(requests)
    try:
        for _ in range(4):  # prefill, then a few decode steps: every lane holds KV
            engine.step()
        usage = host.stage_usage()
        state = host.host_state()
        components = host.memory_components
        assert len(usage) == len(components) == len(host.stages)
        layers = [s.layer_end - s.layer_start for s in host.stages]
        per_layer = components[0].bytes_per_token // layers[0]
        for k, (u, comp) in enumerate(zip(usage, components)):
            assert u.index == k
            assert comp.bytes_per_token == u.kv_bytes_per_token == per_layer * layers[k]
            assert u.lane_cells == state.kv_tokens > 0  # llama.cpp's cells, the driver's count
            lanes = sorted((v for s, v in u.seqs.items() if s < host.n_seq_max), key=lambda v: v[0])
            assert len(lanes) == 3 and lanes[0][0] < lanes[-1][0]
            (c0, b0), (c1, b1) = lanes[0], lanes[-1]
            slope = (b1 - b0) / (c1 - c0)  # bytes one more position takes, as llama.cpp counts
            assert comp.bytes_per_token <= slope <= comp.bytes_per_token + 16, (k, slope)
            predicted = comp.bytes_per_token * u.lane_cells
            assert predicted <= u.lane_bytes <= predicted * 1.05 + 512 * len(lanes)
        engine.run()
    finally:
        scheduler.attach_prefix_store(None)
    host.sync()
    after = host.stage_usage()
    entries = {e.holder: e.length for e in host.prefix_store.resident()}
    assert entries
    for k, u in enumerate(after):
        assert u.lane_cells == 0
        assert {s: c for s, (c, _) in u.seqs.items()} == entries  # every holder, every stage
        assert host.holders.stage_stores[k].used_tokens <= host.stage_prefix_cache_tokens[k]
        assert u.holder_bytes >= u.kv_bytes_per_token * u.holder_cells


def test_serve_settings_carry_the_capacities(splits, model4):
    """`serve --stage-prefix-cache-tokens` reaches the stage host through the server's
    settings: each stage's memory component counts its own capacity as resident."""
    from skippy_scheduler.serve.server import ServeSettings, resolve_settings
    from skippy_scheduler.serve.staged import stage_host

    settings = ServeSettings(model=model4, stages=splits[2], max_active=4, ctx_size=1024,
                             threads=1, prefix_cache_tokens=512, prefix_holders=4,
                             stage_prefix_cache_tokens=(512, 64))
    host = stage_host(settings)
    try:
        assert host.stage_prefix_cache_tokens == [512, 64]
        assert isinstance(host.holders, StageHolders)
        resident = [c.resident_bytes // c.bytes_per_token for c in host.memory_components]
        assert resident == [512, 64]
        # Each context: the lanes' cells and its own capacity's (padded to 256 cells).
        assert host.stage_cells == host.settings["stage_cells"] == [1024 + 512, 1024 + 256]
        capacity = [c.capacity_bytes // c.bytes_per_token for c in host.memory_components]
        assert capacity == host.stage_cells
    finally:
        host.close()
    with pytest.raises(ValueError, match="3 per-stage prefix cache capacities for 2 stages"):
        stage_host(resolve_settings(ServeSettings(
            model=model4, stages=splits[2], max_active=4, ctx_size=1024, threads=1,
            prefix_cache_tokens=256, stage_prefix_cache_tokens=(256, 64, 64))))


def test_serve_checks_stage_capacities_against_the_default_reuse(capsys, model4, splits):
    """Without `--prefix-cache-tokens`, `serve --stages` sizes reuse as on one process (a
    lane's tokens per holder: 2 x 512 here) and refuses a stage capacity above that before
    any worker starts."""
    from skippy_scheduler import cli

    common = ["serve", "--model", model4, "--stages", splits[2], "-np", 2, "-c", 1024,
              "--threads", 1, "--port", 0]
    assert cli.main([str(a) for a in common + ["--stage-prefix-cache-tokens", "1025,64"]]) == 2
    assert "at most --prefix-cache-tokens (1024)" in capsys.readouterr().err
    assert cli.main([str(a) for a in common + ["--prefix-cache-tokens", 0,
                                               "--stage-prefix-cache-tokens", "64,64"]]) == 2
    assert "at most --prefix-cache-tokens (0)" in capsys.readouterr().err


@pytest.mark.parametrize("impl", [Scheduler, TwinScheduler], ids=["native", "twin"])
def test_random_schedules_with_unequal_capacities(impl, uneven, alone):
    """The random schedules (arrivals, chunked prefill, mixed rows, preemption with recompute,
    cancellation, full-prompt duplicates) with the last stage keeping far fewer prefixes."""
    counters = dict(completed=0, preempted=0, cancelled=0, mixed=0, recompute=0)
    before = list(uneven.holders.stage_evictions)
    for seed in range(400, 408):
        random_trial(impl, uneven, alone, seed, counters)
        _check_stages_agree(uneven)
    assert counters["completed"] > 25 and counters["preempted"] > 1
    assert counters["restored"] > 20
    assert uneven.holders.stage_evictions[-1] > before[-1]


def test_pipelined_schedules_with_unequal_capacities(splits, model4, alone):
    """Two plans in flight on disjoint groups, the second stage keeping far fewer prefixes: a
    release with a row still in the chain is not offered, evictions on stage 1 alone still
    reach the scheduler's store before its next selection; tokens are the alone runs'."""
    with LocalStages(splits[2], source_model=model4) as local:
        with _host(local, [CAP, 100], pipeline_depth=2) as host:
            counters = dict(completed=0, preempted=0, cancelled=0, mixed=0, recompute=0)
            for seed in range(500, 508):
                random_trial(Scheduler, host, alone, seed, counters,
                             max_inflight_plans=2, disjoint_inflight_plans=True)
                _check_stages_agree(host)
            assert counters["completed"] > 15 and counters["restored"] > 10
            assert host.most_in_flight == 2
            assert host.holders.stage_evictions[1] > 0
