"""The server through the official `openai` client: outputs, streaming, concurrency, errors."""
from __future__ import annotations

import random
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from serve_support import LANE_CTX, alone, metrics, start_server, text_of, wait_idle, is_idle

from skippy_scheduler.sampling import SamplingParams
from skippy_scheduler.serve.text import Detokenizer

GREEDY = {"temperature": 0}


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [1, 2, 5, 17, 40, 90, 130, 300]
    return [[1] + [rng.randrange(3, 384) for _ in range(lengths[i % len(lengths)] - 1)]
            for i in range(n)]


def _ids(choice) -> list[int]:
    return list(choice.model_extra["token_ids"])


def test_models_health_and_metrics(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny-f32"]
    assert models.data[0].model_extra["max_model_len"] == LANE_CTX
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    head = httpx.head(server.url + "/health")
    assert head.status_code == 200 and head.content == b""
    m = metrics(server.url)
    for name in ("skippy:num_requests_running", "skippy:num_requests_waiting",
                 "skippy:time_to_first_token_seconds_count", "skippy:prompt_tokens_total",
                 "skippy:generation_tokens_total", "skippy:prefix_cache_hit_rate",
                 'skippy:num_preemptions_total{reason="memory"}',
                 "skippy:inter_token_latency_seconds_count",
                 "skippy:e2e_request_latency_seconds_count"):
        assert name in m, name
    missing = httpx.get(server.url + "/v1/nothing")
    assert missing.status_code == 404 and "message" in missing.json()["error"]


def test_greedy_completion_equals_the_prompt_run_alone(client, reference):
    for prompt in ["the cat sat on the mat", _prompts(3)[2]]:
        r = client.completions.create(model="tiny-f32", prompt=prompt, max_tokens=12, **GREEDY,
                                      extra_body={"return_token_ids": True})
        ids = reference.tokenize(prompt, special=True) if isinstance(prompt, str) else prompt
        expected = alone(reference, ids, 12)
        choice = r.choices[0]
        assert _ids(choice) == expected
        assert choice.model_extra["prompt_token_ids"] == ids  # in the choice, as vLLM
        assert "prompt_token_ids" not in r.model_extra
        assert choice.text == text_of(reference, expected)
        assert choice.finish_reason == ("length" if len(expected) == 12 else "stop")
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), len(expected))


def _stream_ids(client, prompt, max_tokens, **kw) -> tuple[list[int], str, str]:
    ids, text, finish = [], [], None
    stream = client.completions.create(model="tiny-f32", prompt=prompt, max_tokens=max_tokens,
                                       stream=True, extra_body={"return_token_ids": True,
                                                                **kw.pop("extra", {})}, **kw)
    for chunk in stream:
        c = chunk.choices[0]
        ids += _ids(c)
        text.append(c.text)
        finish = c.finish_reason or finish
    return ids, "".join(text), finish


def test_sixteen_concurrent_streams_each_equal_their_alone_run(client, reference):
    prompts = _prompts(16, seed=1)
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda p: _stream_ids(client, p, 20, **GREEDY), prompts))
    for prompt, (ids, text, finish) in zip(prompts, results):
        expected = alone(reference, prompt, 20)
        assert ids == expected
        assert text == text_of(reference, expected)
        assert finish == ("length" if len(expected) == 20 else "stop")


def test_two_plans_in_flight_give_the_same_streams(model_path, reference):
    """--inflight 2: llama_decode on the host's worker thread while the engine plans the next
    step; seeded sampling and greedy streams still equal their alone runs."""
    srv = start_server(model_path, inflight=2)
    try:
        with openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0,
                           timeout=60) as c:
            prompts = _prompts(12, seed=5)
            with ThreadPoolExecutor(12) as pool:
                results = list(pool.map(lambda p: _stream_ids(c, p, 16, **GREEDY), prompts))
            for prompt, (ids, text, finish) in zip(prompts, results):
                assert ids == alone(reference, prompt, 16)
            assert srv.scheduler.config.max_inflight_plans == 2
            assert srv.scheduler.metrics().iterations > 0
    finally:
        srv.shutdown()


