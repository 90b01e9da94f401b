"""Whether every request gets the tokens it gets alone, under a mixed load that batches,
preempts and restores it.

    python bench/alone_vs_batched.py [--model M.gguf] [--seconds 90] [--workers 6] \\
        [--server-args='-np 8'] [--python PY] [--json out.jsonl]

It starts `skippy-scheduler serve` (with PY: another checkout's install; default: this
Python's) on a free loopback port, with the tiny random-weight model unless `--model` names
one, and drives it for `--seconds` with `--workers` client threads, each sending completions
one after another, drawn from its own seeded stream: prompts of 5-120 token ids, 20-120 output
tokens with `ignore_eos`, `n` of 1-3, priorities 0-9 (higher ones preempt lower ones),
greedy (40 %), seeded at temperature 0.9 (30 %) or seeded with penalties (30 %), streamed (60
%) or not, and one in five cut off by its client partway (its sequence cancelled). Prompts
repeat prefixes only by chance, so with prefix reuse on (the default) the restores come from
the repeats of a request and from the n choices.

Then every completed request is sent again, alone, one after another, and its choices' token
ids are compared with the ones it got under load; the server must be idle (no running or
waiting request, no lane, no KV) by then. Prints the requests completed, the preemptions and
cancellations counted by /metrics, and the mismatches (`--mismatches FILE` writes each as a
JSON line: body, tokens under load, tokens alone). The run's seed (`--seed`) draws the same
requests in the same order; which of them meet in a batch depends on timing.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import socket
import sys
import tempfile
import threading
import time
from typing import Any, Optional

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from skippy_bench.servers import Served  # noqa: E402


def _metrics(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def _request(rng: random.Random, model: str) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "prompt": [1] + [rng.randrange(3, 380) for _ in range(rng.randrange(5, 120))],
        "max_tokens": rng.randrange(20, 120), "ignore_eos": True, "return_token_ids": True,
        "priority": rng.choice([0, 0, 1, 2, 5, 9]), "n": rng.choice([1, 1, 1, 2, 3])}
    kind = rng.random()
    if kind < 0.4:
        body["temperature"] = 0
    elif kind < 0.7:
        body.update(temperature=0.9, seed=rng.randrange(10**6))
    else:
        body.update(temperature=0.7, seed=rng.randrange(10**6), repetition_penalty=1.2,
                    presence_penalty=0.3)
    return body


def _streamed(url: str, body: dict[str, Any], cut_after: Optional[int]) -> Any:
    """{choice index: token ids} and the usage's completion tokens; None when cut off."""
    per: dict[int, list[int]] = {}
    usage = None
    body = dict(body, stream=True, stream_options={"include_usage": True})
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"error event: {event['error']}")
            if event.get("usage"):
                usage = event["usage"]["completion_tokens"]
            for choice in event["choices"]:
                per.setdefault(choice["index"], []).extend(choice.get("token_ids") or [])
            if cut_after is not None and sum(map(len, per.values())) >= cut_after:
                return None
    return {k: per[k] for k in sorted(per)}, usage


