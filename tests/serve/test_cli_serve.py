"""`skippy-scheduler serve`: flag errors, and the three-command start."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import openai
import pytest

from skippy_scheduler import cli


@pytest.mark.parametrize("argv,message", [
    (["--inflight", "0"], "--inflight"),
    (["--max-active", "300"], "--max-active (+ --prefix-holders with reuse) must be <= 256"),
    (["--max-active", "250", "--prefix-cache-tokens", "64", "--prefix-holders", "16"],
     "--prefix-holders with reuse"),
    (["--max-active", "8", "--ctx-size", "4"], "--ctx-size (4) must be at least --max-active"),
    (["--model", "/nonexistent.gguf"], "model file not found"),
    (["--port", "70000"], "expected a port in [0, 65535]"),
    (["--api-key", ""], "leave --api-key out to require no key"),
    (["--api-key", " k "], "without spaces around it"),
    (["--allowed-origins", "http://a.example/path"], "scheme, host and port only"),
    (["--allowed-origins", "a.example"], "expected an origin"),
    (["--allowed-origins", "https://"], "expected an origin"),
])
def test_user_errors_are_one_line_and_exit_2(argv, message, capsys):
    assert cli.main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize("value, message", [
    ("", "SKIPPY_API_KEY is empty"), ("  ", "SKIPPY_API_KEY is empty"),
    ("k ", "SKIPPY_API_KEY is set with spaces around the key")])
def test_an_empty_or_padded_key_from_the_environment_is_refused(monkeypatch, capsys, value,
                                                               message):
    """Set and empty is most often a secret that did not arrive: it started an open server; a
    padded key could never match (HTTP trims header values)."""
    monkeypatch.setenv("SKIPPY_API_KEY", value)
    assert cli.main(["serve", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_a_stages_directory_without_stage_files_is_one_line(tmp_path, capsys):
    (tmp_path / "stage-0.gguf").write_bytes(b"")
    (tmp_path / "stage-2.gguf").write_bytes(b"")  # stage 1 missing
    assert cli.main(["serve", "--stages", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--stages: " in err and "found [0, 2]" in err and "Traceback" not in err
    assert cli.main(["serve", "--stages", str(tmp_path / "..")]) == 2
    err = capsys.readouterr().err
    assert "--stages: " in err and "found []" in err and "Traceback" not in err


def test_serve_with_defaults_answers_a_streamed_chat_request():
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    # Port 0: the system picks one, and the startup line says which.
    proc = subprocess.Popen([sys.executable, "-m", "skippy_scheduler.cli", "serve", "--port",
                             "0"], stderr=subprocess.PIPE, text=True, env=env,
                            cwd=os.path.dirname(sys.executable))
    try:
        banner = proc.stderr.readline()
        found = re.search(r" on http://127\.0\.0\.1:(\d+)/v1 ", banner)
        assert found and int(found.group(1)) > 0, banner
        port = int(found.group(1))
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
