"""`serve --stages`: the OpenAI server on the tiny model split in two stage worker processes,
through the real `openai` client. Greedy outputs equal the unsplit model's prompt run alone,
nothing is left held, a sampled request is a 400 before it is queued, a killed stage ends the
open requests with an error and later ones get a 503, and the workers go away with the
server."""
from __future__ import annotations

import os
import random
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("llama_cpp")
pytest.importorskip("zmq")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("openai")
pytest.importorskip("prometheus_client")

import httpx  # noqa: E402
import openai  # noqa: E402
from serve_support import Spawned, alone, is_idle, metrics, wait_idle  # noqa: E402  (tests/support)

from skippy_scheduler.sampling import SamplingParams  # noqa: E402
from skippy_scheduler.serve import Server, ServeSettings  # noqa: E402

LANES = 4
GREEDY = {"temperature": 0}


def _server(model4, stage_dir, **kw) -> Server:
    settings = dict(model=str(model4), stages=stage_dir, max_active=LANES,
                    ctx_size=LANES * 512, max_waiting=64, threads=1)
    settings.update(kw)
    srv = Server(ServeSettings(**settings))
    srv.start_in_thread()
    return srv


@pytest.fixture(scope="module", params=[1, 2], ids=["one-plan", "pipelined"])
def server(request, model4, splits):
    """Two stages; one plan in flight, or two on disjoint groups (`--inflight 2`)."""
    srv = _server(model4, splits[2], inflight=request.param)
    yield srv
    srv.shutdown()


def _hits(url: str) -> float:
    """Prompt tokens restored from the prefix holders (vLLM's counter, whatever its labels)."""
    return sum(v for k, v in metrics(url).items()
               if k.startswith("vllm:prefix_cache_hits_total"))


def _client(srv: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, 384) for _ in range(rng.randrange(1, 60))] for _ in range(n)]


def _ids(choice) -> list[int]:
    return list(choice.model_extra["token_ids"])


def _stream(client, prompt, max_tokens) -> list[int]:
    ids: list[int] = []
    for chunk in client.completions.create(model="tiny4-f32", prompt=prompt,
                                           max_tokens=max_tokens, stream=True, **GREEDY,
                                           extra_body={"return_token_ids": True}):
        ids += _ids(chunk.choices[0])
    return ids


def test_greedy_completions_on_two_stages_equal_the_prompt_run_alone(server, unsplit):
    with _client(server) as client:
        text = "the cat sat on the mat"
        r = client.completions.create(model="tiny4-f32", prompt=text, max_tokens=12, **GREEDY,
                                      extra_body={"return_token_ids": True})
        ids = unsplit.tokenize(text, special=True)
        assert r.choices[0].model_extra["prompt_token_ids"] == ids
        expected = alone(unsplit, ids, 12)
        assert _ids(r.choices[0]) == expected
        assert r.usage.completion_tokens == len(expected)
        prompts = _prompts(10, seed=3)
        with ThreadPoolExecutor(10) as pool:  # more requests than lanes: some wait
            got = list(pool.map(lambda p: _stream(client, p, 16), prompts))
        for prompt, ids in zip(prompts, got):
            assert ids == alone(unsplit, prompt, 16)
        chat = client.chat.completions.create(
            model="tiny4-f32", max_tokens=8, **GREEDY,
            messages=[{"role": "user", "content": "hello"}])
        assert chat.choices[0].finish_reason in ("length", "stop")
    if server.settings.inflight > 1:
        assert server.host.most_in_flight == 2  # both stages had a plan at once
    state = wait_idle(server)
    assert is_idle(state, server.host.n_seq_max), state
    server.host.sync()
    assert server.host.held() == [{}, {}]  # neither stage keeps KV of an ended request
    assert httpx.get(server.url + "/health").status_code == 200


