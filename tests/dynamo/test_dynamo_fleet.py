"""Two `dynamo-worker` replicas behind Dynamo's frontend (KV router, file discovery, TCP
requests, ZeroMQ events) on loopback answer the openai client with the same greedy tokens as
a replica asked directly, the KV router sends a request to the replica that holds its prefix,
and a replica killed mid-stream ends that stream with an error while the other serves the rest,
then rejoins when restarted (requests and routing events both). Skipped unless Dynamo
(ai-dynamo 1.6) imports; about 20 s."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

pytest.importorskip("dynamo.frontend")
pytest.importorskip("dynamo.common.backend")
pytest.importorskip("llama_cpp")
pytest.importorskip("tokenizers")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

PROMPT = "hello there the"
# Two long prefixes (about 190 tokens, 11 blocks of 16, on the tiny model) for the routing test.
PREFIXES = (" ".join(["alpha beta gamma delta"] * 10), " ".join(["one two three four"] * 10))
MESSAGES = [{"role": "user", "content": "hi there"}]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Fleet:
    url: str  # the frontend's
    direct_url: str  # a replica of the same model asked directly
    root: Path  # the file discovery's folder is root / "kv"
    workers: list  # the replicas' processes, in start order
    ids: list  # their Dynamo instance ids, in the same order
    start_worker: Callable[[int], subprocess.Popen]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    from serve_support import start_server

    from skippy_scheduler.hosts.tiny_model import write_tiny_llama

    root = tmp_path_factory.mktemp("dynamo")
    model = write_tiny_llama(root / "tiny.gguf")
    env = dict(os.environ, DYN_FILE_KV=str(root / "kv"), SKIPPY_SCHEDULER_CACHE=str(root),
               DYN_SELF_HOST_METADATA="0", DYN_LOG="warn")
    port = _port()

    def spawn(args: list[str], log: str) -> subprocess.Popen:
        with open(root / log, "ab") as out:
            # Not from the checkout's root: the installed package, not its source tree.
            return subprocess.Popen([sys.executable, "-m", *args], env=env,
                                    stdout=subprocess.DEVNULL, stderr=out,
                                    cwd=os.path.dirname(sys.executable))

    def start_worker(i: int) -> subprocess.Popen:
        return spawn(["skippy_scheduler.cli", "dynamo-worker", "-m", model,
                      "--served-model-name", "tiny", "--max-active", "2", "-c", "4096", "-t",
                      "1"], f"worker{i}.log")

    direct = start_server(model, max_active=2, ctx_size=1024, model_name="tiny")
    base = f"http://127.0.0.1:{port}"
    workers: list[subprocess.Popen] = []
    ids: list[int] = []
    frontend = None
    try:
        # One replica at a time, so each Dynamo instance id is known to be its process's.
        for i in range(2):
            workers.append(start_worker(i))
            _wait_for(lambda: len(_instances(root)) > i or workers[i].poll() is not None,
                      f"replica {i} did not register", root, timeout=120)
            if workers[i].poll() is not None:
                pytest.fail(f"replica {i} exited:\n{_logs(root)}")
            (new,) = set(_instances(root)) - set(ids)
            ids.append(new)
        frontend = spawn(["dynamo.frontend", "--discovery-backend", "file", "--request-plane",
                          "tcp", "--event-plane", "zmq", "--router-mode", "kv", "--http-host",
                          "127.0.0.1", "--http-port", str(port)], "frontend.log")
        _wait_for(lambda: _models(base) or frontend.poll() is not None,
                  "the frontend did not come up", root, timeout=120)
        if any(p.poll() is not None for p in [*workers, frontend]):
            pytest.fail(f"the Dynamo fleet did not come up:\n{_logs(root)}")
        yield Fleet(base, direct.url, root, workers, ids, start_worker)
    finally:
        direct.shutdown()
        # A restarted replica replaced its killed process in `workers`.
        procs = [p for p in [*workers, frontend] if p is not None]
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()


def _models(base: str) -> bool:
    try:
        return bool(httpx.get(f"{base}/v1/models", timeout=2).json()["data"])
    except (httpx.HTTPError, KeyError, ValueError):
        return False


def _logs(root: Path) -> str:
    return "\n".join(p.read_text(errors="replace")[-2000:] for p in sorted(root.glob("*.log")))


def test_greedy_tokens_match_a_replica_asked_directly(fleet):
    with openai.OpenAI(base_url=f"{fleet.url}/v1", api_key="none") as via, \
            openai.OpenAI(base_url=f"{fleet.direct_url}/v1", api_key="none") as alone:
        _compare(via, alone)


def _compare(via, alone):
    for _ in range(3):  # several requests: both replicas answer some
        d = via.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0,
                                   extra_body={"nvext": {"extra_fields":
                                                         ["completion_token_ids"]}})
        a = alone.completions.create(model="tiny", prompt=PROMPT, max_tokens=8,
                                     temperature=0, extra_body={"return_token_ids": True})
        assert d.model_extra["nvext"]["completion_token_ids"] == \
            a.choices[0].model_extra["token_ids"]
        assert d.choices[0].text == a.choices[0].text
        assert d.usage.prompt_tokens == a.usage.prompt_tokens  # BOS lined up
    dc = via.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6,
                                     temperature=0)
    ac = alone.chat.completions.create(model="tiny", messages=MESSAGES,
                                       max_tokens=6, temperature=0)
    assert dc.choices[0].message.content == ac.choices[0].message.content
    assert dc.usage.prompt_tokens == ac.usage.prompt_tokens  # same template, same BOS


def test_what_has_no_counterpart_is_a_400_with_the_reason(fleet):
    with openai.OpenAI(base_url=f"{fleet.url}/v1", api_key="none") as via, \
            pytest.raises(openai.BadRequestError, match="several choices"):
        via.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, n=2)


def _instances(root: Path) -> list[int]:
    """The replicas' Dynamo instance ids, from the file discovery's records."""
    folder = root / "kv" / "v1" / "instances"
    ids = []
    for path in folder.iterdir() if folder.is_dir() else ():
        if "generate" in path.name:
            try:
                ids.append(int(json.loads(path.read_text())["instance_id"]))
            except (OSError, ValueError, KeyError):
                continue  # a record being written or removed
    return sorted(ids)


def _routed(client, prompt: str, pin=None) -> int:
    nvext = {"extra_fields": ["worker_id"]}
    if pin is not None:
        nvext["backend_instance_id"] = pin
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0,
                                  extra_body={"nvext": nvext})
    return int(r.model_extra["nvext"]["worker_id"]["decode_worker_id"])


def test_kv_router_sends_a_prefix_to_the_replica_that_holds_it(fleet):
    """Each replica warms one long prefix (pinned there); then requests extending either
    prefix, interleaved, each go to the replica that holds it: the router's block hashes of
    the frontend's ids (no BOS) match the blocks the workers announce (BOS left out)."""
    replicas = _instances(fleet.root)
    assert len(replicas) == 2
    with openai.OpenAI(base_url=f"{fleet.url}/v1", api_key="none") as via:
        _prefixes_follow(via, PREFIXES, replicas)