def test_prefix_reuse_restores_shared_prefixes_and_keeps_every_output(model_path, reference):
    """--prefix-cache-tokens: finished requests' KV stays resident and later requests sharing
    the prefix restore it; every stream still equals its prompt run alone, and nothing is left
    pinned or held once the server is idle."""
    rng = random.Random(9)
    heads = [[1] + [rng.randrange(3, 384) for _ in range(80)] for _ in range(3)]
    prompts = [heads[i % 3] + [rng.randrange(3, 384) for _ in range(rng.randrange(0, 12))]
               for i in range(18)]
    srv = start_server(model_path, prefix_cache_tokens=1024, prefix_holders=6)
    try:
        with openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0,
                           timeout=60) as c:
            for prompt in prompts[:3]:  # one per group first, so the rest can hit
                assert _stream_ids(c, prompt, 8, **GREEDY)[0] == alone(reference, prompt, 8)
            with ThreadPoolExecutor(8) as pool:
                results = list(pool.map(lambda p: _stream_ids(c, p, 8, **GREEDY), prompts[3:]))
            for prompt, (ids, _text, _finish) in zip(prompts[3:], results):
                assert ids == alone(reference, prompt, 8)
        m = srv.scheduler.metrics()
        assert m.restored_tokens >= 15 * 80 // 2 and m.prefix_hits > 0
        assert is_idle(wait_idle(srv), srv.host.n_seq_max)
        assert all(e.pins == 0 for e in srv.host.prefix_store.resident())
    finally:
        srv.shutdown()


def test_usage_counts_the_prompt_tokens_taken_from_a_kept_prefix(model_path):
    """usage.prompt_tokens_details.cached_tokens: 0 for a prompt nothing was kept for, the
    restored prefix for one that shares it (streamed with include_usage too), never more than
    the prompt; with n choices the prompt and its cached tokens count once."""
    head = [1] + list(range(10, 90))
    srv = start_server(model_path, prefix_cache_tokens=1024, prefix_holders=4)
    try:
        with openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0,
                           timeout=60) as c:
            first = c.completions.create(model="tiny-f32", prompt=head + [5, 6], max_tokens=2,
                                         **GREEDY)
            assert first.usage.prompt_tokens_details.cached_tokens == 0
            wait_idle(srv)
            again = c.completions.create(model="tiny-f32", prompt=head + [7, 8, 9],
                                         max_tokens=2, **GREEDY)
            cached = again.usage.prompt_tokens_details.cached_tokens
            assert 64 <= cached <= len(head), cached
            wait_idle(srv)
            stream = c.completions.create(model="tiny-f32", prompt=head + [4], max_tokens=2,
                                          stream=True, stream_options={"include_usage": True},
                                          **GREEDY)
            usage = [chunk.usage for chunk in stream if chunk.usage is not None][-1]
            assert 64 <= usage.prompt_tokens_details.cached_tokens <= usage.prompt_tokens
            wait_idle(srv)
            several = c.completions.create(model="tiny-f32", prompt=head + [3], max_tokens=2,
                                           n=3, **GREEDY)
            details = several.usage.prompt_tokens_details
            assert several.usage.prompt_tokens == len(head) + 1
            assert 64 <= details.cached_tokens <= len(head) + 1
    finally:
        srv.shutdown()