def test_sampled_requests_on_stages_equal_their_alone_runs(server, unsplit):
    """The last stage samples with the request's own chain: a seeded request (temperature,
    top_k, a penalty, a bias) and `ignore_eos` give the unsplit model's alone tokens with the
    same sampling; a bias on a token outside the vocabulary is a 400 before it is queued."""
    cases = [
        ({"temperature": 0.9, "seed": 11}, SamplingParams(temperature=0.9, seed=11)),
        ({"temperature": 0.7, "seed": 5, "top_k": 20, "frequency_penalty": 0.5,
          "logit_bias": {"7": 3.0}},
         SamplingParams(temperature=0.7, seed=5, top_k=20, frequency_penalty=0.5,
                        logit_bias={7: 3.0})),
        ({"temperature": 0, "ignore_eos": True}, SamplingParams(temperature=0.0, ignore_eos=True)),
    ]
    prompts = _prompts(len(cases) * 2, seed=21)
    with _client(server) as client:
        def one(job):
            (body, _), prompt = job
            r = client.completions.create(model="tiny4-f32", prompt=prompt, max_tokens=20,
                                          extra_body={"return_token_ids": True, **body})
            return _ids(r.choices[0])
        jobs = [(cases[i % len(cases)], p) for i, p in enumerate(prompts)]
        with ThreadPoolExecutor(len(jobs)) as pool:  # batched together on the stages
            got = list(pool.map(one, jobs))
        for ((_, params), prompt), ids in zip(jobs, got):
            assert ids == alone(unsplit, prompt, 20, params), (params, prompt)
        # Reuse is on by default on stages too: a prompt, then the same prompt extended,
        # which restores the first one's prefix from the holders: both sample their alone
        # tokens all the same (the restored prefix is in the penalty window).
        assert server.settings.prefix_cache_tokens > 0
        for i, (case, prompt) in enumerate(jobs[:len(cases)]):
            hits = _hits(server.url)
            longer = prompt + [40 + i, 41, 42]
            for p in (prompt, longer):
                assert one((case, p)) == alone(unsplit, p, 20, case[1]), (case[1], p)
            assert _hits(server.url) - hits >= len(prompt)
        with pytest.raises(openai.BadRequestError, match="logit_bias"):
            client.completions.create(model="tiny4-f32", prompt=[1, 5, 6], max_tokens=4,
                                      temperature=0.8, logit_bias={"99999": 1.0})
        with pytest.raises(openai.BadRequestError, match="log-probabilities") as refused:
            client.completions.create(model="tiny4-f32", prompt=[1, 5, 6], max_tokens=4,
                                      logprobs=2)
        assert refused.value.body["message"].startswith("staged serving cannot give")
        # best_of ranks on log-probabilities: refused, and the message says it (the request
        # named none of logprobs, echo or response_format).
        with pytest.raises(openai.BadRequestError, match="best_of"):
            client.completions.create(model="tiny4-f32", prompt=[1, 5, 6], max_tokens=4,
                                      temperature=0.8, seed=7, best_of=2)
        with pytest.raises(openai.BadRequestError, match="grammar"):
            client.completions.create(model="tiny4-f32", prompt="hi", max_tokens=4,
                                      extra_body={"response_format": {"type": "json_object"}})
        # echo alone needs no report: the prompt's text, then the tokens.
        r = client.completions.create(model="tiny4-f32", prompt="hello world", max_tokens=3,
                                      temperature=0, echo=True)
        assert r.choices[0].text.startswith("hello world")
    state = wait_idle(server)
    assert is_idle(state, server.host.n_seq_max), state  # no sampler chain is left either


