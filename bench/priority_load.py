"""Priority under load: a saturating low-priority background plus a trickle of urgent requests.

    python bench/serve_load.py write-model bench-58m.gguf
    python bench/priority_load.py compare --model bench-58m.gguf --json priority.jsonl
    python bench/priority_load.py run --url http://127.0.0.1:8000 --label mine
    python bench/priority_load.py resume-cost --model bench-58m.gguf

`run` drives one server: `--background` closed-loop clients (each sends its next streaming
request when the previous one ends; more clients than the server has lanes, so its queue never
empties) of `--background-tokens` tokens at priority 0, and, once they are all running,
`--urgent` requests of `--urgent-tokens` tokens at priority `--urgent-priority` (this server's
convention: higher runs first), one every `--urgent-interval` seconds. Prompts and token
counting are serve_load.py's. `--priority-field none` sends no priority (a server without the
field, e.g. llama-server: every request then waits its turn).

**The window.** Throughput is taken over one fixed interval, the same for every server:
[first urgent request sent, + `--urgent` x `--urgent-interval` + `--drain-s`]. The background
keeps its closed loop running until the window and the urgent work are both over, so the
offered load inside the window is the same everywhere. `--drain-s` is chosen so that every
server's urgent requests end inside it; the JSON says whether they did (`window_holds_urgent`,
`urgent_outside_window`) and `compare`'s ratios say `comparable: false` when one did not. Why
fixed: the urgent work is the same on every server, so with all of it inside the window the
background's tokens are what the server had left for the background over the same time, and
the comparison is one of capacity. The earlier window, from the first urgent request to the
last one's end, is shorter on a server that serves the urgent requests sooner while holding
the same urgent work, which lowers that server's background figure by construction (and it
ends at different times on different servers); it is still reported
(`background_tokens_per_s_to_last_urgent`, `window_to_last_urgent_s`) so both can be shown.
Tokens count where they reached the client: each streamed chunk's arrival time inside the
window (one token per chunk on these servers), so a preempted stream's pause counts as the
pause it was. Also reported: `total_tokens_per_s` (background and urgent tokens over the
window), the urgent requests' TTFT p50/p99 (sent → first token), the background's own TTFT,
and `server_deltas`: every `skippy:` counter of /metrics scraped at the window's two ends
(preemptions by reason, iterations, decoded entries, prefilled / recomputed / restored
tokens, KV copies into holders and back, prompt and generated tokens; None for a server
without them).

`compare` starts `skippy-scheduler serve` on `--model` three times, with preemption for priority
(the default, with `--prefix-cache-tokens` so victims resume from their kept KV), with
`--no-priority-preemption` (admission order only, with the server's default prefix store: on
the default 8 lanes of 1 024 tokens that is the same 8 x 1 024-token store, so the two
admission-order runs then repeat one configuration), and with `--no-priority-preemption` and the
same prefix store given by hand (so the store's own cost is on both sides), runs `run` against each, and, when
llama-server is found (`--llama-server PATH`, else `$LLAMA_SERVER`, else on PATH), against
llama-server with the same lanes and context, and the kernels and options of BENCHMARKS.md's
"Serving against llama-server" (f32 KV, flash attention off, a KV stream per slot). One JSON
line per server, then the ratios of the preempting server over each other one.

`resume-cost` times, in process on one LlamaHost, the resume of a sequence preempted after
`--prompt-tokens` + `--generated` tokens: from its KV kept under a holder (the copy plus one
decode row) and recomputed (the replay prefilled again in chunks of the batch, then the decode
row), in ms per resume (median of `--repeat`).
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import sys
import tempfile
import time

import httpx

from skippy_bench.loads import Result, client, errors, make_prompts, one, request_args
from skippy_bench.reports import emit, percentile
from skippy_bench.servers import Served, find_llama_server


def _request_args(args, max_tokens: int, priority: int | None) -> argparse.Namespace:
    extra = dict(args.extra)
    if priority is not None and args.priority_field != "none":
        extra[args.priority_field] = priority
    return request_args(max_tokens, args.model_name, args.token_ids, extra)


def _chunk_times(r: Result) -> list[float]:
    """When each streamed chunk of `r` arrived (the first, then the gaps after it)."""
    return [r.first, *(r.first + g for g in itertools.accumulate(r.gaps))] if r.ok else []


def _tokens_in(results: list[Result], lo: float, hi: float) -> float:
    """Output tokens of `results` that reached the client in [lo, hi): each chunk's arrival
    counts its share of the request's tokens (one token per chunk on these servers)."""
    total = 0.0
    for r in results:
        times = _chunk_times(r)
        if times:
            total += r.tokens / len(times) * sum(1 for t in times if lo <= t < hi)
    return total