def _plain(url: str, port: int, body: dict[str, Any], cut_after_s: Optional[float]) -> Any:
    if cut_after_s is not None:  # the body sent, the connection closed before the answer
        data = json.dumps(body).encode()
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                      b"application/json\r\nContent-Length: %d\r\n\r\n" % len(data) + data)
            time.sleep(cut_after_s)
        return None
    r = httpx.post(url + "/v1/completions", json=body, timeout=300)
    if r.status_code != 200:
        raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")
    answer = r.json()
    return ({c["index"]: c["token_ids"] for c in answer["choices"]},
            answer["usage"]["completion_tokens"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--model", help="GGUF model (default: the tiny random-weight model)")
    p.add_argument("--seconds", type=float, default=90, help="the load's length (default 90)")
    p.add_argument("--workers", type=int, default=6, help="client threads (default 6)")
    p.add_argument("--seed", type=int, default=0, help="the requests' seed (default 0)")
    p.add_argument("--server-args", default="", help="more `serve` flags, one string")
    p.add_argument("--python", default=sys.executable,
                   help="the Python whose skippy-scheduler serves (default: this one)")
    p.add_argument("--label", default="", help="a name for this run in the JSON line")
    p.add_argument("--json", help="append the figures as one JSON line to this file")
    p.add_argument("--mismatches", help="write each mismatch as a JSON line to this file")
    args = p.parse_args(argv)

    logs = tempfile.mkdtemp(prefix="alone-vs-batched-")
    cmd = [args.python, "-m", "skippy_scheduler.cli", "serve", "--host", "127.0.0.1",
           "-t", "1", *(["-m", os.path.abspath(args.model)] if args.model else []),
           *args.server_args.split()]
    server = Served(cmd, logs, "serve", timeout_s=120)
    url = server.url
    try:
        model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        done: list[tuple[dict[str, Any], Any]] = []
        errors: list[str] = []
        lock = threading.Lock()
        end = time.monotonic() + args.seconds

        def worker(k: int) -> None:
            rng = random.Random(args.seed * 1000 + k)
            while time.monotonic() < end:
                body = _request(rng, model)
                streamed, cut = rng.random() < 0.6, rng.random() < 0.2
                try:
                    if streamed:
                        got = _streamed(url, body, rng.randrange(1, 60) if cut else None)
                    else:
                        got = _plain(url, server.port, body,
                                     rng.uniform(0.001, 0.2) if cut else None)
                except (RuntimeError, httpx.HTTPError, OSError) as exc:
                    with lock:
                        errors.append(repr(exc)[:200])
                    continue
                if got is not None:
                    with lock:
                        done.append((body, got))

        before = _metrics(url)
        threads = [threading.Thread(target=worker, args=(k,)) for k in range(args.workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        after = _metrics(url)
        idle_keys = ("skippy:num_requests_running", "skippy:num_requests_waiting",
                     "skippy:num_lanes_in_use", "skippy:kv_cache_usage_perc")
        for _ in range(40):  # the cut-off requests' cancellations land within a moment
            state = _metrics(url)
            idle = [state.get(k, 0.0) for k in idle_keys]
            if not any(idle):
                break
            time.sleep(0.25)

        def grew(name: str) -> float:
            return after.get(name, 0.0) - before.get(name, 0.0)

        mismatches = 0
        out = open(args.mismatches, "w", encoding="utf-8") if args.mismatches else None
        for i, (body, (tokens, usage)) in enumerate(done):
            alone, _ = _plain(url, server.port, body, None)
            if alone != tokens or usage != sum(map(len, tokens.values())):
                mismatches += 1
                if out is not None:
                    out.write(json.dumps({"body": body, "under_load": tokens,
                                          "alone": alone}) + "\n")
            if (i + 1) % 200 == 0:
                print(f"# replayed {i + 1} of {len(done)}", file=sys.stderr, flush=True)
        if out is not None:
            out.close()
    finally:
        server.close()
    figures = {
        "label": args.label, "seconds": args.seconds, "workers": args.workers,
        "completed": len(done), "mismatches": mismatches, "errors": len(errors),
        "preemptions": grew('skippy:num_preemptions_total{reason="priority"}'),
        "cancelled": grew('skippy:request_success_total{finished_reason="abort"}'),
        "restored_tokens": grew("skippy:prefix_restored_tokens_total"),
        "idle_after": not any(idle)}
    print(f"completed {len(done)}, mismatches {mismatches}, errors {len(errors)} "
          f"{errors[:3] if errors else ''}; preemptions {figures['preemptions']:g}, "
          f"cancelled {figures['cancelled']:g}, restored tokens {figures['restored_tokens']:g}; "
          f"idle after: {figures['idle_after']}")
    if args.json:
        with open(args.json, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(figures) + "\n")
    return 0 if mismatches == 0 and not errors and figures["idle_after"] else 1


if __name__ == "__main__":
    sys.exit(main())