def test_a_killed_stage_fails_the_open_requests_and_later_ones_get_503(model4, splits,
                                                                        unsplit):
    srv = _server(model4, splits[3], ctx_size=LANES * 1024)
    procs = srv.host.processes
    try:
        started = threading.Barrier(LANES + 1, timeout=60)
        errors: list[BaseException] = []

        def one(prompt) -> None:
            with _client(srv) as client:
                stream = client.completions.create(model="tiny4-f32", prompt=prompt,
                                                   max_tokens=900, stream=True, **GREEDY)
                first = True
                try:
                    for _ in stream:
                        if first:
                            first = False
                            started.wait()
                except openai.APIError as exc:
                    errors.append(exc)
                    return
                errors.append(AssertionError("the stream ended without an error"))

        # Prompts whose greedy run does not end early: each stream is still open at the kill.
        prompts = []
        for p in _prompts(40, seed=9):
            if len(alone(unsplit, p, 300)) == 300:
                prompts.append(p)
            if len(prompts) == LANES:
                break
        assert len(prompts) == LANES
        threads = [threading.Thread(target=one, args=(p,)) for p in prompts]
        for t in threads:
            t.start()
        started.wait()
        procs[1].kill()
        for t in threads:
            t.join(120)
            assert not t.is_alive(), "a stream hung after its stage was killed"
        assert len(errors) == LANES
        assert all(isinstance(e, openai.APIError) for e in errors), errors
        assert all("stage 1" in str(e) for e in errors), errors
        with _client(srv) as client:
            with pytest.raises(openai.APIStatusError) as refused:
                client.completions.create(model="tiny4-f32", prompt=[1, 2], max_tokens=2,
                                          **GREEDY)
        assert refused.value.status_code == 503
        assert "stage 1" in str(refused.value)
        assert httpx.get(srv.url + "/health").status_code == 503
        assert srv.host.live == {0, 2}
    finally:
        srv.shutdown()
    assert all(p.poll() is not None for p in procs)  # every worker is stopped with the server


def test_a_stage_that_dies_while_the_server_is_idle_is_noticed_before_a_request(model4,
                                                                              splits):
    """`/health` and a new request get the 503 with the worker's end (its signal, not its
    startup line) as soon as it is gone, before any plan is sent to it."""
    srv = _server(model4, splits[2])
    try:
        assert httpx.get(srv.url + "/health").status_code == 200
        srv.host.processes[1].kill()
        srv.host.processes[1].wait(30)
        health = httpx.get(srv.url + "/health")
        assert health.status_code == 503
        message = health.json()["error"]["message"]
        assert message == "a stage of the model failed: stage 1 was killed by signal 9 (SIGKILL)"
        r = httpx.post(srv.url + "/v1/completions", timeout=60,
                       json={"prompt": [1, 2, 3], "max_tokens": 2})
        assert r.status_code == 503 and "stage 1 was killed by signal 9" in r.text, r.text
    finally:
        srv.shutdown()


def test_stopping_the_server_while_a_stage_hangs_is_prompt_and_ends_the_request(model4,
                                                                                splits):
    """A worker that stops answering (SIGSTOP) while a request waits on it: shutting the
    server down interrupts the wait (well before the stage timeout of a minute), the request
    gets its error, and every worker is stopped, the hung one included."""
    srv = _server(model4, splits[2])
    procs = srv.host.processes
    answers: list = []

    def ask() -> None:
        try:
            answers.append(httpx.post(srv.url + "/v1/completions", timeout=120,
                                      json={"prompt": [1, 5, 6], "max_tokens": 4}))
        except httpx.HTTPError as exc:
            answers.append(exc)

    os.kill(procs[1].pid, signal.SIGSTOP)
    try:
        t = threading.Thread(target=ask)
        t.start()
        end = time.monotonic() + 30
        while not srv.host.awaited and time.monotonic() < end:  # step 0 sent to the stages
            time.sleep(0.02)
        assert srv.host.awaited, "no plan was sent"
        t0 = time.monotonic()
        srv.shutdown()
        took = time.monotonic() - t0
        t.join(60)
        assert not t.is_alive()
    finally:
        if procs[1].poll() is None:
            os.kill(procs[1].pid, signal.SIGCONT)
        srv.shutdown()
    assert took < 30, took  # the stage timeout is 60 s; the stop interrupts it
    (answer,) = answers
    assert isinstance(answer, httpx.Response) and answer.status_code == 503, answer
    assert answer.json()["error"]["message"] == (
        "a stage of the model failed: the server is shutting down while running step 0")
    assert all(p.poll() is not None for p in procs)


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry))
    return out


