"""A CI-sized soak: a few hundred requests with random disconnects and bad requests, then
nothing is left behind (no lane, KV cell, sampler, subscription or waiting entry)."""
from __future__ import annotations

import asyncio
import random
import time

import httpx
from serve_support import ON_DEVICE, is_idle, metrics, start_server, wait_idle

REQUESTS = 300
CONCURRENCY = 24


async def _one(client: httpx.AsyncClient, rng: random.Random, counts: dict) -> None:
    kind = rng.random()
    body = {"prompt": [1] + [rng.randrange(3, 384) for _ in range(rng.randrange(1, 120))],
            "max_tokens": rng.randrange(1, 40), "temperature": rng.choice([0, 0.8]),
            "seed": rng.randrange(100), "ignore_eos": rng.random() < 0.5}
    if rng.random() < 0.2:
        body["stop"] = [rng.choice(["a", "e", "th", "\n"])]
    if kind < 0.1:  # malformed
        r = await client.post("/v1/completions", content=b'{"prompt": [1, 2', headers={
            "content-type": "application/json"})
        assert r.status_code == 400
        counts["bad"] += 1
    elif kind < 0.2:  # a value out of range
        r = await client.post("/v1/completions", json=dict(body, top_p=7))
        assert r.status_code == 400 and r.json()["error"]["param"] == "top_p"
        counts["bad"] += 1
    elif kind < 0.45:  # a stream the client abandons after a few chunks
        async with client.stream("POST", "/v1/completions",
                                 json=dict(body, stream=True, max_tokens=300,
                                           ignore_eos=True)) as r:
            assert r.status_code in (200, 503)
            keep = rng.randrange(0, 6)
            async for line in r.aiter_lines():
                if keep == 0:
                    break
                keep -= line.startswith("data: ")
        counts["dropped"] += 1
    elif kind < 0.7:
        r = await client.post("/v1/completions", json=dict(body, stream=False))
        assert r.status_code in (200, 503), r.text
        if r.status_code == 200:
            assert r.json()["choices"][0]["finish_reason"] in ("length", "stop")
        counts["whole" if r.status_code == 200 else "busy"] += 1
    else:
        chat = {"messages": [{"role": "user", "content": "say " * rng.randrange(1, 20)}],
                "max_tokens": body["max_tokens"], "stream": True}
        async with client.stream("POST", "/v1/chat/completions", json=chat) as r:
            assert r.status_code in (200, 503)
            lines = [line async for line in r.aiter_lines() if line]
        if r.status_code == 200:
            assert lines[-1] == "data: [DONE]"
        counts["chat"] += 1


async def _soak(url: str, seed: int) -> dict:
    rng = random.Random(seed)
    counts = {"bad": 0, "dropped": 0, "whole": 0, "busy": 0, "chat": 0}
    sem = asyncio.Semaphore(CONCURRENCY)
    limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=CONCURRENCY)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
        async def guarded(i: int) -> None:
            async with sem:
                await _one(client, random.Random(rng.random()), counts)

        await asyncio.gather(*(guarded(i) for i in range(REQUESTS)))
    return counts


def test_soak_leaves_nothing_behind(model_path):
    srv = start_server(model_path, max_active=4, max_waiting=8, ctx_size=4 * 512)
    try:
        t0 = time.monotonic()
        counts = asyncio.run(_soak(srv.url, seed=1))
        assert time.monotonic() - t0 < 120
        assert counts["bad"] > 20 and counts["dropped"] > 40 and counts["chat"] > 40, counts
        # (On the RPC device of SKIPPY_SERVE_DEVICE a step is slower: more of them are busy.)
        assert counts["whole"] > (0 if ON_DEVICE else 10), counts
        assert counts["whole"] + counts["busy"] > 40, counts
        state = wait_idle(srv, timeout_s=10)
        assert is_idle(state, 4), state
        m = metrics(srv.url)
        assert m["skippy:num_requests_running"] == 0 and m["skippy:num_requests_waiting"] == 0
        assert m["skippy:num_lanes_in_use"] == 0 and m["skippy:kv_cache_usage_perc"] == 0
        assert srv.runner.crashes == 0
        # Still serving.
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "end", "max_tokens": 3})
        assert r.status_code == 200
    finally:
        srv.shutdown()
