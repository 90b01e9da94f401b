"""`serve --scheduler`: the server runs the implementation it names, with the same tokens."""
from __future__ import annotations

import pytest

from skippy_scheduler.cli import main, serve

pytest.importorskip("gguf")  # the default tiny model is written with it (the llama extra)


def test_the_implementation_reaches_the_server(monkeypatch, capsys):
    from skippy_scheduler.serve.server import ServeSettings

    given = []

    def server(settings):  # stands in for Server: records, then stops before loading a model
        given.append(settings)
        raise ValueError("not loading a model here")

    monkeypatch.setattr(serve, "import_llama_host", lambda: None)
    monkeypatch.setattr(serve, "_import_serve", lambda: (server, ServeSettings))
    for argv, implementation in ((["--scheduler", "twin"], "twin"), ([], "native")):
        assert main(["serve", "--port", "0", *argv]) == 2
        assert "not loading a model here" in capsys.readouterr().err
        assert given.pop().scheduler == implementation
    assert main(["serve", "--scheduler", "gpu"]) == 2
    assert "invalid choice: 'gpu'" in capsys.readouterr().err


def test_the_twin_serves_the_native_tokens(tmp_path):
    pytest.importorskip("llama_cpp")
    pytest.importorskip("fastapi")
    httpx = pytest.importorskip("httpx")
    from serve_support import start_server  # tests/support

    from skippy_scheduler import Scheduler, TwinScheduler
    from skippy_scheduler.hosts.tiny_model import write_tiny_llama

    model = write_tiny_llama(tmp_path / "tiny.gguf", seed=3)
    body = {"prompt": "the scheduler", "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    tokens = {}
    for implementation, cls in (("native", Scheduler), ("twin", TwinScheduler)):
        server = start_server(model, scheduler=implementation)
        try:
            assert type(server.scheduler) is cls
            answer = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
            assert answer.status_code == 200, answer.text
            tokens[implementation] = answer.json()["choices"][0]["token_ids"]
        finally:
            server.close()
    assert tokens["twin"] == tokens["native"] and len(tokens["native"]) == 8
