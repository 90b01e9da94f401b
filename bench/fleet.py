"""A fleet of `skippy-scheduler serve` replicas behind vLLM's router, one routing policy at a
time: what cache-aware routing buys on a multi-prefix load.

    python bench/serve_load.py write-model bench-58m.gguf
    python bench/fleet.py --model bench-58m.gguf --json fleet.json

For each `--policies` entry (round_robin, cache_aware, kv_aware) the script starts
`--replicas` fresh replicas (one llama.cpp thread each, prefix reuse on, each publishing KV
events and answering replays), starts `vllm-router` with that policy in front of them (for
kv_aware with every replica's event and replay endpoints), runs the load, reads the replicas'
metrics, and stops everything; the next policy starts from empty caches.

The load: `--groups` prefix groups of `--prefix-tokens` tokens (single-letter words, one token
each with the bench model's vocabulary), every request a group's prefix then `--suffix-tokens`
of its own, groups drawn uniformly at random (seeded), `--concurrency` clients each sending its
next request when the previous one ends, streamed, greedy, `--max-tokens` tokens with
`ignore_eos`. Each replica keeps `--prefix-holders` resident prefixes of at most
`--prefix-cache-tokens` tokens in all, so with the defaults one replica holds at most half of
the groups (a finished request replaces the holder it shares most of its key with, so a group
mostly keeps one holder; docs/fleet.md): a policy that spreads every group over all replicas
evicts, one that keeps a group on one replica hits.

Reported per policy: the aggregate prefix hit rate (prompt tokens restored from a replica's
prefix store / prompt tokens of admitted requests, summed over the replicas' `vllm:` counters),
the prompt tokens prefilled (computed, not restored), TTFT p50/p99 seen by the clients
(through the router), output tokens/s over the run, and how the requests were spread over the
replicas. `--markdown` prints the table BENCHMARKS.md carries. `--trace` adds, per policy,
counts read from the replicas' KV events (skippy_bench/fleet_trace.py): where each request's
prefix was resident when it was sent, how sticky the routing kept groups, how many groups each
replica held.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import string
import sys
import tempfile
import time

import httpx

from skippy_bench.fleet_trace import EventRecorder, analyse
from skippy_bench.loads import client, closed_loop, errors, request_args
from skippy_bench.reports import emit, markdown_table, percentile
from skippy_bench.servers import Served, free_port

POLICIES = ("round_robin", "cache_aware", "kv_aware")
MODEL_NAME = "bench"


def make_prompts(args) -> list[str]:
    rng = random.Random(args.seed)

    def words(n: int) -> list[str]:
        return [rng.choice(string.ascii_lowercase) for _ in range(n)]

    prefixes = [words(args.prefix_tokens - 1) for _ in range(args.groups)]  # BOS is one
    return [" ".join(rng.choice(prefixes) + words(args.suffix_tokens))
            for _ in range(args.requests)]


class Replica(Served):
    def __init__(self, args, index: int, logs: str) -> None:
        self.events = f"tcp://127.0.0.1:{free_port()}"
        self.replay = f"tcp://127.0.0.1:{free_port()}"
        cmd = [sys.executable, "-m", "skippy_scheduler.cli", "serve",
               "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--threads", "1",
               "--max-active", str(args.max_active), "--ctx-size", str(args.ctx_size),
               "--prefix-cache-tokens", str(args.prefix_cache_tokens),
               "--prefix-holders", str(args.prefix_holders),
               "--kv-events-endpoint", self.events, "--kv-events-replay-endpoint", self.replay,
               "--kv-block-size", str(args.block_size)]
        if args.model:
            cmd += ["--model", os.path.abspath(args.model)]
        super().__init__(cmd, logs, f"replica-{index}", args.start_timeout)

    def counters(self) -> dict[str, float]:
        out = {}
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            for name in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                         "skippy:e2e_request_latency_seconds_count"):
                if line.startswith(name):
                    out[name] = float(line.split()[-1])
        return out


def start_router(args, policy: str, replicas: list[Replica], logs: str) -> Served:
    binary = shutil.which("vllm-router") or os.path.join(os.path.dirname(sys.executable),
                                                         "vllm-router")
    cmd = [binary, "--host", "127.0.0.1", "--policy", policy,
           "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
           "--worker-urls", *[r.url for r in replicas]]
    if policy == "kv_aware":
        for r in replicas:
            cmd += ["--kv-event-source", f"{r.url}={r.events}",
                    "--kv-event-replay-source", f"{r.url}={r.replay}"]
        cmd += ["--kv-event-block-size", str(args.block_size), "--kv-event-model", MODEL_NAME]
    return Served(cmd + args.router_arg, logs, f"router-{policy}", args.start_timeout)


def prompt_groups(args, prompts: list[str]) -> list[int]:
    """The prefix group of each prompt (groups numbered in order of first appearance)."""
    seen: dict[tuple[str, ...], int] = {}
    return [seen.setdefault(tuple(p.split()[:args.prefix_tokens - 1]), len(seen))
            for p in prompts]


async def drive(url: str, prompts: list[str], args) -> tuple[list, float]:
    """Every prompt's result (in prompt order) and the wall time of the load."""
    req = request_args(args.max_tokens, MODEL_NAME)
    async with client(url, args.timeout, args.concurrency) as c:
        return await closed_loop(c, prompts, req, args.concurrency)


