"""The heartbeat of a server on remote stage workers (`--stage-addresses`): while no request
is open the server checks that every stage still answers, so that a worker that died or hung
while the server was idle turns `/health` and new requests into a 503 naming the stage, before
any request is sent to it. Busy or healthy, nothing changes."""
from __future__ import annotations

import contextlib
import os
import signal
import time

import pytest

pytest.importorskip("llama_cpp")
pytest.importorskip("zmq")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

import httpx  # noqa: E402

from skippy_scheduler.serve import Server, ServeSettings  # noqa: E402
from stages_common import listen_workers, stop_workers  # noqa: E402


def _health_until_503(url: str, limit_s: float) -> httpx.Response:
    end = time.monotonic() + limit_s
    while True:
        health = httpx.get(url + "/health", timeout=30)
        if health.status_code != 200 or time.monotonic() > end:
            return health
        time.sleep(0.1)


@contextlib.contextmanager
def _served_on_remote_stages(tmp_path, model4, splits, heartbeat_s: float):
    """A server on two remote stage workers, started: (server, workers, their addresses); the
    heartbeat every `heartbeat_s` with a minute's patience until a test shortens it."""
    procs, addresses = listen_workers(tmp_path, splits[2])
    srv = None
    try:
        srv = Server(ServeSettings(model=str(model4), stage_addresses=addresses, max_active=4,
                                   ctx_size=2048, threads=1))
        srv.runner.heartbeat_s, srv.runner.heartbeat_timeout_s = heartbeat_s, 60.0
        srv.start_in_thread()
        yield srv, procs, addresses
    finally:
        if srv is not None:
            srv.shutdown()
        stop_workers(procs)


@pytest.mark.parametrize("how", ["killed", "stopped"])
def test_a_remote_stage_lost_while_idle_is_found_by_the_heartbeat(tmp_path, model4, splits,
                                                                   how):
    with _served_on_remote_stages(tmp_path, model4, splits, 0.2) as (srv, procs, addresses):
        # Idle with every stage well: the heartbeats pass, and a request is served.
        time.sleep(1.0)
        assert httpx.get(srv.url + "/health").status_code == 200
        r = httpx.post(srv.url + "/v1/completions", timeout=60,
                       json={"prompt": [1, 2, 3], "max_tokens": 3})
        assert r.status_code == 200, r.text
        assert srv.host.broken is None
        # Short from here on (a healthy answer on a loaded machine may take a while); a beat
        # already sent is answered by then.
        srv.runner.heartbeat_timeout_s = 3.0
        time.sleep(0.5)
        assert srv.host.broken is None
        if how == "killed":
            procs[1].kill()
            procs[1].wait(30)
        else:
            os.kill(procs[1].pid, signal.SIGSTOP)
        health = _health_until_503(srv.url, 60)
        assert health.status_code == 503, "the lost stage was not noticed while idle"
        message = health.json()["error"]["message"]
        assert message.startswith("a stage of the model failed: no answer from stage 1 "
                                  f"({addresses[1]}) within 3 s while checking"), message
        r = httpx.post(srv.url + "/v1/completions", timeout=60,
                       json={"prompt": [1, 2, 3], "max_tokens": 3})
        assert r.status_code == 503 and "stage 1" in r.json()["error"]["message"], r.text
        assert srv.runner.open_subscriptions == 0


def test_a_metrics_scrape_while_idle_waits_no_longer_than_the_heartbeat(tmp_path, model4,
                                                                        splits):
    # A scrape measures every stage's KV use on the engine thread; while idle it waits for a
    # stage as long as the heartbeat does, not the chain's default minute (during which no
    # heartbeat could run, and a new request was queued on the dead stage).
    with _served_on_remote_stages(tmp_path, model4, splits, 0.2) as (srv, procs, addresses):
        r = httpx.post(srv.url + "/v1/completions", timeout=60,
                       json={"prompt": [1, 2, 3], "max_tokens": 3})
        assert r.status_code == 200, r.text
        srv.runner.heartbeat_timeout_s = 3.0
        time.sleep(0.5)
        assert srv.host.broken is None
        procs[1].kill()
        procs[1].wait(30)
        killed = time.monotonic()
        assert httpx.get(srv.url + "/metrics", timeout=30).status_code == 200
        health = _health_until_503(srv.url, 40)
        assert health.status_code == 503, "the lost stage was not noticed while idle"
        assert time.monotonic() - killed < 25  # three waits of 3 s at most, and the beat's
        message = health.json()["error"]["message"]
        assert f"no answer from stage 1 ({addresses[1]}) within 3 s" in message, message


def test_the_heartbeat_names_only_the_stage_that_does_not_answer(tmp_path, model4, splits):
    # With prefix reuse a finished request's lane is freed through the chain at the next beat;
    # a stage lost before it is named alone (the chain's answer would name every stage).
    with _served_on_remote_stages(tmp_path, model4, splits, 1.0) as (srv, procs, addresses):
        srv.runner.heartbeat_timeout_s = 3.0
        assert srv.settings.prefix_cache_tokens > 0
        r = httpx.post(srv.url + "/v1/completions", timeout=60,
                       json={"prompt": [1, 2, 3, 4, 5], "max_tokens": 3})
        assert r.status_code == 200, r.text
        procs[1].kill()  # before the next beat frees the lane
        procs[1].wait(30)
        health = _health_until_503(srv.url, 40)
        assert health.status_code == 503, "the lost stage was not noticed while idle"
        message = health.json()["error"]["message"]
        assert f"no answer from stage 1 ({addresses[1]}) within 3 s" in message, message
        assert "stage 0" not in message, message