def test_chat_streamed_and_not(client):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    r = client.chat.completions.create(model="tiny-f32", messages=messages, max_tokens=10, **GREEDY)
    msg = r.choices[0].message
    assert msg.role == "assistant" and isinstance(msg.content, str)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 10 and r.usage.prompt_tokens > 10
    chunks = list(client.chat.completions.create(model="tiny-f32", messages=messages, max_tokens=10,
                                                 stream=True, **GREEDY,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == msg.content
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == r.usage.total_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == \
        r.choices[0].finish_reason
    # Content as text parts is the same conversation, the parts joined by a line break (as
    # vLLM joins them).
    parts = [messages[0], {"role": "user", "content": [{"type": "text", "text": "h"},
                                                       {"type": "text", "text": "i"}]}]
    r2 = client.chat.completions.create(model="tiny-f32", messages=parts, max_tokens=10, **GREEDY)
    joined = [messages[0], {"role": "user", "content": "h\ni"}]
    r3 = client.chat.completions.create(model="tiny-f32", messages=joined, max_tokens=10,
                                        **GREEDY)
    assert r2.choices[0].message.content == r3.choices[0].message.content
    assert r2.usage.prompt_tokens == r3.usage.prompt_tokens
    # The answer's message goes back as the next turn as it came (refusal: null, and with
    # model_dump also annotations, audio, function_call and tool_calls: null).
    for turn in (msg, msg.model_dump()):
        r4 = client.chat.completions.create(
            model="tiny-f32", messages=[*messages, turn, {"role": "user", "content": "more"}],
            max_tokens=2, stream=True, stream_options={"include_usage": True,
                                                       "include_obfuscation": False})
        assert list(r4)[-1].usage.completion_tokens <= 2
    # The keys OpenAI always sends, null here: system_fingerprint (answer and every chunk) and
    # the message's refusal.
    assert r.system_fingerprint is None and "system_fingerprint" in r.model_fields_set
    assert msg.refusal is None and "refusal" in msg.model_fields_set
    assert all("system_fingerprint" in c.model_fields_set for c in chunks)


def test_usage_on_every_chunk(client):
    """stream_options.continuous_usage_stats (with include_usage) puts the choice's usage so
    far on every chunk, as vLLM does; the last chunk still carries the answer's."""
    messages = [{"role": "user", "content": "count"}]
    for n in (1, 2):
        chunks = list(client.chat.completions.create(
            model="tiny-f32", messages=messages, max_tokens=6, stream=True, n=n, **SEEDED,
            stream_options={"include_usage": True, "continuous_usage_stats": True}))
        *body, last = chunks
        assert last.choices == [] and last.usage.completion_tokens <= 6 * n
        prompt = last.usage.prompt_tokens
        for index in range(n):
            mine = [c for c in body if c.choices[0].index == index]
            assert mine[0].choices[0].delta.role == "assistant"
            assert mine[0].usage.completion_tokens == 0
            counts = [c.usage.completion_tokens for c in mine]
            assert counts == sorted(counts) and counts[-1] >= 1
            assert all(c.usage.prompt_tokens == prompt and c.usage.total_tokens ==
                       prompt + c.usage.completion_tokens for c in mine)
        assert sum(max(c.usage.completion_tokens for c in body if c.choices[0].index == i)
                   for i in range(n)) == last.usage.completion_tokens
    # Without include_usage it asks for nothing (vLLM's reading): no usage anywhere.
    plain = list(client.completions.create(
        model="tiny-f32", prompt="count", max_tokens=3, stream=True,
        stream_options={"continuous_usage_stats": True}))
    assert all(c.usage is None for c in plain)


SEEDED = dict(temperature=0.9, top_p=0.95, seed=1234, presence_penalty=0.3,
              frequency_penalty=0.2)
SEEDED_EXTRA = dict(top_k=40, repetition_penalty=1.1)


def test_seeded_sampling_is_identical_alone_and_under_load(client, reference):
    prompt = _prompts(6, seed=2)[5]
    alone_ids, _, _ = _stream_ids(client, prompt, 30, **SEEDED, extra=dict(SEEDED_EXTRA))
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=1234,
                            presence_penalty=0.3, frequency_penalty=0.2, repetition_penalty=1.1)
    assert alone_ids == alone(reference, prompt, 30, params)
    others = _prompts(12, seed=3)

    def load(i):
        if i == 6:
            return _stream_ids(client, prompt, 30, **SEEDED, extra=dict(SEEDED_EXTRA))[0]
        kw = GREEDY if i % 2 else dict(temperature=1.0, seed=i)
        return _stream_ids(client, others[i], 25, **kw)[0]

    with ThreadPoolExecutor(12) as pool:
        results = list(pool.map(load, range(12)))
    assert results[6] == alone_ids
    unseeded = [client.completions.create(model="tiny-f32", prompt=prompt, max_tokens=30,
                                          temperature=0.9, extra_body={"return_token_ids": True})
                for _ in range(2)]
    assert _ids(unseeded[0].choices[0]) != _ids(unseeded[1].choices[0])


def _spanning_stop(reference, prompts) -> tuple[list[int], list[int], str, str]:
    """A prompt whose greedy output has a two-character stop string across two tokens."""
    for prompt in prompts:
        tokens = alone(reference, prompt, 40)
        detok = Detokenizer([reference.token_bytes(t) for t in range(reference.n_vocab)])
        texts = [detok.add(t) for t in tokens]
        full = "".join(texts)
        at = 0
        for i in range(len(tokens) - 1):
            at += len(texts[i])
            a, b = texts[i], texts[i + 1]
            if not a or not b or "\ufffd" in a + b:
                continue
            stop = a[-1] + b[0]
            if full.find(stop) == at - 1:
                return prompt, tokens[:i + 2], stop, full[:at - 1]
    pytest.fail("no greedy output with a stop string across a token boundary")


def test_stop_string_spanning_tokens_is_cut_exactly(client, reference):
    prompt, upto, stop, expected = _spanning_stop(reference, _prompts(40, seed=4))
    r = client.completions.create(model="tiny-f32", prompt=prompt, max_tokens=40, stop=[stop, "\x01"],
                                  **GREEDY, extra_body={"return_token_ids": True})
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "stop"
    assert _ids(r.choices[0]) == upto  # up to the token that completed the stop string
    chunks = []
    for chunk in client.completions.create(model="tiny-f32", prompt=prompt, max_tokens=40,
                                           stop=stop, stream=True, **GREEDY):
        chunks.append(chunk.choices[0])
    assert "".join(c.text for c in chunks) == expected
    assert chunks[-1].finish_reason == "stop"


def _post(url, path, body=None, raw=None):
    if raw is not None:
        return httpx.post(url + path, content=raw, headers={"content-type": "application/json"})
    return httpx.post(url + path, json=body)


def _long_text_prompt(n):
    return [1] + [5 + i % 300 for i in range(n - 1)]


BAD_INPUTS = [
    ("/v1/completions", None, b"{not json", None),
    ("/v1/completions", None, b"[1, 2]", None),
    # An unknown field is ignored with a warning unless the server is strict:
    # tests/fleet/test_request_fields.py.
    ("/v1/completions", {"prompt": "x", "n": 17}, None, "n"),
    ("/v1/completions", {"prompt": "x", "best_of": 17}, None, "best_of"),
    ("/v1/completions", {"prompt": "x", "n": 3, "best_of": 2}, None, "best_of"),
    ("/v1/completions", {"prompt": "x", "best_of": 2, "stream": True}, None, "best_of"),
    ("/v1/completions", {"prompt": "x", "echo": "yes"}, None, "echo"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, None, "logprobs"),
    ("/v1/completions", {"prompt": "x", "suffix": "tail"}, None, "suffix"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, None, "temperature"),
    ("/v1/completions", {"prompt": "x", "temperature": 3}, None, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 1.5}, None, "top_p"),
    ("/v1/completions", {"prompt": "x", "top_k": -5}, None, "top_k"),
    ("/v1/completions", {"prompt": "x", "seed": "1"}, None, "seed"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, None, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0, "echo": True, "min_tokens": 1}, None,
     "min_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 100000}, None, "max_tokens"),
    ("/v1/completions", {"prompt": _long_text_prompt(LANE_CTX)}, None, "prompt"),
    ("/v1/completions", {"prompt": []}, None, "prompt"),
    ("/v1/completions", {"prompt": [1, 99999]}, None, "prompt"),
    ("/v1/completions", {"prompt": 5}, None, "prompt"),
    ("/v1/completions", {}, None, "prompt"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"x": 1}}, None, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 500}}, None, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "stop": ""}, None, "stop"),
    ("/v1/completions", {"prompt": "x", "stop": [1]}, None, "stop"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, None, "stream"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, None,
     "stream_options"),
    ("/v1/completions", {"prompt": "x", "stream": True,
                         "stream_options": {"continuous_usage_stats": "yes"}}, None,
     "stream_options.continuous_usage_stats"),
    ("/v1/completions", {"prompt": "x", "stream": True,
                         "stream_options": {"include_usage": 1}}, None,
     "stream_options.include_usage"),
    ("/v1/completions", {"prompt": "x", "user": 123}, None, "user"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": "x",
                                            "tool_calls": [{"id": "c"}]}]}, None,
     "messages[0].tool_calls"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "tools": [{"type": "function"}]}, None, "tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "response_format": {"type": "yaml"}}, None,
     "response_format.type"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "top_logprobs": 2}, None, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "echo": True}, None, "echo"),
    ("/v1/chat/completions", {}, None, "messages"),
    ("/v1/chat/completions", {"messages": []}, None, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, None,
     "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, None,
     "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, None, "messages[0].content[0]"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 2000}]}, None,
     "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "max_completion_tokens": 10**6}, None, "max_completion_tokens"),
]


