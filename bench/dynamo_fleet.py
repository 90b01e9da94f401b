"""A fleet of `skippy-scheduler dynamo-worker` replicas behind Dynamo's frontend, one router
mode at a time: what Dynamo's KV routing buys over round robin on bench/fleet.py's load.

    python bench/dynamo_fleet.py --markdown                       # tiny model, kv and round-robin
    python bench/dynamo_fleet.py --model bench-58m.gguf --json dynamo-fleet.json
    python bench/dynamo_fleet.py --modes kv --kill-after 5        # a replica killed mid-run
    python bench/dynamo_fleet.py --modes kv --kill-after 2 --restart-after 5 --requests 400

Needs Dynamo (ai-dynamo 1.6, docs/fleet.md "Dynamo") in this Python. For each `--modes` entry
(`kv`, `round-robin`, `random`) the script starts `--replicas` fresh workers (one llama.cpp
thread each, prefix reuse on, file discovery in a fresh folder, TCP requests, ZeroMQ events),
then `python -m dynamo.frontend --router-mode MODE` (kv with `--router-prefill-load-scale 4`:
`--prefill-load-scale`), waits until every replica has registered,
runs the load of bench/fleet.py (`--groups` prefix groups of `--prefix-tokens` tokens, each
request a group's prefix then `--suffix-tokens` of its own, `--concurrency` closed-loop
clients, streamed, greedy, `--max-tokens` with `ignore_eos`) through the frontend, reads each
worker's counters (`--stats-file`: prompt tokens restored from its prefix store and prefilled,
requests), and stops everything; the next mode starts from empty caches.

Reported per mode: the prefix hit rate (prompt tokens restored / prompt tokens admitted, summed
over the replicas: what bench/fleet.py reads from `vllm:prefix_cache_*`), prompt tokens
prefilled, TTFT p50/p99 seen by the clients through the frontend, output tokens/s over the
run, requests per replica. Prompt token counts include the BOS the worker puts in front.

`--kill-after S`: S seconds into the load the first replica is killed (SIGKILL); the row then
counts the requests that ended with an error (those it was running or was sent before the
frontend saw it go) and the ones completed, and the requests per replica show where the rest
went. With `--restart-after R` as well, the killed replica is started again R seconds after
the kill (a fresh process, empty caches, a new Dynamo instance) and the row adds the requests
it served after it rejoined (`rejoined_requests`).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import httpx

from fleet import make_prompts
from skippy_bench.loads import client, closed_loop, errors, request_args
from skippy_bench.reports import emit, markdown_table, percentile
from skippy_bench.servers import free_port

MODES = ("kv", "round-robin", "random")
MODEL_NAME = "bench"


def router_flags(args, mode: str) -> list[str]:
    """The KV router's cost settings (docs/fleet.md, "Dynamo", the router's cost): the prefill
    term scaled by `--prefill-load-scale` so a resident prefix outweighs the active-block load
    of a request or two in flight (at Dynamo's default of 1 it does not)."""
    if mode != "kv" or args.prefill_load_scale is None:
        return []
    return ["--router-prefill-load-scale", str(args.prefill_load_scale)]


class Fleet:
    """Workers and a frontend for one router mode, logs in `logs`/<mode>-*.log."""

    def __init__(self, args, mode: str, logs: str) -> None:
        self.root = tempfile.mkdtemp(prefix=f"dynamo-{mode}-", dir=logs)
        self.env = dict(os.environ, DYN_FILE_KV=os.path.join(self.root, "kv"),
                        DYN_SELF_HOST_METADATA="0", DYN_LOG=args.dyn_log)
        if args.cache:
            self.env["SKIPPY_SCHEDULER_CACHE"] = args.cache
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.stats = [os.path.join(self.root, f"stats{i}.json") for i in range(args.replicas)]
        self.procs: list[subprocess.Popen] = []
        self.logs = []
        self.mode, self.logs_dir = mode, logs
        model = ["-m", os.path.abspath(args.model)] if args.model else []
        self.worker_args = ["skippy_scheduler.cli", "dynamo-worker", *model,
                            "--served-model-name", MODEL_NAME, "-t", "1",
                            "--max-active", str(args.max_active), "-c", str(args.ctx_size),
                            "--prefix-cache-tokens", str(args.prefix_cache_tokens),
                            "--prefix-holders", str(args.prefix_holders),
                            "--kv-block-size", str(args.block_size)]
        for i in range(args.replicas):
            self._spawn([*self.worker_args, "--stats-file", self.stats[i]],
                        f"{mode}-worker{i}.log", logs)
        self._spawn(["dynamo.frontend", "--discovery-backend", "file", "--request-plane", "tcp",
                     "--event-plane", "zmq", "--router-mode", mode, "--http-host", "127.0.0.1",
                     "--http-port", str(self.port), *router_flags(args, mode), *args.frontend_arg],
                    f"{mode}-frontend.log", logs)
        self._wait(args)

    def _spawn(self, args: list[str], log: str, logs: str) -> None:
        out = open(os.path.join(logs, log), "ab")
        self.logs.append(out)
        self.procs.append(subprocess.Popen([sys.executable, "-m", *args], env=self.env,
                                           stdout=out, stderr=subprocess.STDOUT, cwd=logs))

    def instances(self) -> int:
        folder = os.path.join(self.root, "kv", "v1", "instances")
        return len([n for n in os.listdir(folder) if "generate" in n]) \
            if os.path.isdir(folder) else 0

    def _wait(self, args) -> None:
        deadline = time.monotonic() + args.start_timeout
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in self.procs):
                self.close()
                raise RuntimeError(f"a process of the fleet exited; logs in {self.root}/..")
            try:
                ok = httpx.get(self.url + "/v1/models", timeout=2).json()["data"]
            except (httpx.HTTPError, KeyError, ValueError):
                ok = False
            if ok and self.instances() >= args.replicas:
                time.sleep(args.settle)  # the router's event subscriptions
                return
            time.sleep(0.5)
        self.close()
        raise RuntimeError("the Dynamo fleet did not come up in time")

    def kill(self, i: int) -> None:
        self.procs[i].send_signal(signal.SIGKILL)

    def restart(self, i: int) -> None:
        """Start replica `i` again (after `kill`): a new process with its own stats file,
        appended to `stats` (its old file keeps what the killed process last wrote)."""
        self.stats.append(os.path.join(self.root, f"stats{i}-restarted.json"))
        self._spawn([*self.worker_args, "--stats-file", self.stats[-1]],
                    f"{self.mode}-worker{i}-restarted.log", self.logs_dir)

    def counters(self) -> list[dict]:
        out = []
        for path in self.stats:
            try:
                with open(path, encoding="utf-8") as f:
                    out.append(json.load(f))
            except (OSError, ValueError):
                out.append({})
        return out

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        for p in self.procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for f in self.logs:
            f.close()


