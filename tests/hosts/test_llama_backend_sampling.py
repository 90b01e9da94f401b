"""Sampling on the device (llama.cpp's backend samplers, here on its CPU backend): greedy tokens
are the host path's, batched or alone; a seeded sequence samples the same tokens alone, batched,
chunked and preempted; sequences the backend cannot sample (log-probabilities, a grammar, held
end tokens) keep the host path in the same plans and get the host path's tokens; the lanes'
chains stay attached between sequences with the same settings; a bad mode is refused."""
from __future__ import annotations

import contextlib
import json
import random

import pytest

pytest.importorskip("llama_cpp")

from llama_cpp.llama_grammar import json_schema_to_gbnf  # noqa: E402

from skippy_scheduler import MemoryComponent, Scheduler, SchedulerConfig  # noqa: E402
from skippy_scheduler.cost_model import LAB_COST  # noqa: E402
from skippy_scheduler.engine import Engine, Request, TokenEvent, VirtualClock  # noqa: E402
from skippy_scheduler.hosts import kit  # noqa: E402
from skippy_scheduler.hosts.llama import LlamaHost  # noqa: E402
from skippy_scheduler.hosts.llama.backend_sampling import (  # noqa: E402
    backend_sampling_mode, device_capable, resolve_backend_sampling)
from skippy_scheduler.hosts.tiny_model import write_tiny_llama  # noqa: E402
from skippy_scheduler.sampling import OutputOptions, SamplingParams  # noqa: E402

N_SEQ = 6
KV_BYTES = 10**9
GRAMMAR = json_schema_to_gbnf(json.dumps({
    "type": "object", "properties": {"ok": {"type": "boolean"}},
    "required": ["ok"], "additionalProperties": False}))


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("model") / "tiny-f32.gguf", seed=7)


def _host(path, mode):
    return LlamaHost(path, n_ctx=N_SEQ * 512, n_seq_max=N_SEQ, n_batch=512, n_threads=1,
                     backend_sampling=mode)


@pytest.fixture(scope="module")
def device(model_path):
    with _host(model_path, "on") as h:
        assert h.settings["backend_sampling"] is True
        yield h


@pytest.fixture(scope="module")
def on_host(model_path):
    with _host(model_path, "off") as h:
        assert h.settings["backend_sampling"] is False
        yield h


def _prompts(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, 384) for _ in range(rng.randrange(1, 60))]
            for _ in range(n)]


def _run(host, requests, *, seed: int, depth: int = 1, preempt: float = 0.0,
         events: dict | None = None):
    rng = random.Random(seed)
    scheduler = Scheduler(SchedulerConfig(
        max_active_sequences=N_SEQ, max_tokens_per_iteration=rng.choice([64, 512]),
        prefill_chunk_tokens=rng.choice([7, 256]), max_inflight_plans=depth,
        memory_components=[MemoryComponent("kv", KV_BYTES, 0, 1, 0)]))
    preempted = 0

    def pressure(engine):
        nonlocal preempted
        if rng.random() < preempt:
            preempted += len(engine.preempt([KV_BYTES + 1]))
            engine.preempt([0])

    engine = Engine(scheduler, host, clock=VirtualClock(LAB_COST), before_step=pressure,
                    max_iterations=5000)
    if events is not None:
        engine.add_listener(lambda e: events.setdefault(e.request_id, []).append(e)
                            if isinstance(e, TokenEvent) else None)
    for req in requests:
        engine.submit(req)
    report = engine.run()
    assert host.active_sequences == [] and host.host_state().samplers == 0
    return {req.id: rec for req, rec in zip(requests, report.records)}, preempted


def _check_alone(host, req, rec):
    alone = host.generate_alone(req.prompt_tokens, req.max_tokens, req.sampling)
    if rec.finish_reason == "stop":
        assert rec.tokens + [alone[len(rec.tokens)]] == alone, req.id
    else:
        assert rec.tokens == alone, req.id


