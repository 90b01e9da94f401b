"""The server's own cost per output token and per step, on a host that takes no time.

    python bench/serve_overhead.py --concurrency 64 --requests 640 --max-tokens 128 --json o.jsonl

Starts the real app (`skippy_scheduler.serve`'s routes, engine thread, scheduler) on
`InstantHost` (`instant_host.py`: every sampling row gets a fixed token at once) in a child
process on loopback, then drives it with a closed loop of streaming requests from
`--clients` processes sharing `--concurrency` streams, started together. What remains of a
request's cost is the server's: HTTP and SSE, detokenisation, events, engine bookkeeping,
planning.

`--client` picks the load client. `lean` (the default) is `skippy_bench.lean_client.run_load`:
raw asyncio, one keep-alive connection per stream, token chunks counted by a byte search and
only the last events parsed, so the client spends a fraction of the server's CPU per token and
the server is the bottleneck. `httpx` is `serve_load.py`'s closed loop
(`skippy_bench.loads.run_load`, httpx, every chunk parsed), the client that the figures before
`--client` existed were measured with; on two cores it spends more CPU per token than the
server and caps the rate.

Reported: output tokens/s received through HTTP streaming (the sum over clients: tokens /
longest client wall time); the streamed chunks that carried tokens and tokens per chunk (1.0:
every token went out in a chunk of its own); the server process's CPU time (on-CPU time per
thread, from /proc) per output token and per engine step over the load, split into the main
thread (uvicorn's event loop: HTTP, SSE, detokenisation) and the others (the engine thread:
scheduler, plans, events); steps and tokens per step (`/metrics`), and with `--step-ms` the
plans' share of the wall time (`plan_busy_pct`); the clients' CPU time per token (when it
approaches the wall time per token, the clients are the bottleneck: add `--clients`); the load
average at the start. On a shared machine the figures are indicative only.
"""
from __future__ import annotations

import argparse
import asyncio
import cProfile
import multiprocessing
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import time
from typing import Any, Callable, Optional

import httpx

from skippy_bench import lean_client
from skippy_bench.loads import load_args, run_load
from skippy_bench.reports import emit
from skippy_bench.servers import stop

HERE = os.path.dirname(os.path.abspath(__file__))
_SAMPLE = re.compile(r"^(skippy:iterations|skippy:generation_tokens)(?:_total)? (\S+)$", re.M)