async def drive(url: str, prompts: list[str], args, fleet: Fleet) -> tuple[list, float]:
    req = request_args(args.max_tokens, MODEL_NAME)

    async def killer() -> None:
        await asyncio.sleep(args.kill_after)
        fleet.kill(0)
        if args.restart_after is not None:
            await asyncio.sleep(args.restart_after)
            fleet.restart(0)

    async with client(url, args.timeout, args.concurrency) as c:
        task = asyncio.ensure_future(killer()) if args.kill_after is not None else None
        try:
            return await closed_loop(c, prompts, req, args.concurrency)
        finally:
            if task is not None:
                task.cancel()


def run_mode(args, mode: str, prompts: list[str], logs: str) -> dict:
    fleet = Fleet(args, mode, logs)
    try:
        results, wall = asyncio.run(drive(fleet.url, prompts, args, fleet))
        time.sleep(1.0)  # the workers' stats files catch up
        counters = fleet.counters()
    finally:
        fleet.close()
    counters = [c or fleet.counters()[i] for i, c in enumerate(counters)]  # written at exit
    good = [r for r in results if r.ok]
    restored = sum(c.get("restored_tokens", 0) for c in counters)
    prefilled = sum(c.get("prefill_tokens", 0) for c in counters)
    ttft = [r.first - r.sent for r in good]
    tokens = sum(r.tokens for r in good)
    return {
        "router_mode": mode, "replicas": args.replicas, "requests": len(prompts),
        "completed": len(good), "failed": len(results) - len(good), "errors": errors(results),
        "killed_after_s": args.kill_after, "restarted_after_s": args.restart_after,
        "rejoined_requests": (counters[-1].get("requests", 0)
                              if args.restart_after is not None and len(counters) > args.replicas
                              else None),
        "prefix_hit_rate": restored / (restored + prefilled) if restored + prefilled else 0.0,
        "prompt_tokens": restored + prefilled, "restored_tokens": restored,
        "prefilled_tokens": prefilled,
        "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
        "output_tokens_per_s": tokens / wall if wall else 0.0, "wall_s": wall,
        "per_replica_requests": [c.get("requests", 0) for c in counters],  # a restarted one last
    }