def test_each_bad_input_is_a_400_naming_the_field_and_the_server_keeps_serving(server,
                                                                              client):
    before = metrics(server.url).get('skippy:request_errors_total{status="400"}', 0)
    for path, body, raw, param in BAD_INPUTS:
        r = _post(server.url, path, body, raw)
        assert r.status_code == 400, (body, raw, r.text)
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["param"] == param, (body, err)
        assert err["message"]
    after = metrics(server.url)['skippy:request_errors_total{status="400"}']
    assert after - before == len(BAD_INPUTS)
    ok = client.completions.create(model="tiny-f32", prompt="still here", max_tokens=3, **GREEDY)
    assert ok.choices[0].finish_reason in ("length", "stop")
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny-f32", prompt="x", best_of=2, stream=True)
    assert info.value.body["param"] == "best_of"
    # Both budgets given: max_completion_tokens, which replaces the deprecated max_tokens.
    both = client.chat.completions.create(
        model="tiny-f32", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
        max_completion_tokens=3, extra_body={"ignore_eos": True}, **GREEDY)
    assert both.usage.completion_tokens == 3 and both.choices[0].finish_reason == "length"
    assert is_idle(wait_idle(server), server.host.n_seq_max)


def _busy_stream(url, max_tokens):
    """An open stream that has produced its first token (so its request holds a lane)."""
    cm = httpx.stream("POST", url + "/v1/completions", timeout=60, json={
        "prompt": "busy", "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
        "temperature": 0})
    resp = cm.__enter__()
    assert resp.status_code == 200
    lines = resp.iter_lines()
    while not next(lines).startswith("data: {"):
        pass
    return cm, lines