@pytest.mark.parametrize("depth", [1, 2])
def test_greedy_tokens_equal_the_host_paths_batched(device, on_host, depth):
    for seed in range(3):
        requests = [Request(f"g{i}", p, 20, arrival_us=0.0)
                    for i, p in enumerate(_prompts(100 + seed, 9))]
        got, _ = _run(device, requests, seed=seed, depth=depth)
        want, _ = _run(on_host, requests, seed=seed, depth=depth)
        assert {k: r.tokens for k, r in got.items()} == {k: r.tokens for k, r in want.items()}
        for req in requests[:3]:
            assert device.generate_alone(req.prompt_tokens, 20) == \
                on_host.generate_alone(req.prompt_tokens, 20)


def _seeded(rng: random.Random, i: int) -> SamplingParams:
    kinds = [
        dict(temperature=0.9),
        dict(temperature=0.8, top_k=20, top_p=0.9),
        dict(temperature=1.1, min_p=0.05, repetition_penalty=1.3, penalty_last_n=16),
        dict(temperature=0.7, top_p=0.8, frequency_penalty=0.5, presence_penalty=0.3,
             logit_bias={300: 4.0, 12: -100.0}),
        dict(temperature=0.0, repetition_penalty=1.5),  # greedy, penalised
        dict(temperature=0.9, ignore_eos=True),
    ]
    return SamplingParams(seed=rng.randrange(1 << 60), **kinds[i % len(kinds)])


@pytest.mark.parametrize("depth", [1, 2])
def test_a_seeded_request_samples_the_same_tokens_alone_batched_and_preempted(device, depth):
    preempted = 0
    for seed in range(4):
        rng = random.Random(700 + seed)
        requests = [Request(f"s{i}", p, 24, arrival_us=0.0, sampling=_seeded(rng, i + seed))
                    for i, p in enumerate(_prompts(200 + seed, 8))]
        got, n = _run(device, requests, seed=seed, depth=depth, preempt=0.15)
        preempted += n
        for req in requests:
            _check_alone(device, req, got[req.id])
    assert preempted > 0


def test_staged_ahead_the_device_samples_what_it_samples_otherwise(model_path, on_host):
    """A GPU's defaults together: two plans in flight, each staged while the one before it
    decodes (`stage_ahead`), sampled on the device. Greedy tokens are the host path's, and a
    seeded request draws its alone tokens batched and preempted."""
    with LlamaHost(model_path, n_ctx=N_SEQ * 512, n_seq_max=N_SEQ, n_batch=512, n_threads=1,
                   backend_sampling="on", stage_ahead=True) as ahead:
        for seed in range(2):
            requests = [Request(f"g{i}", p, 20, arrival_us=0.0)
                        for i, p in enumerate(_prompts(100 + seed, 9))]
            got, _ = _run(ahead, requests, seed=seed, depth=2)
            want, _ = _run(on_host, requests, seed=seed, depth=2)
            assert {k: r.tokens for k, r in got.items()} == \
                {k: r.tokens for k, r in want.items()}
        greedy = ahead.staged_ahead
        preempted = 0
        for seed in range(3):
            rng = random.Random(700 + seed)
            requests = [Request(f"s{i}", p, 24, arrival_us=0.0, sampling=_seeded(rng, i + seed))
                        for i, p in enumerate(_prompts(200 + seed, 8))]
            got, n = _run(ahead, requests, seed=seed, depth=2, preempt=0.15)
            preempted += n
            for req in requests:
                _check_alone(ahead, req, got[req.id])
        assert preempted > 0
        assert greedy > 20 and ahead.staged_ahead > greedy + 20  # both loads staged ahead


def test_temperature_alone_draws_what_the_host_chain_draws(device, on_host):
    """Reseeded per position with the host chain's seed, a temperature-only draw walks the
    vocabulary in the same order on both paths (rounding aside, which these do not meet)."""
    for i, prompt in enumerate(_prompts(300, 4)):
        params = SamplingParams(temperature=0.9, seed=1000 + i)
        assert device.generate_alone(prompt, 16, params) == \
            on_host.generate_alone(prompt, 16, params)


