"""What the SLO and error counters count: an answer whose first token was the end token is
judged (and its TTFT observed); a streamed answer that fails is an error as the same failure
unstreamed is; an answer that fails in one choice counts nowhere in the SLO's verdicts."""
from __future__ import annotations

import sys

import pytest

pytest.importorskip("fastapi")
from starlette.testclient import TestClient  # noqa: E402

from skippy_scheduler.engine.contract import HostOutOfMemory  # noqa: E402
from skippy_scheduler.serve import ServeSettings  # noqa: E402
from skippy_scheduler.serve.slo import Slo, SloSettings  # noqa: E402

sys.path.insert(0, "bench")
from instant_host import FailingHost, InstantHost, build_server  # noqa: E402
from serve_support import parse_metrics  # noqa: E402

LOOSE = SloSettings(ttft_ms=600_000.0, itl_ms=600_000.0)  # every answer makes it


def _counters(client: TestClient) -> dict[str, float]:
    return parse_metrics(client.get("/metrics").text)


def _serve(host, **settings):  # type: ignore[no-untyped-def]
    server = build_server(ServeSettings(**settings), host)
    ctx = server.app.state.ctx
    ctx.slo = Slo(LOOSE, metrics=ctx.metrics)
    server.runner.start()
    return server


def test_an_answer_that_ends_at_once_is_judged_with_its_ttft():
    server = _serve(InstantHost(token=-1), max_active=2)  # the end token, first
    try:
        with TestClient(server.app) as client:
            for body in ({}, {"logprobs": 1}):  # the end signal with and without its detail
                r = client.post("/v1/completions", json={"model": "instant", "prompt": "hi",
                                                         "max_tokens": 4, **body})
                assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == \
                    "stop"
            got = _counters(client)
    finally:
        server.runner.stop()
    assert got["skippy:time_to_first_token_seconds_count"] == 2
    assert got['skippy:slo_met_total{part="ttft"}'] == 2
    assert got['skippy:slo_missed_total{part="ttft"}'] == 0


def test_a_streamed_failure_is_an_error_as_unstreamed():
    for stream in (False, True):
        server = _serve(FailingHost(4, HostOutOfMemory("out of memory"), n_seq_max=2, step_s=0.002), max_active=2)
        try:
            with TestClient(server.app) as client:
                r = client.post("/v1/completions", json={"model": "instant", "prompt": "hi",
                                                         "max_tokens": 8, "stream": stream})
                if stream:
                    assert r.status_code == 200 and "out of memory" in r.text
                else:
                    assert r.status_code == 503
                got = _counters(client)
        finally:
            server.runner.stop()
        assert got['skippy:request_errors_total{status="503"}'] == 1, stream
        assert got['skippy:slo_met_total{part="both"}'] == 0
        assert got['skippy:slo_missed_total{part="both"}'] == 0


def test_an_answer_failing_in_one_choice_counts_nowhere_in_the_slo():
    # One lane: the first prompt runs whole, the second fails at the sixth plan.
    server = _serve(FailingHost(6, HostOutOfMemory("out of memory"), n_seq_max=1, step_s=0.002), max_active=1, max_waiting=8)
    try:
        with TestClient(server.app) as client:
            r = client.post("/v1/completions", json={"model": "instant", "prompt": ["hi", "yo"],
                                                     "max_tokens": 4})
            assert r.status_code == 503
            got = _counters(client)
    finally:
        server.runner.stop()
    assert got['skippy:slo_met_total{part="both"}'] == 0
    assert got['skippy:slo_missed_total{part="both"}'] == 0


def test_an_unstreamed_answer_whose_client_left_counts_nowhere_in_the_slo():
    """Two prompts on one lane: the first ends, then the client leaves before the second does;
    the choice that ended is not judged (the answer never went out)."""
    import asyncio
    import json
    import threading

    from prometheus_client import generate_latest

    reached, release = threading.Event(), threading.Event()

    class Hold(InstantHost):
        plans = 0

        def execute(self, plan) -> None:  # type: ignore[no-untyped-def]
            self.plans += 1
            if self.plans == 6:  # the second prompt's first plan: the first ran whole
                reached.set()
                release.wait(10)
            super().execute(plan)

    server = _serve(Hold(n_seq_max=1, step_s=0.002), max_active=1, max_waiting=8)
    body = json.dumps({"model": "instant", "prompt": ["hi", "yo"], "max_tokens": 4}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/completions",
             "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
             "headers": [(b"host", b"127.0.0.1"), (b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode())],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    calls = 0

    async def receive():  # type: ignore[no-untyped-def]
        nonlocal calls
        calls += 1
        if calls == 1:
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.to_thread(reached.wait, 10)  # gone once the first choice has ended
        return {"type": "http.disconnect"}

    async def send(message) -> None:  # type: ignore[no-untyped-def]
        pass

    try:
        asyncio.run(server.app(scope, receive, send))
    finally:
        release.set()
        server.runner.stop()
    text = generate_latest(server.app.state.ctx.metrics.registry).decode()
    assert reached.is_set()
    assert 'skippy:request_success_total{finished_reason="abort"} 1.0' in text
    assert 'skippy:slo_met_total{part="both"} 0.0' in text
    assert 'skippy:slo_missed_total{part="both"} 0.0' in text
