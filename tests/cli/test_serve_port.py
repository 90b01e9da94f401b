"""`serve` refuses an address that is taken before it loads the model or prints its banner."""
from __future__ import annotations

import socket

import pytest

from skippy_scheduler.cli import main, serve

pytest.importorskip("gguf")  # the default tiny model is written with it (the llama extra)


def test_a_taken_port_is_refused_before_the_model_loads(capsys, monkeypatch):
    def no_load():
        raise AssertionError("the model was loaded for a port that is taken")

    monkeypatch.setattr(serve, "import_llama_host", no_load)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code = main(["serve", "--port", str(port)])
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert code == 2 and out == "" and len(lines) == 2, err
    assert lines[1].startswith(f"skippy-scheduler serve: error: cannot listen on "
                               f"127.0.0.1:{port}: ")
    assert "lanes of" not in err  # no startup line