async def _scrape(c: httpx.AsyncClient) -> dict[str, float] | None:
    """The server's `skippy:` counters and gauges from /metrics (None: it has none)."""
    try:
        r = await c.get("/metrics")
    except httpx.HTTPError:
        return None
    if r.status_code != 200:
        return None
    out: dict[str, float] = {}
    for line in r.text.splitlines():
        if line.startswith("skippy:") and " " in line:
            name, value = line.rsplit(" ", 1)
            if "_bucket{" not in name and not name.endswith("_created"):
                out[name] = float(value)
    return out or None


def _deltas(before: dict[str, float] | None,
            after: dict[str, float] | None) -> dict[str, float] | None:
    if before is None or after is None:
        return None
    return {k: after[k] - before.get(k, 0.0) for k in sorted(after)
            if k.split("{", 1)[0].endswith("_total")}


async def run_load(args) -> dict:
    bg_prompts = make_prompts(4096, args.prompt_tokens, 0, 0.0, args.seed)
    urgent_prompts = make_prompts(args.urgent, args.urgent_prompt_tokens, 0, 0.0, args.seed + 1)
    bg_args = _request_args(args, args.background_tokens, 0)
    urgent_args = _request_args(args, args.urgent_tokens, args.urgent_priority)
    background: list[Result] = []
    urgent: list[Result] = []
    done = asyncio.Event()
    started = [asyncio.Event() for _ in range(args.background)]
    span = args.urgent * args.urgent_interval + args.drain_s  # the fixed window's length
    window: list[float] = []
    scraped: list[dict[str, float] | None] = []
    async with client(args.url, args.timeout, args.background + args.urgent + 4,
                      args.background + 4) as c:
        if args.warmup:
            await one(c, urgent_prompts[0], _request_args(args, 4, None))

        async def background_client(k: int) -> None:
            i = k
            while not done.is_set():
                started[k].set()
                background.append(await one(c, bg_prompts[i % len(bg_prompts)], bg_args))
                i += args.background

        async def trickle() -> None:
            for ev in started:
                await ev.wait()
            await asyncio.sleep(args.settle)
            scraped.append(await _scrape(c))
            t0 = time.perf_counter()
            window.extend((t0, t0 + span))
            tasks = []
            for p in urgent_prompts:
                tasks.append(asyncio.ensure_future(one(c, p, urgent_args)))
                await asyncio.sleep(args.urgent_interval)
            await asyncio.sleep(max(0.0, window[1] - time.perf_counter()))
            scraped.append(await _scrape(c))
            urgent.extend(await asyncio.gather(*tasks))
            done.set()  # the background runs until the window and the urgent work are over

        clients = [asyncio.ensure_future(background_client(k)) for k in range(args.background)]
        await trickle()
        await asyncio.gather(*clients)
    lo, hi = window
    good_urgent = [r for r in urgent if r.ok]
    ttft = [r.first - r.sent for r in good_urgent]
    bg_ttft = [r.first - r.sent for r in background if r.ok]
    last_urgent = max((r.end for r in good_urgent), default=hi)
    outside = sum(1 for r in urgent if not r.ok or r.end > hi)
    bg_tokens = _tokens_in(background, lo, hi)
    urgent_tokens = _tokens_in(good_urgent, lo, hi)
    old_span = last_urgent - lo
    return {
        "label": args.label, "url": args.url, "background": args.background,
        "background_tokens": args.background_tokens, "urgent": args.urgent,
        "urgent_completed": len(good_urgent), "urgent_tokens": args.urgent_tokens,
        "errors": errors(background + urgent),
        "window_s": span,
        # False: some urgent work is not inside the window, so the background's figure is
        # not comparable with a server whose urgent work all is (widen --drain-s).
        "window_holds_urgent": outside == 0, "urgent_outside_window": outside,
        "urgent_ttft_p50_s": percentile(ttft, 50), "urgent_ttft_p99_s": percentile(ttft, 99),
        "background_tokens_per_s": bg_tokens / span,
        "total_tokens_per_s": (bg_tokens + urgent_tokens) / span,
        # The earlier definition: the window ends with the last urgent request.
        "window_to_last_urgent_s": old_span,
        "background_tokens_per_s_to_last_urgent":
            _tokens_in(background, lo, last_urgent) / old_span if old_span > 0 else None,
        "background_ttft_p50_s": percentile(bg_ttft, 50),
        "background_ttft_p99_s": percentile(bg_ttft, 99),
        "server_deltas": _deltas(*scraped) if len(scraped) == 2 else None,
    }


# -- compare: the servers ---------------------------------------------------------------------