@contextlib.contextmanager
def _through_ctypes(host):
    """The host with every `_llama_calls` call it makes replaced by ctypes calls (as where
    llama.cpp's function addresses cannot be found): the decode and its wait for the outputs
    (the logits read),
    the cells' removals and copies, the device's reads and reseeds."""
    cells = host._lanes._cells
    chains = host._samplers.device
    saved = kit._synced, cells._remove_fn, cells._copy_fn
    # the C calls run against llama.cpp
    assert all(kit._synced_calls()) and cells._remove_fn and cells._copy_fn
    if chains is not None:
        assert chains._read_fn and all(chains._reseed_fns)
        saved_chains = chains._read_fn, chains._reseed_fns
        chains._read_fn, chains._reseed_fns = 0, (0, 0, 0)
    kit._synced, cells._remove_fn, cells._copy_fn = (0, 0), 0, 0
    try:
        yield
    finally:
        kit._synced, cells._remove_fn, cells._copy_fn = saved
        if chains is not None:
            chains._read_fn, chains._reseed_fns = saved_chains


def test_the_per_row_ctypes_path_samples_what_the_c_loops_sample(device):
    """Where llama.cpp's function addresses cannot be found the decode and its wait are two
    ctypes calls, and the device's tokens are read and its draws reseeded one ctypes call a
    row: the same tokens as the C calls."""
    rng = random.Random(31)
    requests = [Request(f"c{i}", p, 16, arrival_us=0.0,
                        sampling=_seeded(rng, i) if i % 3 else None)
                for i, p in enumerate(_prompts(310, 9))]
    in_c, _ = _run(device, requests, seed=2, depth=2)
    with _through_ctypes(device):
        per_row, _ = _run(device, requests, seed=2, depth=2)
    assert {k: r.tokens for k, r in per_row.items()} == {k: r.tokens for k, r in in_c.items()}


def test_the_host_path_reads_the_same_logits_through_ctypes(on_host):
    """Sampling on the host reads the logits the decode's one C call found: the same tokens
    and log-probabilities as through ctypes."""
    rng = random.Random(37)
    # lanes that finish early leave gaps among the decoding ones: the fillers below
    requests = [Request(f"h{i}", p, 12 if i % 3 else 4, arrival_us=0.0,
                        sampling=_host_only(rng, i, len(p)) if i % 2 else _seeded(rng, i))
                for i, p in enumerate(_prompts(370, 8))]
    events_c: dict = {}
    events_py: dict = {}
    filled = on_host.gap_fill_rows
    in_c, _ = _run(on_host, requests, seed=3, depth=2, events=events_c)
    fillers = on_host.gap_fill_rows - filled
    assert fillers > 0  # the fillers' cells were removed in C too
    with _through_ctypes(on_host):
        through, _ = _run(on_host, requests, seed=3, depth=2, events=events_py)
    assert on_host.gap_fill_rows - filled == 2 * fillers
    assert {k: r.tokens for k, r in through.items()} == {k: r.tokens for k, r in in_c.items()}
    assert events_py == events_c


def _host_only(rng: random.Random, i: int, prompt_length: int) -> SamplingParams:
    if i % 3 == 0:
        return SamplingParams(temperature=0.0, output=OutputOptions(
            logprobs=2, prompt_logprobs=1, prompt_length=prompt_length))
    if i % 3 == 1:
        return SamplingParams(temperature=1.0, seed=rng.randrange(1 << 40), output=OutputOptions(
            grammar=GRAMMAR, prompt_length=prompt_length))
    return SamplingParams(temperature=0.8, seed=rng.randrange(1 << 40), min_end_position=
                          prompt_length + 4)