def test_queue_full_is_a_503_with_retry_after(model_path):
    srv = start_server(model_path, max_active=1, max_waiting=1, ctx_size=4096)
    try:
        running, _ = _busy_stream(srv.url, 4000)
        waiting = httpx.stream("POST", srv.url + "/v1/completions", timeout=60, json={
            "prompt": "next", "max_tokens": 4, "stream": True})
        assert waiting.__enter__().status_code == 200  # queued
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "more", "max_tokens": 4})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "queue_full"
        with openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0) as c:
            with pytest.raises(openai.InternalServerError) as info:
                c.completions.create(model="tiny-f32", prompt="more", max_tokens=4)
        assert info.value.status_code == 503
        running.__exit__(None, None, None)
        waiting.__exit__(None, None, None)
        assert is_idle(wait_idle(srv), 1)
        ok = httpx.post(srv.url + "/v1/completions", json={"prompt": "now", "max_tokens": 2})
        assert ok.status_code == 200
        # More choices than one lane and one waiting place could ever hold: no retry helps.
        for body, param in (({"n": 3}, "n"), ({"prompt": ["a", "b", "c"]}, "prompt")):
            r = httpx.post(srv.url + "/v1/completions",
                           json={"prompt": "now", "max_tokens": 2, **body})
            assert r.status_code == 400 and "retry-after" not in r.headers, r.text
            assert r.json()["error"]["param"] == param
            assert "lanes and waiting places: 2" in r.json()["error"]["message"]
        assert is_idle(wait_idle(srv), 1)
    finally:
        srv.shutdown()