def skippy_cmd(args, preemption: bool, reuse: bool) -> list[str]:
    """The server's command: preemption for priority on or off, the prefix store given by hand
    or left to the server's default (reuse sized from the context)."""
    cmd = [sys.executable, "-m", "skippy_scheduler.cli", "serve", "--model",
           os.path.abspath(args.model), "--host", "127.0.0.1", "--threads", str(args.threads),
           "--max-active", str(args.lanes), "--ctx-size", str(args.ctx_size),
           "--served-model-name", "bench", "--log-level", "warning"]
    if reuse:
        cmd += ["--prefix-cache-tokens", str(args.prefix_cache_tokens),
                "--prefix-holders", str(args.prefix_holders)]
    if not preemption:
        cmd.append("--no-priority-preemption")
    return cmd


def llama_server_cmd(args, path: str) -> list[str]:
    """llama-server with the kernels and options of BENCHMARKS.md "Serving against
    llama-server" (f32 KV, flash attention off, a KV stream per slot, continuous batching, the
    same batch), so it is the same-kernels reference; it has no priority field."""
    return [path, "-m", os.path.abspath(args.model), "--host", "127.0.0.1",
            "-t", str(args.threads), "-tb", str(args.threads), "-np", str(args.lanes),
            "-c", str(args.ctx_size), "-b", "512", "-ub", "512", "-ctk", "f32", "-ctv", "f32",
            "-fa", "off", "-no-kvu", "-cb", "--no-webui", "--alias", "bench"]


def compare(args) -> list[dict]:
    # Admission order is run twice: without a prefix store (the plain server) and with the
    # same store as the preempting server, so the last ratio isolates preemption itself.
    runs = [("skippy-preempt", skippy_cmd(args, True, True), {}),
            ("skippy-admission-order", skippy_cmd(args, False, False), {}),
            ("skippy-admission-order-reuse", skippy_cmd(args, False, True), {})]
    server = find_llama_server(args.llama_server)
    if server:
        runs.append(("llama-server", llama_server_cmd(args, server),
                     {"priority_field": "none", "token_ids": False}))
    results = []
    with tempfile.TemporaryDirectory(prefix="priority-load-") as logs:
        for label, cmd, overrides in runs:
            print(f"# {label}: {' '.join(cmd)}", file=sys.stderr, flush=True)
            served = Served(cmd, logs, label, args.start_timeout)
            try:
                run_args = argparse.Namespace(**{**vars(args), "url": served.url,
                                                 "label": label, "model_name": "bench",
                                                 **overrides})
                result = asyncio.run(run_load(run_args))
            finally:
                served.close()
            emit(result, args.json)
            results.append(result)
    on = results[0]
    for off in results[1:]:
        emit(_ratios(on, off), args.json)
    return results


def _ratios(on: dict, off: dict) -> dict:
    """Preemption's figures over another server's; `comparable` is False when either's urgent
    work was not all inside the window."""
    def ratio(key: str) -> float | None:
        a, b = on.get(key), off.get(key)
        return a / b if a is not None and b else None

    return {"label": f"ratios (preempt / {off['label'].removeprefix('skippy-')})",
            "comparable": on["window_holds_urgent"] and off["window_holds_urgent"],
            **{k: ratio(k + "_s") for k in ("urgent_ttft_p99", "urgent_ttft_p50")},
            **{k: ratio(k) for k in ("background_tokens_per_s", "total_tokens_per_s",
                                      "background_tokens_per_s_to_last_urgent")}}


# -- resume-cost ------------------------------------------------------------------------------


