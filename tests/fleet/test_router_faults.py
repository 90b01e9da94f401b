"""A replica killed under load behind vllm-router: its streams end with an error, the fleet
keeps serving, and the replica restarted clears what it had advertised."""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from fleet_support import Replica, Router, router_binary
from vllm_schema import AllBlocksCleared, BlockStored, Subscriber, replay

if router_binary() is None:
    pytest.skip("vllm-router is not installed (pip install vllm-router)",
                allow_module_level=True)
pytest.importorskip("llama_cpp")

GREEDY = {"temperature": 0}


def _complete(url, prompt, max_tokens=2):
    r = httpx.post(url + "/v1/completions", json={
        "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, **GREEDY}, timeout=60)
    return r


def _stream(url, prompt, out, started):
    """Stream a long completion; record whether it ended properly ([DONE]) or not."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 400, "ignore_eos": True,
            "stream": True, **GREEDY}
    done = False
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    started.set()
                    data = line[6:]
                    if data == "[DONE]":
                        done = True
                    elif "error" in json.loads(data):
                        break
    except httpx.HTTPError:
        pass
    out.append(done)


def test_a_killed_replica_drops_out_and_comes_back_cleared(model_path, tmp_path):
    a = b = router = None
    try:
        # Holders enough that nothing here is evicted but by the kill.
        a = Replica(model_path, tmp_path, "a", extra=("--prefix-holders", "8"))
        b = Replica(model_path, tmp_path, "b", extra=("--prefix-holders", "8"))
        router = Router([a, b], "kv_aware", tmp_path, extra=(
            "--health-check-interval-secs", "1", "--health-failure-threshold", "1"))
        sub_a = Subscriber(a.events)
        time.sleep(1.0)  # subscribed before anything is published
        # A holds a long prefix, B only its start: a request with the long prefix goes to A.
        stem = "the restart tenant's system prompt, answer exactly. " * 2
        longer = stem + "with more rules that only one replica has seen. " * 2
        assert _complete(a.url, longer + "first").status_code == 200
        assert _complete(b.url, stem + "first").status_code == 200
        sub_a.events_until(lambda got: any(isinstance(e, BlockStored) for _, e in got))
        time.sleep(2.0)  # the router's subscriber has had the batch too (a loaded machine)
        before = a.served()
        assert _complete(router.url, longer + "then?").status_code == 200
        assert a.served() == before + 1

        # Streams running on A when it is killed end without [DONE].
        ends: list[bool] = []
        started = threading.Event()
        t = threading.Thread(target=_stream, args=(a.url, "a long answer", ends, started))
        t.start()
        assert started.wait(30)
        a.kill()
        t.join(60)
        assert ends == [False]
        # The fleet keeps serving through the router (B answers).
        for i in range(4):
            r = _complete(router.url, f"after the kill {i}")
            assert r.status_code == 200, r.text

        # A comes back on the same ports: its first batch clears what it had advertised (read
        # back through the replay socket: a live subscriber may reconnect after it was sent)...
        a.start()
        end = time.monotonic() + 10
        while not (held := replay(a.replay, 0)) and time.monotonic() < end:
            time.sleep(0.1)  # the first batch waits for subscribers to reconnect
        seq, batch = held[0]
        assert seq == 0 and isinstance(batch.events[0], AllBlocksCleared)
        time.sleep(3.0)  # the router's health check (every second) has seen A healthy again
        # ...so the long prefix is now credited to B only (A's blocks are gone).
        before = [a.served(), b.served()]
        assert _complete(router.url, longer + "and now?").status_code == 200
        assert [a.served(), b.served()] == [before[0], before[1] + 1]
        sub_a.close()
    finally:
        for p in (router, a, b):
            if p is not None:
                p.close()


def test_a_router_started_after_its_replicas_learns_what_they_hold(model_path, tmp_path):
    """The router subscribes after the replicas have served: each publishes its whole state
    for the new subscriber, so prefixes held before the router started are credited."""
    a = b = router = None
    try:
        a = Replica(model_path, tmp_path, "a", extra=("--prefix-holders", "8"))
        b = Replica(model_path, tmp_path, "b", extra=("--prefix-holders", "8"))
        # Each stem's long form on one replica, its start on the other: the long form's
        # request belongs where the long form is held.
        owners = "aaba"
        stems = [f"late router tenant {k}, a system prompt to answer exactly. " * 2
                 for k in range(len(owners))]
        more = "with more rules that only one replica has seen. " * 2
        for stem, owner in zip(stems, owners):
            long_at, short_at = (a, b) if owner == "a" else (b, a)
            assert _complete(long_at.url, stem + more + "first").status_code == 200
            assert _complete(short_at.url, stem + "first").status_code == 200
        router = Router([a, b], "kv_aware", tmp_path)
        time.sleep(3.0)  # subscribed and given the replicas' state (a loaded machine)
        went = ""
        for stem in stems:
            before = [a.served(), b.served()]
            assert _complete(router.url, stem + more + "then?").status_code == 200
            went += "a" if a.served() > before[0] else "b"
        assert went == owners
    finally:
        for p in (router, a, b):
            if p is not None:
                p.close()
