"""bench/serve_overhead.py: the real app on a host that takes no time, and what it reports."""
from __future__ import annotations

import importlib.util
import json
import socket
import threading

import httpx
import pytest
import serve_overhead
from instant_host import InstantHost, build_server

from skippy_scheduler.serve import ServeSettings


def test_instant_host_streams_its_fixed_token_through_the_app():
    import uvicorn

    server = build_server(ServeSettings(max_active=4), InstantHost(n_seq_max=4))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    config = uvicorn.Config(server.app, log_level="warning", http="h11", loop="asyncio",
                            lifespan="off")
    web = uvicorn.Server(config)
    web.install_signal_handlers = lambda: None
    server.runner.start()
    thread = threading.Thread(target=web.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not web.started:
            thread.join(0.01)
        url = "http://127.0.0.1:%d" % sock.getsockname()[1]
        body = {"model": "instant", "prompt": "a b", "max_tokens": 5, "return_token_ids": True}
        doc = httpx.post(url + "/v1/completions", json=body, timeout=30).json()
        assert doc["choices"][0]["text"] == "aaaaa"
        assert doc["choices"][0]["token_ids"] == [3 + ord("a")] * 5
        assert doc["choices"][0]["prompt_token_ids"] == [1, 3 + ord("a"), 3 + ord(" "),
                                                         3 + ord("b")]
        assert doc["usage"]["completion_tokens"] == 5
    finally:
        web.should_exit = True
        thread.join(10)
        server.runner.stop()
        sock.close()
    assert server.host.releases == 1  # the finished request's state was released


@pytest.mark.parametrize("step_ms, inflight, client", [
    ("0", "1", "lean"), ("1", "1", "httpx"), ("1", "2", "lean")])
def test_overhead_smoke(tmp_path, step_ms, inflight, client):
    out = tmp_path / "overhead.jsonl"
    assert serve_overhead.main(["--concurrency", "4", "--requests", "8", "--max-tokens", "8",
                                "--prompt-tokens", "8", "--step-ms", step_ms,
                                "--inflight", inflight, "--client", client,
                                "--json", str(out)]) == 0
    doc = json.loads(out.read_text().splitlines()[-1])
    assert doc["completed"] == 8 and doc["errors"] == [] and doc["step_ms"] == float(step_ms)
    assert doc["client"] == client
    # The warm-up requests ran before the window: the server counted exactly the load's tokens.
    assert doc["output_tokens"] == doc["server_tokens"] == 64
    # 4 lanes, one token per request per step: at least 64 / 4 steps.
    assert doc["output_tokens_per_s"] > 0 and doc["steps"] >= 16
    assert 1 <= doc["tokens_per_step"] <= 4
    # Every token streamed in some chunk, and no chunk without one.
    assert 8 <= doc["token_chunks"] <= 64
    assert doc["tokens_per_chunk"] == pytest.approx(64 / doc["token_chunks"])
    if step_ms == "0":
        assert doc["plan_busy_pct"] is None
    else:  # the plans' sleep fits in the load's wall time
        assert 0 < doc["plan_busy_pct"] <= 101
    assert doc["server_cpu_us_per_token"] == pytest.approx(
        doc["server_http_cpu_us_per_token"] + doc["server_engine_cpu_us_per_token"])
    assert doc["server_cpu_s"] > 0 and doc["server_cpu_us_per_step"] > 0


def test_overhead_refuses_bad_options(capsys):
    with pytest.raises(SystemExit) as exc:
        serve_overhead.main(["--concurrency", "8", "--requests", "4"])
    assert exc.value.code == 2
    assert "--concurrency" in capsys.readouterr().err


def test_overhead_profile_writes_the_loop_and_engine_stats(tmp_path):
    import pstats

    prof = tmp_path / "prof"
    assert serve_overhead.main(["--concurrency", "2", "--requests", "2", "--max-tokens", "4",
                                "--prompt-tokens", "4", "--profile", str(prof)]) == 0
    loop = pstats.Stats(str(prof) + ".loop")
    engine = pstats.Stats(str(prof) + ".engine")
    assert any(name == "feed" for _, _, name in loop.stats)  # the generations ran on the loop
    assert any(name == "plan_iteration" or name == "_plan" for _, _, name in engine.stats)


def test_pieces_times_every_piece(tmp_path):
    import serve_pieces

    out = tmp_path / "pieces.jsonl"
    assert serve_pieces.main(["--number", "50", "--repeat", "1", "--rows", "8",
                              "--json", str(out)]) == 0
    doc = json.loads(out.read_text().splitlines()[-1])
    keys = [k for k in doc if k.endswith("_us")]
    with_llama = importlib.util.find_spec("llama_cpp") is not None  # greedy_pick
    assert len(keys) == 10 + with_llama and all(doc[k] > 0 for k in keys)
