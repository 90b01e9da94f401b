"""The server's step timing: `--step-log` writes one JSON line per iteration, and /metrics shows
`skippy:step_seconds{part}` and `skippy:host_busy_ratio` (docs/serving.md)."""
from __future__ import annotations

import json

import pytest
from serve_support import metrics, start_server, wait_idle

from skippy_scheduler.engine.step_timing import LOG_FIELDS, PARTS


@pytest.fixture(scope="module")
def logged(model_path, tmp_path_factory):
    path = tmp_path_factory.mktemp("step-log") / "steps.jsonl"
    server = start_server(model_path, step_log=str(path), inflight=1)
    yield server, path
    server.shutdown()


def test_step_log_and_step_metrics(logged):
    import openai

    server, path = logged
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                       timeout=60) as client:
        model = client.models.list().data[0].id
        for stream in (False, True):
            out = client.completions.create(model=model, prompt="one two three",
                                            max_tokens=6, stream=stream)
            if stream:
                list(out)
    wait_idle(server)
    seen = metrics(server.url)
    iterations = seen["skippy:iterations_total"]
    assert iterations > 0
    for p in PARTS:
        assert seen[f'skippy:step_seconds_count{{part="{p}"}}'] == iterations, p
        assert f'skippy:step_seconds_bucket{{le="+Inf",part="{p}"}}' in seen
    assert seen['skippy:step_seconds_sum{part="execute"}'] > 0
    assert 0 < seen["skippy:host_busy_ratio"] <= 1

    server.runner.call(server.runner.step_timing.flush)  # the engine thread's buffered lines
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) == iterations
    assert all(tuple(line) == LOG_FIELDS for line in lines)
    assert [line["i"] for line in lines] == list(range(1, len(lines) + 1))
    assert any(line["prefill_tokens"] > 0 for line in lines)
    assert any(line["decode_rows"] > 0 for line in lines)
    for line in lines:
        assert line["execute_ns"] > 0 and line["wall_ns"] >= line["execute_ns"]
        assert line["wait_ns"] == 0  # one plan in flight: the host runs on the engine thread
        # the llama host reports its time inside llama_decode: a part of its execute
        assert 0 < line["decode_ns"] <= line["execute_ns"]
        assert line["rows"] >= line["decode_rows"] + (line["prefill_tokens"] > 0)
        # this test's prompts go one at a time, each from position 0 in one chunk: their
        # positions sum to at least the triangle below the count
        n = line["prefill_tokens"]
        assert line["prefill_positions"] >= n * (n - 1) // 2 if n else \
            line["prefill_positions"] == 0
        # the server's default rule is the slack rule: the step's predicted execute, in µs
        assert line["predicted_us"] > 0


def test_the_busy_ratio_falls_while_the_engine_is_idle(logged):
    """Between loads the gauge counts the idle time as wall time: it falls instead of keeping
    its last busy value (an idle host spends none of its time executing)."""
    import time

    import httpx

    server, _ = logged
    for _ in range(3):
        r = httpx.post(server.url + "/v1/completions", timeout=60,
                       json={"prompt": "one two three", "max_tokens": 8})
        assert r.status_code == 200, r.text
    wait_idle(server)
    time.sleep(0.05)  # the engine's next step finds nothing: it is idle
    first = metrics(server.url)["skippy:host_busy_ratio"]
    time.sleep(0.5)
    later = metrics(server.url)["skippy:host_busy_ratio"]
    assert 0 < later < first, (first, later)
