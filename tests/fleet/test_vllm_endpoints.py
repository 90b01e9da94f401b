"""The endpoints and metrics routers call on a vLLM replica, and the KV events a real
server publishes as requests finish (tiny model, loopback)."""
from __future__ import annotations

import re

import httpx
from fleet_support import BLOCK
from vllm_schema import BlockRemoved, BlockStored, Subscriber, vllm_hashes

GREEDY = {"temperature": 0}


def _post(url, path, body):
    r = httpx.post(url + path, json=body, timeout=60)
    assert r.status_code == 200, (path, body, r.text)
    return r.json()


def test_render_answers_the_token_ids_the_prompt_runs_with(replica):
    server, _ = replica
    name = server.context.model_name
    body = {"model": name, "prompt": "render me", "max_tokens": 3, **GREEDY}
    rendered = _post(server.url, "/v1/completions/render", body)
    assert isinstance(rendered, list) and len(rendered) == 1
    req = rendered[0]
    ran = _post(server.url, "/v1/completions", dict(body, return_token_ids=True))
    assert req["token_ids"] == ran["choices"][0]["prompt_token_ids"]
    assert req["request_id"].startswith("cmpl-") and req["model"] == name
    assert req["sampling_params"]["temperature"] == 0 and \
        req["sampling_params"]["max_tokens"] == 3
    chat = {"messages": [{"role": "user", "content": "render a chat"}], "max_tokens": 2}
    rendered_chat = _post(server.url, "/v1/chat/completions/render", chat)
    ran_chat = _post(server.url, "/v1/chat/completions", dict(chat, return_token_ids=True))
    assert rendered_chat["token_ids"] == ran_chat["prompt_token_ids"]
    # A body the server would refuse is refused by render too, naming the field.
    r = httpx.post(server.url + "/v1/completions/render", json={"prompt": "x", "n": 3},
                   timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    # So are a model it does not serve and a request that could never fit a lane.
    r = httpx.post(server.url + "/v1/completions/render", timeout=10,
                   json={"model": "nope", "prompt": [1, 2, 3], "max_tokens": 3})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
    lane = server.context.n_ctx_seq
    r = httpx.post(server.url + "/v1/completions/render", timeout=10,
                   json={"prompt": [1, 2, 3], "max_tokens": lane})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    r = httpx.post(server.url + "/v1/chat/completions/render", timeout=10,
                   json={"messages": [{"role": "user", "content": "word " * lane}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text


def test_tokenize_and_detokenize_round_trip(replica):
    server, _ = replica
    tok = _post(server.url, "/tokenize", {"model": "m", "prompt": "round trip"})
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] > 0
    rendered = _post(server.url, "/v1/completions/render", {"prompt": "round trip"})
    assert tok["tokens"] == rendered[0]["token_ids"]
    text = _post(server.url, "/detokenize", {"tokens": tok["tokens"]})["prompt"]
    assert text.endswith("round trip")
    chat = _post(server.url, "/tokenize", {"messages": [{"role": "user", "content": "x"}]})
    assert chat["tokens"] == _post(server.url, "/v1/chat/completions/render", {
        "messages": [{"role": "user", "content": "x"}]})["token_ids"]
    bad = httpx.post(server.url + "/detokenize", json={"tokens": [10**9]}, timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_models_by_id(replica):
    server, _ = replica
    name = server.context.model_name
    got = httpx.get(f"{server.url}/v1/models/{name}", timeout=10)
    assert got.status_code == 200 and got.json()["id"] == name
    missing = httpx.get(f"{server.url}/v1/models/not-{name}", timeout=10)
    assert missing.status_code == 404 and "not-" in missing.json()["error"]["message"]


def _samples(url):
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        m = re.match(r"^(vllm:[a-z_]+)\{([^}]*)\} (\S+)$", line)
        if m:
            out[m.group(1)] = (m.group(2), float(m.group(3)))
    return out


def test_vllm_metric_names_beside_the_skippy_ones(replica):
    server, _ = replica
    prompt = "a prefix that is long enough to be kept and found again " * 3
    for _ in range(2):
        _post(server.url, "/v1/completions", {"prompt": prompt, "max_tokens": 2, **GREEDY})
    s = _samples(server.url)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total"):
        assert name in s, (name, sorted(s))
        assert f'model_name="{server.context.model_name}"' in s[name][0]
    assert s["vllm:num_requests_running"][1] == 0 and s["vllm:num_requests_waiting"][1] == 0
    queries, hits = s["vllm:prefix_cache_queries_total"][1], s["vllm:prefix_cache_hits_total"][1]
    assert 0 < hits < queries  # the second run restored the first one's prompt


def test_a_finished_request_publishes_its_blocks_and_a_restore_only_the_new_ones(replica):
    server, events = replica
    sub = Subscriber(events)
    try:
        sub.joined()
        base = "the shared system prompt of a tenant, long enough for several blocks. " * 2
        first = _post(server.url, "/v1/completions", {
            "prompt": base, "max_tokens": 4, "ignore_eos": True, "return_token_ids": True,
            **GREEDY})
        key = first["choices"][0]["prompt_token_ids"] + first["choices"][0]["token_ids"]

        def has_key(got):
            return any(isinstance(e, BlockStored) and e.token_ids[:BLOCK] == key[:BLOCK]
                       for _, e in got)

        got = sub.events_until(has_key)
        ev = [e for _, e in got if isinstance(e, BlockStored)][-1]
        # The holder keeps the lane's KV: prompt and generated tokens but the last one (its
        # KV is never computed), announced in full blocks.
        kept = key[:-1]
        n = len(kept) // BLOCK
        assert ev.block_hashes == vllm_hashes(kept, BLOCK) and len(ev.block_hashes) == n
        assert ev.token_ids == kept[:n * BLOCK] and ev.parent_block_hash is None
        second = _post(server.url, "/v1/completions", {
            "prompt": base + "and a question after it", "max_tokens": 2,
            "return_token_ids": True, **GREEDY})
        key2 = second["choices"][0]["prompt_token_ids"] + second["choices"][0]["token_ids"]
        got = sub.events_until(lambda g: any(isinstance(e, BlockStored) for _, e in g))
        ev2 = [e for _, e in got if isinstance(e, BlockStored)][-1]
        chain2 = vllm_hashes(key2[:-1], BLOCK)
        shared = next(i for i, (a, b) in enumerate(zip(chain2 + [None], vllm_hashes(
            kept, BLOCK) + [None])) if a != b)
        assert shared >= 1
        assert ev2.block_hashes == chain2[shared:]
        assert ev2.parent_block_hash == chain2[shared - 1]
    finally:
        sub.close()


def test_a_running_requests_prompt_blocks_are_announced_before_it_ends(replica):
    server, events = replica
    sub = Subscriber(events)
    try:
        sub.joined()
        prompt = "a prompt whose blocks the router should learn of while it still runs. " * 2
        ids = _post(server.url, "/tokenize", {"prompt": prompt})["tokens"]
        want = vllm_hashes(ids, BLOCK)
        assert len(want) >= 2
        body = {"prompt": prompt, "max_tokens": 200, "ignore_eos": True, "stream": True,
                **GREEDY}
        with httpx.stream("POST", server.url + "/v1/completions", json=body,
                          timeout=60) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert "[DONE]" not in first
            got = sub.events_until(lambda g: any(
                isinstance(e, BlockStored) and set(want) <= set(e.block_hashes)
                for _, e in g))
            stored = [e for _, e in got if isinstance(e, BlockStored)
                      and set(want) <= set(e.block_hashes)][0]
            assert stored.block_hashes == want  # the prompt's full blocks, no more yet
            assert stored.token_ids == ids[:len(want) * BLOCK]
            rest = list(lines)
        assert rest[-1] == "data: [DONE]" or "data: [DONE]" in rest
        # It ended and its holder was kept: its blocks past the prompt are announced, and
        # none of the prompt's is withdrawn.
        got = sub.events_until(lambda g: any(isinstance(e, BlockStored) for _, e in g))
        later = [e for _, e in got if isinstance(e, BlockStored)][-1]
        assert later.parent_block_hash == want[-1]
        assert not any(isinstance(e, BlockRemoved) and set(want) & set(e.block_hashes)
                       for _, e in got)
    finally:
        sub.close()
