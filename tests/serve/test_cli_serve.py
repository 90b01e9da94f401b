"""`skippy-scheduler serve`: flag errors, and the three-command start."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import openai
import pytest

from skippy_scheduler import cli


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("argv,message", [
    (["--inflight", "0"], "--inflight"),
    (["--max-active", "300"], "--max-active (+ --prefix-holders with reuse) must be <= 256"),
    (["--max-active", "250", "--prefix-cache-tokens", "64", "--prefix-holders", "16"],
     "--prefix-holders with reuse"),
    (["--max-active", "8", "--ctx-size", "4"], "--ctx-size (4) must be at least --max-active"),
    (["--model", "/nonexistent.gguf"], "model file not found"),
    (["--port", "70000"], "expected a port in [0, 65535]"),
])
def test_user_errors_are_one_line_and_exit_2(argv, message, capsys):
    assert cli.main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_serve_with_defaults_answers_a_streamed_chat_request():
    port = _free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "skippy_scheduler.cli", "serve", "--port",
                             str(port)], stderr=subprocess.PIPE, text=True, env=env,
                            cwd=os.path.dirname(sys.executable))
    try:
        banner = proc.stderr.readline()
        assert f"http://127.0.0.1:{port}/v1" in banner, banner
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                               max_retries=0, timeout=30)
        end = time.monotonic() + 30
        while True:
            try:
                stream = client.chat.completions.create(
                    model="tiny-random-llama", messages=[{"role": "user", "content": "Hi"}],
                    max_tokens=8, stream=True)
                break
            except openai.APIConnectionError:
                assert time.monotonic() < end and proc.poll() is None
                time.sleep(0.1)
        chunks = list(stream)
        assert chunks[0].choices[0].delta.role == "assistant"
        assert chunks[-1].choices[0].finish_reason in ("stop", "length")
        client.close()
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            assert proc.wait(20) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.stderr.close()