def test_rows_the_device_cannot_sample_keep_the_host_path_in_the_same_plans(device, on_host):
    for seed in range(3):
        rng = random.Random(900 + seed)
        requests = []
        for i, p in enumerate(_prompts(400 + seed, 8)):
            if i % 2:
                sampling = _host_only(rng, i // 2, len(p))
                assert not device_capable(sampling)
            else:
                sampling = _seeded(rng, i) if i % 4 else None
            copies = 3 if i == 2 else 1  # choices of one prompt: forks on the host only
            for j in range(copies):
                s = sampling if j == 0 or sampling is None else SamplingParams(
                    temperature=sampling.temperature, seed=(sampling.seed or 0) + j)
                requests.append(Request(f"r{i}.{j}", p, 16, arrival_us=0.0, sampling=s))
        events: dict = {}
        got, _ = _run(device, requests, seed=seed, preempt=0.1, events=events)
        want, _ = _run(on_host, requests, seed=seed, preempt=0.1)
        for req in requests:
            rec = got[req.id]
            _check_alone(device, req, rec)
            out = req.sampling.output if req.sampling is not None else None
            if out is not None or (req.sampling is not None and
                                   req.sampling.min_end_position):
                # The host path's sampling, whatever shares the plan: the host's tokens.
                assert rec.tokens == want[req.id].tokens, req.id
            if out is not None and out.logprobs is not None:
                kept = [e for e in events[req.id] if e.token >= 0]
                assert all(e.detail is not None and e.detail.logprob is not None for e in kept)
            if out is not None and out.grammar is not None and rec.finish_reason == "stop":
                text = b"".join(device.token_bytes(t) for t in rec.tokens).decode()
                assert set(json.loads(text)) == {"ok"}
            if req.sampling is None:
                assert rec.tokens == want[req.id].tokens, req.id


def test_lanes_keep_their_chains_between_sequences_with_the_same_settings(model_path):
    with _host(model_path, "on") as h:
        params = [SamplingParams(temperature=0.8, top_k=30, seed=s) for s in range(12)]
        requests = [Request(f"a{i}", p, 8, arrival_us=0.0, sampling=params[i])
                    for i, p in enumerate(_prompts(500, 12))]
        _run(h, requests, seed=1)
        first = h.backend_chain_attaches
        assert 0 < first <= N_SEQ
        _run(h, [Request(f"b{r.id}", r.prompt_tokens, 8, arrival_us=0.0,
                         sampling=SamplingParams(temperature=0.8, top_k=30, seed=99))
                 for r in requests], seed=1)
        assert h.backend_chain_attaches == first  # same settings: reused, reset, reseeded


@pytest.mark.parametrize("value", ["maybe", 2, "", "yes"])
def test_a_bad_mode_is_refused_before_the_model_loads(tmp_path, value):
    with pytest.raises(ValueError, match="backend_sampling must be one of on, off, auto"):
        LlamaHost(tmp_path / "missing.gguf", backend_sampling=value)


def test_auto_means_on_with_layers_on_a_gpu():
    assert backend_sampling_mode(None) == "auto"
    assert backend_sampling_mode(" ON ") == "on" and backend_sampling_mode(False) == "off"
    assert resolve_backend_sampling("auto", on_gpu=True) is True
    assert resolve_backend_sampling("auto", on_gpu=False) is False
    assert resolve_backend_sampling("on", on_gpu=False) is True
    assert resolve_backend_sampling("off", on_gpu=True) is False
    # An RPC server's device: the host samples unless asked (docs/gpu.md, "Devices over RPC").
    assert resolve_backend_sampling("auto", on_gpu=True, over_rpc=True) is False
    assert resolve_backend_sampling("on", on_gpu=True, over_rpc=True) is True


def test_default_on_the_cpu_is_the_host_path(model_path):
    with LlamaHost(model_path, n_ctx=512, n_seq_max=1, n_batch=64, n_threads=1) as h:
        assert h.settings["backend_sampling"] is False


def test_run_takes_the_flag_and_refuses_a_bad_value(tmp_path, capsys, model_path, on_host):
    from skippy_scheduler import cli

    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([[1, 300, 301, 302], [1, 310], [1, 5, 6, 7, 8]]))
    out = tmp_path / "run.json"
    for argv, on in ((["--backend-sampling"], True), (["-bs", "off"], False), ([], False)):
        assert cli.main(["run", "--model", str(model_path), "--prompts", str(prompts),
                         "--max-tokens", "6", "--max-active", "3", "--threads", "1",
                         "--json", str(out), *argv]) == 0
        doc = json.loads(out.read_text())
        assert doc["settings"]["backend_sampling"] is on
        for r in doc["requests"]:
            assert r["generated_tokens"] == on_host.generate_alone(r["prompt_tokens"], 6)
    capsys.readouterr()
    assert cli.main(["run", "--model", str(model_path), "--backend-sampling", "maybe"]) == 2
    err = capsys.readouterr().err
    assert "--backend-sampling: invalid choice: 'maybe'" in err and "'auto'" in err
