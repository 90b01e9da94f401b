"""Configurations where llama.cpp gives the context less than the host asked for.

llama.cpp caps a context's batch at the context size it was given (and then rounds the context
up to 256 cells per lane), and it reserves one output row per sequence id, asserting that this
fits an output limit that defaults to the batch. Before the host read back what the context
got, a plan sized from the asked-for batch aborted the whole process inside `llama_decode`
(`--ctx-size 200 --max-active 1`, a 246-token prompt) and a batch smaller than the lane count
aborted at start-up (`--batch-size 3 --max-active 4`). Both are valid requests and must be
served.

The server cases run `skippy-scheduler serve` in a subprocess, so a regression shows as a failed
test instead of taking the test run down with it.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("llama_cpp")

from skippy_scheduler import Scheduler, SchedulerConfig  # noqa: E402
from skippy_scheduler.engine import Engine, Request  # noqa: E402
from skippy_scheduler.hosts.llama import LlamaHost  # noqa: E402
from skippy_scheduler.hosts.tiny_model import write_tiny_llama  # noqa: E402


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("model") / "tiny-f32.gguf", seed=7)


def _prompt(n: int) -> list[int]:
    return [1] + [(7 * i) % 300 + 3 for i in range(n - 1)]


def test_the_host_reports_the_batch_the_context_got(model_path):
    with LlamaHost(model_path, n_ctx=200, n_seq_max=1, n_batch=512, n_threads=1) as host:
        assert host.n_batch == 200  # capped at the context size asked for
        assert host.settings["n_batch"] == 200
        assert host.n_ctx_seq == 256  # the lane itself is rounded up to 256 cells
        # A prompt longer than the batch but within the lane runs in chunks of the batch.
        tokens = host.generate_alone(_prompt(246), 4)
        assert 1 <= len(tokens) <= 4


def test_a_plan_above_the_batch_is_refused_not_decoded(model_path):
    with LlamaHost(model_path, n_ctx=200, n_seq_max=1, n_batch=512, n_threads=1) as host:
        assert host.n_batch == 200  # (else the decode below would abort the test process)
        with pytest.raises(ValueError, match="exceed the batch size 200"):
            host.run_rows([("a", _prompt(246), 0, True)])
        assert host.active_sequences == []


@pytest.mark.parametrize("n_seq_max,n_batch", [(4, 3), (8, 1)])
def test_a_batch_smaller_than_the_lanes_serves_every_lane(model_path, n_seq_max, n_batch):
    # Made in a child process first: a regression aborts that process, not the test run.
    child = subprocess.run(
        [sys.executable, "-c", "import sys; from skippy_scheduler.hosts.llama import LlamaHost; "
         "LlamaHost(sys.argv[1], n_ctx=int(sys.argv[2]), n_seq_max=int(sys.argv[3]), "
         "n_batch=int(sys.argv[4]), n_threads=1).close()",
         str(model_path), str(n_seq_max * 256), str(n_seq_max), str(n_batch)],
        capture_output=True, text=True, timeout=120,
        cwd=os.path.dirname(sys.executable))  # not the checkout: it would import its sources
    assert child.returncode == 0, child.stderr[-2000:]
    prompts = [_prompt(5 + 3 * i) for i in range(n_seq_max)]
    with LlamaHost(model_path, n_ctx=n_seq_max * 256, n_seq_max=n_seq_max, n_batch=n_batch,
                   n_threads=1) as host:
        assert host.n_batch == n_batch
        alone = [host.generate_alone(p, 6) for p in prompts]
        config = SchedulerConfig(max_active_sequences=n_seq_max, max_tokens_per_iteration=n_batch,
                                 prefill_chunk_tokens=n_batch, reserved_sequence_ids=0)
        engine = Engine(Scheduler(config), host, clock=None)
        report = engine.run([Request(f"r{i}", p, 6) for i, p in enumerate(prompts)])
        records = report.by_id()
        for i, want in enumerate(alone):
            got = records[f"r{i}"].tokens
            # An end-of-generation token ends a sequence without being one of its tokens.
            assert got == (want[:-1] if host.is_eog(want[-1]) else want)
        assert host.active_sequences == [] and host.free_slots == n_seq_max


# -- through the server ------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(model_path, *flags: str):
    port = _free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "skippy_scheduler.cli", "serve", "--model", str(model_path),
         "--port", str(port), "--threads", "1", *flags],
        stderr=subprocess.PIPE, text=True, env=env, cwd=os.path.dirname(sys.executable))
    return proc, port


def _client(proc, port):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                           max_retries=0, timeout=60)
    end = time.monotonic() + 60
    while True:
        try:
            client.models.list()
            return client
        except openai.APIConnectionError:
            if proc.poll() is not None:
                pytest.fail(f"the server exited with {proc.returncode}: {proc.stderr.read()}")
            assert time.monotonic() < end, "the server did not start"
            time.sleep(0.1)


def _stop(proc) -> None:
    try:
        proc.send_signal(signal.SIGINT)
        proc.wait(20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
        proc.stderr.close()


@pytest.mark.parametrize("flags,prompt_tokens,requests", [
    # reuse off: the context is then the lane's alone, which llama.cpp rounds up to 256 cells
    # (300 asked, 512 got: the server serves prompts longer than what was asked)
    (("--ctx-size", "300", "--max-active", "1", "--prefix-cache-tokens", "0"), 400, 1),
    (("--batch-size", "3", "--max-active", "4", "--ctx-size", "1024"), 20, 4),
])
def test_the_server_serves_what_the_context_got(model_path, flags, prompt_tokens, requests):
    pytest.importorskip("fastapi")
    proc, port = _serve(model_path, *flags)
    try:
        client = _client(proc, port)
        served = client.models.list().data[0]
        limit = served.model_extra["max_model_len"]
        assert limit >= prompt_tokens + 4

        def complete(i: int):
            return client.completions.create(model=served.id,
                                             prompt=_prompt(prompt_tokens + i),
                                             max_tokens=4, temperature=0)

        with ThreadPoolExecutor(requests) as pool:
            answers = list(pool.map(complete, range(requests)))
        for answer in answers:
            assert answer.choices[0].finish_reason in ("stop", "length")
            assert answer.usage.prompt_tokens >= prompt_tokens
        assert proc.poll() is None, "the server died"
        client.close()
    finally:
        _stop(proc)


def test_a_unified_cache_runs_a_request_that_fills_the_context(model_path):
    """A request `prepare_sequence` accepts at exactly the context's size runs to its end in a
    unified cache: the solo filler, whose extra cell the shared cache may not have (its last
    decode failed), is off there, and refused when asked for."""
    with LlamaHost(model_path, n_ctx=768, n_seq_max=2, n_batch=512, n_threads=1,
                   kv_unified=True) as host:
        assert host.settings["solo_fill"] is False  # (before, on)
        prompt = _prompt(765)  # 765 + 4 - 1 = 768 positions: the whole context
        host.prepare_sequence(Request("big", prompt, 4).to_sequence())
        engine = Engine(Scheduler(SchedulerConfig(max_active_sequences=2,
                                                  max_tokens_per_iteration=512)), host)
        (record,) = engine.run([Request("big", prompt, 4)]).records
        assert record.finish_reason in ("length", "stop") and record.tokens
        assert host.active_sequences == []
    with pytest.raises(ValueError, match="solo_fill=True needs a KV stream per sequence"):
        LlamaHost(model_path, n_ctx=768, n_seq_max=2, n_threads=1, kv_unified=True,
                  solo_fill=True)
