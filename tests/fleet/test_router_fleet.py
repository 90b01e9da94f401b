"""Two replicas (`skippy-scheduler serve` subprocesses, tiny model) behind the real
`vllm-router` binary on loopback: greedy outputs through the router equal each prompt run
alone, and the kv_aware policy sends a request to the replica whose KV events announced its
prefix."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from fleet_support import BLOCK, LANE_CTX, Replica, Router, router_binary
from vllm_schema import BlockStored, Subscriber

if router_binary() is None:
    pytest.skip("vllm-router is not installed (pip install vllm-router)",
                allow_module_level=True)
pytest.importorskip("llama_cpp")

GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def fleet(model_path, tmp_path_factory):
    logs = tmp_path_factory.mktemp("fleet-logs")
    replicas = []
    router = None
    try:
        replicas = [Replica(model_path, logs, "a"), Replica(model_path, logs, "b")]
        router = Router(replicas, "kv_aware", logs)
        yield replicas, router
    finally:
        if router is not None:
            router.close()
        for r in replicas:
            r.close()


@pytest.fixture(scope="module")
def reference(model_path):
    from skippy_scheduler.hosts.llama import LlamaHost

    with LlamaHost(model_path, n_ctx=LANE_CTX, n_seq_max=1, n_threads=1) as host:
        yield host


def _complete(url, prompt, max_tokens, **extra):
    # NOTE: no return_token_ids through the router: with it in the body, vllm-router 0.1.17's
    # kv_aware policy credits no cached prefix to any replica (seen in its decision log).
    r = httpx.post(url + "/v1/completions", json={
        "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, **GREEDY, **extra},
        timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _tokens(replica, prompt):
    r = httpx.post(replica.url + "/tokenize", json={"prompt": prompt}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def _announced(sub, tokens, timeout_s=15.0):
    """Wait until `sub` sees a BlockStored whose blocks start `tokens`' first block."""
    sub.events_until(lambda got: any(
        isinstance(e, BlockStored) and e.parent_block_hash is None
        and e.token_ids[:BLOCK] == tokens[:BLOCK] for _, e in got), timeout_s)


def _prefix(tag: str) -> str:
    """A shared prefix whose first block is the tag's own."""
    return f"{tag} tenant's system prompt: answer briefly and exactly. " * 3


def _alone_text(reference, tokens, max_tokens):
    out = reference.generate_alone(tokens, max_tokens)
    if reference.is_eog(out[-1]):
        out = out[:-1]
    return b"".join(reference.token_bytes(t) for t in out).decode("utf-8", "replace")


def test_outputs_through_the_router_equal_each_prompt_run_alone(fleet, reference):
    replicas, router = fleet
    prompts = [_prefix(t) + q for t in ("north", "south") for q in ("why?", "how?", "when?")]
    # Two waves: the second one's prefixes are resident somewhere, and the router knows where.
    for wave in (prompts[::3], prompts):
        with ThreadPoolExecutor(len(wave)) as pool:
            outs = list(pool.map(lambda p: _complete(router.url, p, 8), wave))
        for prompt, out in zip(wave, outs):
            alone = _alone_text(reference, _tokens(replicas[0], prompt), 8)
            assert out["choices"][0]["text"] == alone, prompt
    hits = sum(r.restored() for r in replicas)
    assert hits > 0  # some of the second wave ran on restored prefixes


def test_kv_aware_routing_follows_the_events(fleet):
    replicas, router = fleet
    subs = [Subscriber(r.events) for r in replicas]
    try:
        time.sleep(1.0)  # the subscriptions are up before anything is published
        for owner, tag in ((1, "east"), (0, "west"), (1, "up")):
            # The owner learns the prefix from a request the router never saw: only the
            # owner's KV events can tell the router where it is.
            _complete(replicas[owner].url, _prefix(tag) + "first", 2)
            _announced(subs[owner], _tokens(replicas[owner], _prefix(tag) + "first"))
            time.sleep(2.0)  # the router's subscriber has had the batch too (a loaded machine)
            before = [r.served() for r in replicas]
            out = _complete(router.url, _prefix(tag) + "and then?", 4)
            after = [r.served() for r in replicas]
            assert [b - a for a, b in zip(before, after)] == [
                1 if i == owner else 0 for i in range(len(replicas))], (tag, before, after)
            assert out["usage"]["prompt_tokens"] > 2 * BLOCK
    finally:
        for s in subs:
            s.close()


@pytest.mark.parametrize("policy", ["round_robin", "cache_aware"])
def test_the_routers_other_policies_forward_every_kind_of_request(fleet, tmp_path, policy):
    replicas, _ = fleet
    router = Router(replicas, policy, tmp_path)
    try:
        out = _complete(router.url, _prefix("other") + "plain", 3)
        assert out["choices"][0]["finish_reason"] in ("length", "stop")
        chat = httpx.post(router.url + "/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
            **GREEDY}, timeout=60)
        assert chat.status_code == 200, chat.text
        with httpx.stream("POST", router.url + "/v1/completions", json={
                "model": "tiny", "prompt": "streamed", "max_tokens": 3, "stream": True,
                **GREEDY}, timeout=60) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert r.status_code == 200 and lines[-1] == "data: [DONE]"
    finally:
        router.close()