def _thread_cpu_s(pid: int, tid: str) -> float:
    """On-CPU seconds of one thread: schedstat's nanoseconds, else stat's clock ticks."""
    base = f"/proc/{pid}/task/{tid}"
    try:
        with open(base + "/schedstat", encoding="ascii") as fh:
            return int(fh.read().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        pass
    with open(base + "/stat", encoding="ascii") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _cpu_s(pid: int) -> tuple[float, float]:
    """(main thread, other threads) CPU seconds of process `pid`."""
    main = other = 0.0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            s = _thread_cpu_s(pid, tid)
        except FileNotFoundError:  # a thread that ended meanwhile
            continue
        if int(tid) == pid:
            main += s
        else:
            other += s
    return main, other


def _counters(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {m.group(1): float(m.group(2)) for m in _SAMPLE.finditer(text)}


def _start_server(args: argparse.Namespace) -> tuple[subprocess.Popen[str], str]:
    cmd = [sys.executable, os.path.join(HERE, "serve_overhead.py"), "serve",
           "--max-active", str(args.max_active or args.concurrency),
           "--batch-size", str(args.batch_size), "--prefill-chunk", str(args.prefill_chunk),
           "--inflight", str(args.inflight), "--step-ms", str(args.step_ms),
           "--planning-rule", args.planning_rule]
    if args.profile:
        cmd += ["--profile", args.profile]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    if not line.startswith("http://"):
        proc.kill()
        proc.wait()
        raise SystemExit(f"serve_overhead: the server did not start (it said {line!r})")
    end = time.monotonic() + 20
    while True:
        try:
            if httpx.get(line + "/health", timeout=2).status_code == 200:
                return proc, line
        except httpx.HTTPError:
            pass
        if time.monotonic() > end:
            _stop(proc)
            raise SystemExit("serve_overhead: the server did not become healthy")
        time.sleep(0.05)


def _stop(proc: subprocess.Popen[str]) -> None:
    stop(proc, 15, signal.SIGINT)
    if proc.stdout is not None:
        proc.stdout.close()


def _client(url: str, concurrency: int, requests: int, seed: int, args: argparse.Namespace,
            barrier: Any, results: Any) -> None:
    """One client process: the closed loop of `args.client` (`lean`:
    `skippy_bench.lean_client.run_load`; `httpx`: `serve_load.py`'s,
    `skippy_bench.loads.run_load`), started with the others."""
    load = load_args(url, f"instant-{seed}", model="instant", concurrency=concurrency,
                     requests=requests, prompt_tokens=args.prompt_tokens, shared_prefix=1,
                     shared_fraction=0.0, max_tokens=args.max_tokens, seed=seed,
                     warmup=False, drain=True)
    barrier.wait(60)
    cpu = time.process_time()
    out = asyncio.run(lean_client.run_load(load) if args.client == "lean" else run_load(load))
    out["cpu_s"] = time.process_time() - cpu
    results.put(out)


def _clients(url: str, args: argparse.Namespace, before: Callable[[], None]) -> list[Any]:
    """Run the clients to the end (`before()` runs as they start); one result per client."""
    k, c, n = args.clients, args.concurrency, args.requests
    mp = multiprocessing.get_context("spawn")
    barrier, results = mp.Barrier(k + 1), mp.Queue()
    procs = [mp.Process(target=_client, args=(url, c // k + (i < c % k), n // k + (i < n % k),
                                              i, args, barrier, results))
             for i in range(k)]
    for p in procs:
        p.start()
    try:
        before()
        barrier.wait(60)
        out: list[Any] = []
        end = time.monotonic() + args.timeout
        while len(out) < k:
            try:
                out.append(results.get(timeout=0.5))
            except queue.Empty:
                if time.monotonic() > end or all(p.exitcode is not None for p in procs):
                    raise SystemExit(f"serve_overhead: {k - len(out)} of {k} clients ended "
                                     "without a result") from None
        return out
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()
        results.close()
        results.join_thread()


def measure(args: argparse.Namespace) -> dict[str, Any]:
    load = os.getloadavg()[0]
    proc, url = _start_server(args)
    try:
        for _ in range(2):  # warm-up: first requests pay imports and first allocations
            httpx.post(url + "/v1/completions", timeout=30,
                       json={"model": "instant", "prompt": "a b c", "max_tokens": 8})
        marks: list[Any] = []
        results = _clients(url, args, lambda: marks.extend((_counters(url), _cpu_s(proc.pid))))
        cpu1 = _cpu_s(proc.pid)
        c1 = _counters(url)
    finally:
        _stop(proc)
    c0, cpu0 = marks
    tokens = sum(r["output_tokens"] for r in results)
    chunks = sum(r["token_chunks"] for r in results)
    wall = max(r["wall_s"] for r in results)
    steps = c1["skippy:iterations"] - c0["skippy:iterations"]
    served = c1["skippy:generation_tokens"] - c0["skippy:generation_tokens"]
    main_s, engine_s = cpu1[0] - cpu0[0], cpu1[1] - cpu0[1]
    client_s = sum(r["cpu_s"] for r in results)

    def per(x: float, n: float) -> Optional[float]:
        return x * 1e6 / n if n else None

    return {
        "label": "instant host", "step_ms": args.step_ms, "planning_rule": args.planning_rule,
        "concurrency": args.concurrency,
        "clients": args.clients, "client": args.client,
        "requests": args.requests, "completed": sum(r["completed"] for r in results),
        "errors": sorted({e for r in results for e in r["errors"]})[:5],
        "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
        "output_tokens": tokens, "token_chunks": chunks,
        "tokens_per_chunk": tokens / chunks if chunks else None, "wall_s": wall, "output_tokens_per_s": tokens / wall,
        "ttft_p99_s": max(r["ttft_p99_s"] for r in results),
        "itl_p99_s": max(r["itl_p99_s"] for r in results),
        "server_tokens": served, "steps": steps,
        "tokens_per_step": served / steps if steps else None,
        # With --step-ms T: the plans' sleep as a share of the load's wall time, what a device
        # whose step takes T ms would be kept busy.
        "plan_busy_pct": (100 * steps * args.step_ms / (wall * 1e3)
                          if args.step_ms > 0 and wall > 0 else None),
        "server_cpu_s": main_s + engine_s,
        "server_cpu_us_per_token": per(main_s + engine_s, served),
        "server_http_cpu_us_per_token": per(main_s, served),
        "server_engine_cpu_us_per_token": per(engine_s, served),
        "server_cpu_us_per_step": per(main_s + engine_s, steps),
        "server_engine_cpu_us_per_step": per(engine_s, steps),
        "client_cpu_us_per_token": per(client_s, tokens),
        "wall_us_per_token": per(wall, tokens), "load_average_1m": load,
    }


def _serve(argv: list[str]) -> int:
    """The child: the app on an instant host, on a loopback port; prints its URL first."""
    from instant_host import InstantHost, build_server, serve
    from skippy_scheduler.serve import ServeSettings
    from skippy_scheduler.serve.server import listen_socket

    ap = argparse.ArgumentParser(prog="serve_overhead.py serve", allow_abbrev=False)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--max-active", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=ServeSettings.batch_size)
    ap.add_argument("--prefill-chunk", type=int, default=ServeSettings.prefill_chunk)
    ap.add_argument("--inflight", type=int, default=1)
    ap.add_argument("--step-ms", type=float, default=0.0)
    ap.add_argument("--planning-rule", default=ServeSettings.planning_rule)
    ap.add_argument("--profile", default=None)
    a = ap.parse_args(argv)
    settings = ServeSettings(max_active=a.max_active, max_waiting=4096,
                             batch_size=a.batch_size, prefill_chunk=a.prefill_chunk,
                             inflight=a.inflight, planning_rule=a.planning_rule)
    server = build_server(settings, InstantHost(n_seq_max=a.max_active,
                                                step_s=a.step_ms / 1e3))
    sock = listen_socket("127.0.0.1", a.port, backlog=2048)  # the server's own listener
    print(f"http://127.0.0.1:{sock.getsockname()[1]}", flush=True)
    profiles = _profile_engine(server.runner) if a.profile else []
    try:
        if a.profile:
            profiles.append(cProfile.Profile())
            profiles[-1].runcall(serve, server, sock)
        else:
            serve(server, sock)  # until the parent's SIGINT
    except KeyboardInterrupt:
        pass
    for name, prof in zip(("engine", "loop"), profiles):
        prof.dump_stats(f"{a.profile}.{name}")
    return 0


def _profile_engine(runner: Any) -> list[cProfile.Profile]:
    """A profiler around the engine thread's loop (`--profile`: written as FILE.engine and
    FILE.loop, the event loop's, for `python -m pstats`)."""
    prof = cProfile.Profile()
    main = runner._main
    runner._main = lambda: prof.runcall(main)
    return [prof]


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        return _serve(argv[1:])
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--clients", type=int, default=1, help="client processes")
    ap.add_argument("--client", choices=("lean", "httpx"), default="lean",
                    help="the load client: lean (default; raw asyncio, a keep-alive connection "
                         "per stream, token chunks counted, not parsed: the server is the "
                         "bottleneck) or httpx (serve_load.py's closed loop, every chunk "
                         "parsed: the client earlier figures were measured with)")
    ap.add_argument("--requests", type=int, default=640)
    ap.add_argument("--prompt-tokens", type=int, default=32,
                    help="words of each prompt (serve_load.py's prompts)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-active", type=int, default=None,
                    help="server lanes (default: the concurrency)")
    ap.add_argument("--batch-size", type=int, default=512)
    ap.add_argument("--prefill-chunk", type=int, default=256)
    ap.add_argument("--inflight", type=int, default=1)
    ap.add_argument("--step-ms", type=float, default=0.0,
                    help="time every plan takes, asleep (0: none); > 0 gives one token per "
                         "request per step, so each streamed chunk carries one token")
    ap.add_argument("--planning-rule", choices=("slack", "reference"), default="slack",
                    help="the scheduler's planning rule (docs/behaviour.md §2.13; the server's "
                         "default: slack)")
    ap.add_argument("--timeout", type=float, default=600, help="the whole load, seconds")
    ap.add_argument("--profile", metavar="FILE",
                    help="profile the server's event loop and engine thread (cProfile: FILE.loop "
                         "and FILE.engine; the figures then include the profiler's cost)")
    ap.add_argument("--json", help="append the result as one JSON line to this file")
    args = ap.parse_args(argv)
    if not 1 <= args.clients <= args.concurrency <= args.requests:
        ap.error("need 1 <= --clients <= --concurrency <= --requests")
    if args.prompt_tokens < 2 or args.max_tokens < 1 or not 0 <= args.step_ms < 1e4:
        ap.error("need --prompt-tokens >= 2, --max-tokens >= 1, 0 <= --step-ms < 10000")
    emit(measure(args), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