def _prefixes_follow(via, prefixes, replicas: list[int]) -> None:
    """Warm prefixes[i] on replicas[i] (pinned), then check that unpinned requests extending
    each go to the replica that holds it."""
    for prefix, replica in zip(prefixes, replicas):
        assert _routed(via, prefix, pin=replica) == replica
    time.sleep(1.0)  # the stored blocks reach the router
    for i in range(3):
        for k, (prefix, replica) in enumerate(zip(prefixes, replicas)):
            assert _routed(via, f"{prefix} and then {i}") == replica, \
                f"a request extending prefix {k} went elsewhere"


def _wait_for(predicate, what: str, root: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} within {timeout:.0f} s:\n{_logs(root)}")
        time.sleep(0.25)


def test_a_killed_replica_is_routed_around_and_rejoins_when_restarted(fleet):
    """Last in this file: it kills a replica. Its request ends with an error; every later
    request is answered by the other replica; restarted, the replica registers again, takes
    requests and its stored prefixes pull requests to it."""
    first, second = fleet.ids
    with openai.OpenAI(base_url=f"{fleet.url}/v1", api_key="none", max_retries=0) as via:
        # The replica is stopped, then sent a request, then killed: that request was in
        # flight on it when it died (deterministic, unlike racing a fast model's stream).
        victim = fleet.workers[1]
        victim.send_signal(signal.SIGSTOP)
        outcome: list = []

        def in_flight() -> None:
            try:
                outcome.append(_routed(via, PROMPT, pin=second))
            except (openai.APIError, httpx.HTTPError) as exc:
                outcome.append(exc)

        sender = threading.Thread(target=in_flight)
        sender.start()
        time.sleep(1.0)
        victim.send_signal(signal.SIGKILL)
        victim.wait(10)
        sender.join(60)
        assert not sender.is_alive(), "the in-flight request did not end"
        assert isinstance(outcome[0], Exception), f"it was answered: {outcome}"
        _wait_for(lambda: second not in _instances(fleet.root),
                  "the killed replica's registration did not go", fleet.root)
        for i in range(4):  # nothing else is lost: the other replica answers all
            assert _routed(via, f"{PROMPT} {i}") == first
        fleet.workers[1] = fleet.start_worker(1)
        fleet.ids[1] = -1
        _wait_for(lambda: len(_instances(fleet.root)) == 2,
                  "the restarted replica did not register", fleet.root, timeout=120)
        (rejoined,) = set(_instances(fleet.root)) - {first}
        assert _routed(via, PROMPT, pin=rejoined) == rejoined
        time.sleep(1.0)  # the router's event subscription to the new replica
        # Fresh prefixes: the first replica still holds PREFIXES from the routing test.
        _prefixes_follow(via, [p.replace(" ", " x ", 3) for p in PREFIXES], [first, rejoined])