def run_policy(args, policy: str, prompts: list[str], logs: str) -> dict:
    replicas: list[Replica] = []
    router = None
    trace: dict = {}
    try:
        for i in range(args.replicas):
            replicas.append(Replica(args, i, logs))
        router = start_router(args, policy, replicas, logs)
        recorder = EventRecorder([r.events for r in replicas]) if args.trace else None
        time.sleep(args.settle)  # subscribers connected before the first event
        results, wall = asyncio.run(drive(router.url, prompts, args))
        counters = [r.counters() for r in replicas]
        if recorder is not None:
            recorder.stop()
            tokens = [httpx.post(replicas[0].url + "/tokenize", json={"prompt": p},
                                 timeout=30).json()["tokens"] for p in prompts]
            trace = analyse(recorder, tokens, prompt_groups(args, prompts),
                            [r.sent for r in results], args.prefix_tokens, args.block_size,
                            args.prefix_holders, [r.end or r.sent for r in results])
    finally:
        if router is not None:
            router.close()
        for r in replicas:
            r.close()
    good = [r for r in results if r.ok]
    extra = {"trace": trace} if args.trace else {}
    queries = sum(c.get("vllm:prefix_cache_queries_total", 0) for c in counters)
    hits = sum(c.get("vllm:prefix_cache_hits_total", 0) for c in counters)
    ttft = [r.first - r.sent for r in good]
    tokens = sum(r.tokens for r in good)
    return {
        "policy": policy, "replicas": args.replicas, "requests": len(prompts),
        "completed": len(good),
        "errors": errors(results),
        "prefix_hit_rate": hits / queries if queries else 0.0,
        "prompt_tokens": queries, "restored_tokens": hits, "prefilled_tokens": queries - hits,
        "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
        "output_tokens_per_s": tokens / wall if wall else 0.0, "wall_s": wall,
        "per_replica_requests": [c.get("skippy:e2e_request_latency_seconds_count", 0)
                                 for c in counters],
        **extra,
    }


def markdown(rows: list[dict]) -> str:
    return "\n".join(markdown_table(
        ["policy", "prefix hit rate", "prefilled tokens", "TTFT p50 (s)", "TTFT p99 (s)",
         "output tok/s", "requests per replica"], "lllllll",
        ([r["policy"], f"{r['prefix_hit_rate']:.3f}", f"{r['prefilled_tokens']:.0f}",
          f"{r['ttft_p50_s']:.3f}", f"{r['ttft_p99_s']:.3f}", f"{r['output_tokens_per_s']:.1f}",
          " / ".join(f"{n:.0f}" for n in r["per_replica_requests"])] for r in rows)))


def trace_markdown(rows: list[dict]) -> str:
    """The `--trace` counts of each policy as a table (requests by where their prefix was)."""
    def cells(r: dict) -> list[str]:
        t = r["trace"]
        w = t["prefix_at_send"]
        m = t["modelled_hit_share"]
        return [r["policy"], f"{t['group_stickiness']:.2f}",
                f"{w['on_served']} / {w['only_elsewhere']} ({w['only_elsewhere_fresh']}) / "
                f"{w['nowhere']} ({w['nowhere_but_running']}, "
                f"{w['nowhere_but_running_elsewhere']})",
                f"{' / '.join(f'{g:.1f}' for g in t['groups_resident_mean'])} of "
                f"{t['holders_per_replica']}",
                f"{m['round_robin']:.3f} / {m['partition']:.3f}"]

    return "\n".join(markdown_table(
        ["policy", "group stickiness", "prefix on the serving replica / only elsewhere (fresh) / "
         "nowhere (its group running: anywhere, elsewhere)", "groups held per replica",
         "modelled: round robin / partition"], "lllll", (cells(r) for r in rows)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--model", help="GGUF of the replicas (default: serve's tiny model)")
    ap.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--groups", type=int, default=8, help="prefix groups")
    ap.add_argument("--prefix-tokens", type=int, default=384)
    ap.add_argument("--suffix-tokens", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-active", type=int, default=2, help="lanes per replica")
    ap.add_argument("--ctx-size", type=int, default=2048, help="KV cells per replica's lanes")
    ap.add_argument("--prefix-cache-tokens", type=int, default=4096)
    ap.add_argument("--prefix-holders", type=int, default=4)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--settle", type=float, default=1.0, help="seconds between router start "
                    "and load")
    ap.add_argument("--start-timeout", type=float, default=120)
    ap.add_argument("--timeout", type=float, default=600, help="per request")
    ap.add_argument("--router-arg", action="append", default=[], metavar="ARG",
                    help="extra vllm-router argument (repeatable)")
    ap.add_argument("--trace", action="store_true",
                    help="record the replicas' KV events and report, per policy, where each "
                    "request's prefix was resident when it was sent (skippy_bench/fleet_trace.py)")
    ap.add_argument("--logs", help="directory for the replicas' and routers' logs")
    ap.add_argument("--json", help="append one JSON line per policy to this file")
    ap.add_argument("--markdown", action="store_true", help="print the table at the end")
    args = ap.parse_args(argv)
    prompts = make_prompts(args)
    logs = args.logs or tempfile.mkdtemp(prefix="skippy-fleet-")
    os.makedirs(logs, exist_ok=True)
    rows = []
    for policy in args.policies:
        row = run_policy(args, policy, prompts, logs)
        rows.append(row)
        emit(row, args.json)
    if args.markdown:
        print(markdown(rows))
        if args.trace:
            print(trace_markdown(rows))
    print(f"logs: {logs}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