@pytest.fixture(scope="module")
def long_server(model_path):
    """Two lanes of 4096 tokens: a generation lasts long enough to be cut by a disconnect."""
    srv = start_server(model_path, max_active=2, ctx_size=8192)
    yield srv
    srv.shutdown()


def test_a_disconnect_mid_stream_frees_the_lane(long_server):
    srv = long_server
    start = metrics(srv.url)["skippy:generation_tokens_total"]
    cm, lines = _busy_stream(srv.url, 4000)
    for _ in range(4):
        next(lines)
    assert metrics(srv.url)["skippy:num_lanes_in_use"] == 1
    t0 = time.monotonic()
    cm.__exit__(None, None, None)
    while True:
        m = metrics(srv.url)
        if m["skippy:num_lanes_in_use"] == 0 and m["skippy:num_requests_running"] == 0:
            break
        assert time.monotonic() - t0 < 15, m  # (4000 tokens would take far longer)
        time.sleep(0.005)
    assert m["skippy:kv_cache_usage_perc"] == 0
    assert is_idle(wait_idle(srv), 2)
    # The request was cut short, not run to its 4000 tokens.
    assert m["skippy:generation_tokens_total"] - start < 4000
    assert 'skippy:request_success_total{finished_reason="length"}' not in m


def test_vllm_kv_usage_is_over_what_the_lanes_may_hold(long_server):
    """vLLM's gauge counts prefix holders' cells as free (1: the lanes full); skippy's counts
    them in the whole. Both read one snapshot in one scrape."""
    srv = long_server
    host = srv.host
    lanes_cells = host.n_seq_max * host.n_ctx_seq
    assert srv.runner.stats.kv_lane_capacity == lanes_cells < host.n_ctx  # holders beside
    cm, lines = _busy_stream(srv.url, 4000)
    try:
        for _ in range(4):
            next(lines)
        m = metrics(srv.url)
        ours = m["skippy:kv_cache_usage_perc"]
        theirs = next(v for k, v in m.items() if k.startswith("vllm:kv_cache_usage_perc"))
        assert ours > 0
        assert theirs == pytest.approx(ours * host.n_ctx / lanes_cells)
    finally:
        cm.__exit__(None, None, None)
    assert is_idle(wait_idle(srv), 2)


def test_a_dropped_connection_cancels_a_non_streamed_request(long_server):
    srv = long_server
    host, port = srv.url.split("//")[1].rsplit(":", 1)
    body = b'{"prompt": "drop", "max_tokens": 4000, "ignore_eos": true, "temperature": 0}'
    sock = socket.create_connection((host, int(port)))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
                 b"\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    t0 = time.monotonic()
    while metrics(srv.url)["skippy:num_lanes_in_use"] == 0:
        assert time.monotonic() - t0 < 15
        time.sleep(0.002)
    sock.close()
    assert is_idle(wait_idle(srv, timeout_s=15), 2)
    assert 'skippy:request_success_total{finished_reason="length"}' not in metrics(srv.url)


def test_a_failing_iteration_fails_its_requests_and_the_server_goes_on(model_path):
    srv = start_server(model_path, inflight=1)  # its step runs `host.execute` (depth 2:
    # tests/engine/test_engine_depth.py)
    real = srv.host.execute
    failures = []

    def execute(plan):
        if not failures:
            failures.append(len(plan))
            raise RuntimeError("injected runtime failure")
        return real(plan)

    srv.host.execute = execute
    try:
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 5})
        assert r.status_code == 500 and "injected runtime failure" in r.json()["error"]["message"]
        assert srv.runner.crashes == 1
        ok = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 5})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 5
        assert is_idle(wait_idle(srv), srv.host.n_seq_max)
    finally:
        srv.shutdown()


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_a_completion_too_long_for_its_lane_names_the_field_it_came_from(server, field):
    body = {"model": "tiny-f32", "messages": [{"role": "user", "content": "x"}],
            field: 1_000_000}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and err["code"] == "context_length_exceeded", err
    assert err["message"].endswith(f"Please reduce the prompt or '{field}'."), err