def markdown(rows: list[dict]) -> str:
    return "\n".join(markdown_table(
        ["router mode", "prefix hit rate", "prefilled tokens", "TTFT p50 (s)", "TTFT p99 (s)",
         "output tok/s", "requests per replica", "failed"], "llllllll",
        ([r["router_mode"], f"{r['prefix_hit_rate']:.3f}", f"{r['prefilled_tokens']:.0f}",
          f"{r['ttft_p50_s']:.3f}", f"{r['ttft_p99_s']:.3f}", f"{r['output_tokens_per_s']:.1f}",
          " / ".join(f"{n:.0f}" for n in r["per_replica_requests"]), str(r["failed"])]
         for r in rows)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--model", help="GGUF of the replicas (default: the tiny model)")
    ap.add_argument("--modes", nargs="+", choices=MODES, default=["kv", "round-robin"])
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
    ap.add_argument("--settle", type=float, default=1.0,
                    help="seconds between the fleet's registration and the load")
    ap.add_argument("--start-timeout", type=float, default=180)
    ap.add_argument("--timeout", type=float, default=600, help="per request")
    ap.add_argument("--kill-after", type=float, default=None, metavar="S",
                    help="kill the first replica S seconds into the load")
    ap.add_argument("--restart-after", type=float, default=None, metavar="R",
                    help="with --kill-after: start the killed replica again R seconds after the "
                         "kill")
    ap.add_argument("--prefill-load-scale", type=float, default=4.0,
                    help="kv mode: the frontend's --router-prefill-load-scale (default 4; "
                         "Dynamo's own default is 1)")
    ap.add_argument("--frontend-arg", action="append", default=[], metavar="ARG",
                    help="extra dynamo.frontend argument (repeatable)")
    ap.add_argument("--dyn-log", default="warn", help="DYN_LOG of the fleet (default: warn)")
    ap.add_argument("--cache", help="SKIPPY_SCHEDULER_CACHE for the exported tokenizer folder")
    ap.add_argument("--logs", help="directory for the workers' and frontends' logs")
    ap.add_argument("--json", help="append one JSON line per mode to this file")
    ap.add_argument("--markdown", action="store_true", help="print the table at the end")
    args = ap.parse_args(argv)
    if args.restart_after is not None and args.kill_after is None:
        ap.error("--restart-after needs --kill-after")
    prompts = make_prompts(args)
    logs = os.path.abspath(args.logs or tempfile.mkdtemp(prefix="skippy-dynamo-fleet-"))
    os.makedirs(logs, exist_ok=True)
    rows = []
    for mode in args.modes:
        row = run_mode(args, mode, prompts, logs)
        rows.append(row)
        emit(row, args.json)
    if args.markdown:
        print(markdown(rows))
    print(f"logs: {logs}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
