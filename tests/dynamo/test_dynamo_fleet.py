"""Two `dynamo-worker` replicas behind Dynamo's frontend (KV router, file discovery, TCP
requests, ZeroMQ events) on loopback answer the openai client with the same greedy tokens as
a replica asked directly, and the KV router sends a request to the replica that holds its
prefix. Skipped unless Dynamo (ai-dynamo 1.6) imports; about 40 s."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

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
        with open(root / log, "wb") as out:
            # Not from the checkout's root: the installed package, not its source tree.
            return subprocess.Popen([sys.executable, "-m", *args], env=env,
                                    stdout=subprocess.DEVNULL, stderr=out,
                                    cwd=os.path.dirname(sys.executable))

    procs = [spawn(["skippy_scheduler.cli", "dynamo-worker", "-m", model, "--served-model-name",
                    "tiny", "--max-active", "2", "-c", "1024", "-t", "1"], f"worker{i}.log")
             for i in range(2)]
    procs.append(spawn(["dynamo.frontend", "--discovery-backend", "file", "--request-plane",
                        "tcp", "--event-plane", "zmq", "--router-mode", "kv", "--http-host",
                        "127.0.0.1", "--http-port", str(port)], "frontend.log"))
    direct = start_server(model, max_active=2, ctx_size=1024, model_name="tiny")
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:  # both replicas registered: two instances answer before the deadline
            try:
                if httpx.get(f"{base}/v1/models", timeout=2).json()["data"] and \
                        len(list((root / "kv").rglob("*generate*"))) >= 2:
                    break
            except (httpx.HTTPError, KeyError, ValueError):
                pass
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                logs = "\n".join((root / n).read_text(errors="replace")[-2000:]
                                 for n in ("worker0.log", "worker1.log", "frontend.log"))
                pytest.fail(f"the Dynamo fleet did not come up:\n{logs}")
            time.sleep(0.5)
        yield base, direct.url, root
    finally:
        direct.shutdown()
        for p in procs:
            p.send_signal(signal.SIGINT)
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()


def test_greedy_tokens_match_a_replica_asked_directly(fleet):
    dynamo_url, direct_url, _ = fleet
    with openai.OpenAI(base_url=f"{dynamo_url}/v1", api_key="none") as via, \
            openai.OpenAI(base_url=f"{direct_url}/v1", api_key="none") as alone:
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
    with openai.OpenAI(base_url=f"{fleet[0]}/v1", api_key="none") as via, \
            pytest.raises(openai.BadRequestError, match="several choices"):
        via.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, n=2)


def _instances(root) -> list[int]:
    """The replicas' Dynamo instance ids, from the file discovery's records."""
    ids = []
    for path in (root / "kv" / "v1" / "instances").iterdir():
        if "generate" in path.name:
            ids.append(int(json.loads(path.read_text())["instance_id"]))
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
    dynamo_url, _, root = fleet
    replicas = _instances(root)
    assert len(replicas) == 2
    with openai.OpenAI(base_url=f"{dynamo_url}/v1", api_key="none") as via:
        for prefix, replica in zip(PREFIXES, replicas):
            assert _routed(via, prefix, pin=replica) == replica
        time.sleep(1.0)  # the stored blocks reach the router
        for i in range(3):
            for prefix, replica in zip(PREFIXES, replicas):
                assert _routed(via, f"{prefix} and then {i}") == replica, \
                    f"a request extending prefix {PREFIXES.index(prefix)} went elsewhere"
