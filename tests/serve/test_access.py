"""Access to the server: the API key, CORS, and the model names it serves (a real
`skippy-scheduler serve` process on loopback, the tiny model, the official `openai` client)."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

KEY = "sk-test-7f3a"
ORIGIN = "https://allowed.example"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def served():
    """The server with its key from the environment, two names and one CORS origin."""
    port = _free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1", SKIPPY_API_KEY=KEY)
    proc = subprocess.Popen(
        [sys.executable, "-m", "skippy_scheduler.cli", "serve", "--port", str(port),
         "--served-model-name", "tiny,tiny-alias", "--allowed-origins", ORIGIN,
         "--max-active", "2", "--ctx-size", "512", "--threads", "1"],
        stderr=subprocess.PIPE, text=True, env=env, cwd=os.path.dirname(sys.executable))
    url = f"http://127.0.0.1:{port}"
    try:
        banner = proc.stderr.readline()
        assert f"{url}/v1" in banner, banner
        end = time.monotonic() + 30
        while True:
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < end and proc.poll() is None
            time.sleep(0.1)
        yield url
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(20)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(5)
            proc.stderr.close()


def _client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=30)


def test_requests_need_the_key(served):
    with _client(served, "wrong") as bad:
        with pytest.raises(openai.AuthenticationError) as info:
            bad.completions.create(model="tiny", prompt="hi", max_tokens=2)
        assert info.value.status_code == 401
        assert info.value.body["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
    bare = httpx.post(served + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert bare.status_code == 401 and bare.headers["www-authenticate"] == "Bearer"
    assert set(bare.json()["error"]) == {"message", "type", "param", "code"}
    with _client(served, KEY) as good:
        r = good.completions.create(model="tiny", prompt="hi", max_tokens=2, temperature=0)
        assert r.model == "tiny" and r.choices[0].finish_reason in ("stop", "length")


def test_health_and_metrics_are_open(served):
    assert httpx.get(served + "/health").status_code == 200
    assert httpx.get(served + "/metrics").status_code == 200


def test_several_names_are_served_and_others_are_404(served):
    with _client(served, KEY) as c:
        assert [m.id for m in c.models.list().data] == ["tiny", "tiny-alias"]
        r = c.chat.completions.create(model="tiny-alias", max_tokens=2,
                                      messages=[{"role": "user", "content": "Hi"}])
        assert r.model == "tiny-alias"
        for call in (lambda: c.completions.create(model="gpt-4", prompt="hi", max_tokens=2),
                     lambda: c.chat.completions.create(
                         model="gpt-4", messages=[{"role": "user", "content": "Hi"}],
                         stream=True)):
            with pytest.raises(openai.NotFoundError) as info:
                call()
            assert info.value.body["code"] == "model_not_found"
            assert info.value.body["param"] == "model"
            assert "gpt-4" in info.value.body["message"]
        # One model by name: the same card as in the list, and the same 404 as a request's.
        listed = {m.id: m.model_dump() for m in c.models.list().data}
        for name in ("tiny", "tiny-alias"):
            assert c.models.retrieve(name).model_dump() == listed[name]
        with pytest.raises(openai.NotFoundError) as info:
            c.models.retrieve("gpt-4")
        assert info.value.body["code"] == "model_not_found"
        assert info.value.body["type"] == "invalid_request_error"


def _preflight(url: str, origin: str) -> httpx.Response:
    return httpx.options(url + "/v1/chat/completions", headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})


def test_cors_preflight_from_an_allowed_origin_passes_and_from_another_is_refused(served):
    ok = _preflight(served, ORIGIN)
    assert ok.status_code == 204
    assert ok.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in ok.headers["access-control-allow-methods"]
    assert "authorization" in ok.headers["access-control-allow-headers"].lower()
    other = _preflight(served, "https://evil.example")
    assert other.status_code == 403 and "access-control-allow-origin" not in other.headers
    # The real request: the allowed origin may read the answer, another gets no CORS header.
    auth = {"Authorization": f"Bearer {KEY}"}
    mine = httpx.get(served + "/v1/models", headers={**auth, "Origin": ORIGIN})
    assert mine.status_code == 200 and mine.headers["access-control-allow-origin"] == ORIGIN
    theirs = httpx.get(served + "/v1/models", headers={**auth, "Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in theirs.headers


def test_no_origin_is_allowed_by_default(server):
    # The shared in-thread server: no --allowed-origins, no key.
    r = _preflight(server.url, ORIGIN)
    assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed"
    assert httpx.get(server.url + "/v1/models").status_code == 200
