"""A streamed answer of several choices that fails (its step failed, or the server stopped
under it) ends with one error event: its other choices are counted as failed with it, not
as `abort` (which says the client left first), as the same answer unstreamed counts them."""
from __future__ import annotations

import sys

import pytest

pytest.importorskip("fastapi")
from serve_support import parse_metrics  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from skippy_scheduler.serve import ServeSettings  # noqa: E402

sys.path.insert(0, "bench")
from instant_host import FailingHost, build_server  # noqa: E402

BODY = {"model": "instant", "prompt": "hi", "max_tokens": 200, "n": 3, "ignore_eos": True}


def _counts(client) -> dict:
    m = parse_metrics(client.get("/metrics").text)
    return {k: v for k, v in m.items()
            if k.startswith(("skippy:request_success_total", "skippy:request_errors_total"))}


@pytest.mark.parametrize("stream", [False, True])
def test_a_failed_answer_counts_no_abort(stream):
    server = build_server(ServeSettings(max_active=4), FailingHost(6, RuntimeError("lost"),
                                                                   n_seq_max=4))
    server.runner.start()
    try:
        with TestClient(server.app) as client:
            before = _counts(client)
            r = client.post("/v1/completions", json={**BODY, "stream": stream})
            if stream:
                assert r.status_code == 200
                lines = [x for x in r.text.splitlines() if x]
                assert '"error"' in lines[-2] and lines[-1] == "data: [DONE]", lines[-3:]
            else:
                assert r.status_code == 500, r.text
            after = _counts(client)
        changed = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k)}
        assert changed == {'skippy:request_errors_total{status="500"}': 1}, changed
    finally:
        server.runner.stop()