def resume_cost(args) -> dict:
    from skippy_scheduler import Scheduler, SchedulerConfig
    from skippy_scheduler.engine import Engine, Request
    from skippy_scheduler.hosts.llama import LlamaHost

    length = args.prompt_tokens + args.generated
    lane_cells = max(256, -(-(length + 16) // 256) * 256)
    out: dict[str, list[float]] = {"restore": [], "recompute": []}
    recomputed: dict[str, int] = {"restore": 0, "recompute": 0}  # replay tokens fed again
    for kind in ("restore", "recompute"):
        reuse = kind == "restore"
        holders = 2 if reuse else 0
        with LlamaHost(args.model, n_ctx=(1 + holders) * lane_cells, n_seq_max=1,
                       n_threads=args.threads, n_batch=args.batch,
                       prefix_cache_tokens=2 * lane_cells if reuse else 0,
                       prefix_holders=max(holders, 1)) as host:
            timed = _TimedResume(host)
            for rep in range(args.repeat):
                config = SchedulerConfig(max_active_sequences=1, max_tokens_per_iteration=host.n_batch,
                                         prefill_chunk_tokens=host.n_batch,
                                         priority_preemption=True,
                                         **(host.sequence_id_settings if reuse
                                            else {"reserved_sequence_ids": 0}))
                sched = Scheduler(config)
                engine = Engine(sched, host)
                prompt = [1] + [3 + (rep * 7919 + i * 104729) % (host.n_vocab - 3)
                                for i in range(args.prompt_tokens - 1)]
                engine.submit(Request("victim", prompt, args.generated + 2, sampling=None))
                while len(sched.sequence("victim").generated_tokens) < args.generated:
                    engine.step()
                engine.submit(Request("urgent", [1, 5, 6, 7], 1, priority=1))
                engine.step()  # the urgent one is queued and preempts the victim
                assert sched.metrics().preempted_priority == 1, "the victim was not preempted"
                while engine.outstanding > 1:  # the urgent one runs and ends
                    engine.step()
                timed.begin()
                while len(sched.sequence("victim").generated_tokens) == args.generated:
                    engine.step()
                out[kind].append(timed.end())
                recomputed[kind] += sched.metrics().recompute_tokens
                while engine.outstanding:
                    engine.step()
                sched.attach_prefix_store(None)
    return {"label": "resume-cost", "prompt_tokens": args.prompt_tokens,
            "generated": args.generated, "repeat": args.repeat,
            "restore_ms": statistics.median(out["restore"]),
            "recompute_ms": statistics.median(out["recompute"]),
            "restore_recomputed_tokens": recomputed["restore"],
            "recompute_recomputed_tokens": recomputed["recompute"]}


class _TimedResume:
    """Wall time of the host's executions between `begin` and `end` (ms)."""

    def __init__(self, host) -> None:
        self.host = host
        self._execute = host.execute
        self.total = 0.0
        self.on = False
        host.execute = self._timed

    def _timed(self, plan):
        t0 = time.perf_counter()
        try:
            return self._execute(plan)
        finally:
            if self.on:
                self.total += time.perf_counter() - t0

    def begin(self) -> None:
        self.total, self.on = 0.0, True

    def end(self) -> float:
        self.on = False
        return self.total * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    sub = ap.add_subparsers(dest="cmd", required=True)

    def load_options(p) -> None:
        p.add_argument("--background", type=int, default=16,
                       help="closed-loop low-priority clients (default 16: twice 8 lanes)")
        p.add_argument("--background-tokens", type=int, default=256)
        p.add_argument("--prompt-tokens", type=int, default=256)
        p.add_argument("--urgent", type=int, default=20)
        p.add_argument("--urgent-tokens", type=int, default=16)
        p.add_argument("--urgent-prompt-tokens", type=int, default=64)
        p.add_argument("--urgent-priority", type=int, default=10)
        p.add_argument("--urgent-interval", type=float, default=1.0, metavar="S")
        p.add_argument("--settle", type=float, default=2.0, metavar="S",
                       help="seconds of background alone before the first urgent request")
        p.add_argument("--drain-s", type=float, default=4.0, metavar="S",
                       help="the window's tail after the last urgent arrival (long enough "
                            "for every server's urgent work to end inside it: checked)")
        p.add_argument("--priority-field", default="priority",
                       help="request field carrying the priority; 'none' sends none")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--timeout", type=float, default=600)
        p.set_defaults(token_ids=True)  # this server's token_ids count exactly
        p.add_argument("--extra", type=json.loads, default={}, metavar="JSON")
        p.add_argument("--no-warmup", dest="warmup", action="store_false")
        p.add_argument("--json", help="append each result as one JSON line to this file")

    r = sub.add_parser("run", help="run the load against a server", allow_abbrev=False)
    r.add_argument("--url", required=True)
    r.add_argument("--label", default="")
    r.add_argument("--model-name", default=None, help="model field sent (default: none)")
    load_options(r)
    c = sub.add_parser("compare", help="this server with and without preemption "
                                       "(and llama-server)", allow_abbrev=False)
    c.add_argument("--model", required=True)
    c.add_argument("--lanes", type=int, default=8)
    c.add_argument("--ctx-size", type=int, default=8 * 1024)
    c.add_argument("--threads", type=int, default=2)
    c.add_argument("--prefix-cache-tokens", type=int, default=8 * 1024)
    c.add_argument("--prefix-holders", type=int, default=8)
    c.add_argument("--llama-server", default=None, metavar="PATH",
                   help="llama-server binary (default: $LLAMA_SERVER, else llama-server on "
                        "PATH; without one, llama-server is not run)")
    c.add_argument("--start-timeout", type=float, default=120)
    load_options(c)
    rc = sub.add_parser("resume-cost", help="restore vs recompute of one resume, in process",
                        allow_abbrev=False)
    rc.add_argument("--model", required=True)
    rc.add_argument("--prompt-tokens", type=int, default=256)
    rc.add_argument("--generated", type=int, default=128)
    rc.add_argument("--repeat", type=int, default=5)
    rc.add_argument("--threads", type=int, default=2)
    rc.add_argument("--batch", type=int, default=512)
    rc.add_argument("--json")
    args = ap.parse_args(argv)
    if args.cmd == "run":
        emit(asyncio.run(run_load(args)), args.json)
    elif args.cmd == "compare":
        compare(args)
    else:
        emit(resume_cost(args), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