def _gone(pids: list[int], timeout_s: float) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if not any(os.path.exists(f"/proc/{p}") and _state(p) != "Z" for p in pids):
            return True
        time.sleep(0.1)
    return False


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_the_command_serves_and_its_workers_go_away_with_it(tmp_path, model4, splits, unsplit,
                                                            sig):
    srv = Spawned(tmp_path, "--model", str(model4), "--stages", splits[2], "-np", "2",
                  "-c", "1024")
    workers = _children(srv.proc.pid)
    assert len(workers) == 2, srv.log()
    r = httpx.post(srv.url + "/v1/completions", timeout=60, json={
        "prompt": [1, 40, 41, 42], "max_tokens": 6, "temperature": 0, "return_token_ids": True})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == alone(unsplit, [1, 40, 41, 42], 6)
    status = srv.stop(sig)
    assert status == (0 if sig == signal.SIGTERM else -signal.SIGKILL), srv.log()
    assert _gone(workers, 10), "a stage worker outlived its server"


def _stage_gauges(url: str) -> dict[tuple[str, str, str], float]:
    """(metric, stage, holder) -> value of the per-stage KV gauges on /metrics."""
    out = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("skippy:stage_kv"):
            name, value = line.rsplit(" ", 1)
            metric, _, labels = name.partition("{")
            fields = dict(f.split("=") for f in labels.rstrip("}").split(",") if f)
            out[(metric, fields.get("stage", "").strip('"'),
                 fields.get("holder", "").strip('"'))] = float(value)
    return out


def test_metrics_show_each_stage_s_measured_kv(model4, splits):
    """`serve --stages` with a prefix capacity per stage: /metrics shows each stage's KV cells
    and bytes as llama.cpp counts them (measured at a scrape, shown at the next) beside its
    budget; with the server idle the lanes hold nothing and the holders hold the store's
    entries, on every stage."""
    srv = _server(model4, splits[2], prefix_cache_tokens=256, prefix_holders=4,
                  stage_prefix_cache_tokens=(256, 64))
    try:
        with _client(srv) as client:
            for prompt in _prompts(4, seed=9):
                client.completions.create(model="tiny4-f32", prompt=prompt, max_tokens=6,
                                          **GREEDY)
        wait_idle(srv)
        first = _stage_gauges(srv.url)
        assert first[("skippy:stage_kv_measured_age_seconds", "", "")] == -1  # none yet
        for _ in range(100):  # the engine thread measures between two steps
            got = _stage_gauges(srv.url)
            if got[("skippy:stage_kv_measured_age_seconds", "", "")] >= 0:
                break
            time.sleep(0.05)
        entries = sum(e.length for e in srv.host.prefix_store.resident())
        assert entries > 0
        for k, comp in enumerate(srv.host.memory_components):
            assert got[("skippy:stage_kv_budget_bytes", str(k), "")] == comp.capacity_bytes
            assert got[("skippy:stage_kv_cells", str(k), "lanes")] == 0
            assert got[("skippy:stage_kv_cells", str(k), "holders")] == entries
            held = got[("skippy:stage_kv_bytes", str(k), "holders")]
            assert held >= entries * comp.bytes_per_token
        assert srv.host.holders.stage_stores[1].used_tokens <= 64
    finally:
        srv.shutdown()


def test_the_default_context_on_stages_is_the_model_s_as_unsplit(model4, splits):
    """Without -c the stages' context is the model's training context (512 tokens here), each
    lane a whole share of 256 cells (the unsplit server's default), read from --model or stage
    0, at most 4096 tokens or 256 a lane; with only --stage-addresses and no model file at
    hand, 4096."""
    from skippy_scheduler.hosts.offload import footprint_from_gguf
    from skippy_scheduler.serve.server import _staged_context

    assert footprint_from_gguf(model4).n_ctx_train == 512
    for lanes, want in ((1, 512), (2, 512), (3, 768), (8, 2048), (16, 4096), (32, 8192)):
        assert _staged_context(ServeSettings(model=str(model4), stages=splits[2],
                                             max_active=lanes)) == want, lanes
        assert _staged_context(ServeSettings(stages=splits[2], max_active=lanes)) == want
    assert _staged_context(ServeSettings(stage_addresses=("tcp://127.0.0.1:1",),
                                         max_active=2)) == 4096
