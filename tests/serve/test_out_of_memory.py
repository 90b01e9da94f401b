"""A step that runs out of device memory (`HostOutOfMemory`, what the llama host raises when
llama_decode cannot allocate) fails the open requests with a 503 and Retry-After, not a 500,
and the server serves the next request."""
from __future__ import annotations

import sys

import pytest

pytest.importorskip("fastapi")
from starlette.testclient import TestClient  # noqa: E402

from skippy_scheduler.engine.contract import HostOutOfMemory  # noqa: E402
from skippy_scheduler.serve import ServeSettings  # noqa: E402

sys.path.insert(0, "bench")
from instant_host import FailingHost, build_server  # noqa: E402


def test_out_of_device_memory_is_a_503_and_the_server_stays_up():
    # A device full for one step (the third plan).
    host = FailingHost(3, HostOutOfMemory("out of memory for a batch of 2 tokens (llama_decode "
                                          "returned -2): CUDA error: out of memory"),
                       n_seq_max=2)
    server = build_server(ServeSettings(max_active=2), host)
    server.runner.start()
    try:
        with TestClient(server.app) as client:
            body = {"model": "instant", "prompt": "hi", "max_tokens": 8}
            first = client.post("/v1/completions", json=body)
            assert host.failed.is_set()
            assert first.status_code == 503, first.text
            assert first.headers.get("retry-after")
            assert "out of memory" in first.json()["error"]["message"]
            again = client.post("/v1/completions", json=body)
            assert again.status_code == 200, again.text
            assert again.json()["usage"]["completion_tokens"] == 8
            health = client.get("/health")
            assert health.status_code == 200
    finally:
        server.runner.stop()
    assert server.runner.crashes == 1 and "out of memory" in server.runner.last_crash
