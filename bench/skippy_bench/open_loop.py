"""The open-loop load: a slice of a request trace replayed at its arrival times, whether or not
earlier requests have finished (`trace_load.py`, `serve_rounds.py --trace`, `trace_bound.py`).

The trace is read with the package's importer (`skippy_scheduler.lab.traces`); the rows from
`--start-s` seconds into it (for `--duration-s`, at most `--max-requests`) are replayed from the
slice's first arrival, with every gap multiplied by `--time-scale`. Lengths are scaled down to
what a small CPU model serves: prompt tokens x `--input-scale` within [`--min-input`,
`--max-input`] (BOS included), output tokens x `--output-scale` within [1, `--max-output`].

Prefix sharing follows the trace's `hash_ids`: each 512-token block of the trace becomes a run
of `--block-tokens` words (default 512 x input scale) drawn from the block id alone, and a
prompt is its blocks' runs in order, cut to its scaled length. Requests that share leading
block ids therefore share exactly those token prefixes, and nothing else. Each request is sent
as `loads.one` sends it.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import string
import sys
import time
from dataclasses import dataclass
from typing import Any, Optional

from skippy_scheduler.cli._common import positive_ms
from skippy_scheduler.lab.traces import BLOCK_TOKENS, open_trace

from .loads import Result, client, errors, one, request_args
from .reports import percentile

ITL_STATS = ("max", "p99", "p90", "mean")


@dataclass
class Planned:
    """One request of the replay: when it is sent (s after the replay starts) and what."""

    id: str
    at_s: float
    prompt: str
    prompt_tokens: int  # BOS + one per word
    max_tokens: int
    blocks: list[int]  # the trace's block ids the prompt is built from (possibly cut)
    shared_tokens: int  # leading words an earlier request of the replay carried too


def block_words(block_id: int, n: int, seed: int) -> list[str]:
    """The run of `n` single-letter words that stands for one trace block."""
    rng = random.Random(f"{seed}:{block_id}")
    return [rng.choice(string.ascii_lowercase) for _ in range(n)]


def scaled(value: int, scale: float, low: int, high: int) -> int:
    return max(low, min(high, round(value * scale)))


def plan_requests(args: argparse.Namespace) -> list[Planned]:
    """The replay's requests, from the trace slice, with scaled lengths and prompts."""
    trace = open_trace(args.trace, time_scale=args.time_scale)
    start_us = args.start_s * 1e6 * args.time_scale
    end_us = (math.inf if args.duration_s is None
              else start_us + args.duration_s * 1e6 * args.time_scale)
    bt = args.block_tokens
    sent: dict[int, int] = {}  # words of each block some earlier prompt carried
    out: list[Planned] = []
    for req in trace:
        if req.arrival_us < start_us:
            continue
        if req.arrival_us > end_us or len(out) >= args.max_requests:
            break
        blocks = [int(b) for b in req.blocks]
        words = scaled(req.input_length, args.input_scale, args.min_input, args.max_input) - 1
        words = max(1, min(words, len(blocks) * bt))
        used = blocks[: -(-words // bt)]
        body: list[str] = []
        for b in used:
            body += block_words(b, bt, args.seed)
        shared = 0
        for k, b in enumerate(used):  # a block's words are its run's first ones
            need = min(bt, words - k * bt)
            shared += min(need, sent.get(b, 0))
            if sent.get(b, 0) < need:
                break
        for k, b in enumerate(used):
            sent[b] = max(sent.get(b, 0), min(bt, words - k * bt))
        out.append(Planned(
            id=req.id, at_s=(req.arrival_us - start_us) / 1e6, prompt=" ".join(body[:words]),
            prompt_tokens=words + 1,
            max_tokens=scaled(req.output_length, args.output_scale, 1, args.max_output),
            blocks=used, shared_tokens=shared))
    if not out:
        raise SystemExit(f"trace_load: no request of {args.trace} arrives in the slice "
                         f"(start {args.start_s} s, duration {args.duration_s} s)")
    first = out[0].at_s
    for p in out:  # the replay starts with the slice's first arrival
        p.at_s -= first
    return out


@dataclass
class Outcome:
    """What became of one planned request."""

    planned: Planned
    lag_s: float = -1.0  # how late the client sent it (s); negative: never sent
    result: Optional[Result] = None  # its `end` stays 0 when the deadline cut it off


def itl_value(gaps: list[float], stat: str) -> float:
    if not gaps:
        return 0.0  # an answer streamed in one chunk has no gap to miss
    if stat == "mean":
        return sum(gaps) / len(gaps)
    if stat == "max":
        return max(gaps)
    return percentile(gaps, float(stat[1:]))


def meets_slo(r: Optional[Result], args: argparse.Namespace) -> bool:
    return (r is not None and r.ok and r.first - r.sent <= args.ttft_slo_s
            and itl_value(r.gaps, args.itl_stat) <= args.itl_slo_s)


MISS_REASONS = ("ttft", "gaps", "both", "unserved")


def slo_miss(o: Outcome, args: argparse.Namespace) -> Optional[str]:
    """Why a request sent is outside the SLO (None: within): "ttft" (only its first token was
    late), "gaps" (only its `--itl-stat` gap was over), "both", or "unserved" (it failed, a
    503 included, or was cut off)."""
    r = o.result
    if r is None or r.end <= 0 or not r.ok:
        return "unserved"
    late = r.first - r.sent > args.ttft_slo_s
    gappy = itl_value(r.gaps, args.itl_stat) > args.itl_slo_s
    return "both" if late and gappy else "ttft" if late else "gaps" if gappy else None


def _request_args(max_tokens: int, args: argparse.Namespace) -> argparse.Namespace:
    return request_args(max_tokens, args.model, args.token_ids, args.extra)


async def _progress(outcomes: list[Outcome], t0: float, args: argparse.Namespace) -> None:
    while True:
        await asyncio.sleep(args.progress_s)
        sent = sum(o.lag_s >= 0 for o in outcomes)
        done = [o.result for o in outcomes if o.result is not None and o.result.end > 0]
        within = sum(meets_slo(r, args) for r in done)
        print(f"trace_load: {time.perf_counter() - t0:7.1f} s  sent {sent}/{len(outcomes)}  "
              f"done {len(done)}  within SLO {within}", file=sys.stderr, flush=True)


async def replay(plan: list[Planned], args: argparse.Namespace) -> tuple[list[Outcome], float]:
    """Send every planned request at its time; returns the outcomes and the wall time."""
    outcomes = [Outcome(p) for p in plan]
    async with client(args.url, args.timeout, args.max_connections) as c:
        if args.warmup:
            head = plan[0].prompt
            await one(c, head[: max(len(head) // 8, 1)], _request_args(4, args))

        async def send(o: Outcome) -> None:
            o.result = Result(sent=time.perf_counter())  # what stays if it is cut off
            r = o.result = await one(c, o.planned.prompt,
                                     _request_args(o.planned.max_tokens, args))
            if r.end <= 0 and r.status:  # answered with an error (a shedding server's 503):
                r.end = time.perf_counter()  # it ended, failed, rather than being cut off

        t0 = time.perf_counter()
        deadline = t0 + args.run_timeout
        ticker = (asyncio.ensure_future(_progress(outcomes, t0, args))
                  if args.progress_s > 0 else None)
        tasks = []
        for o in outcomes:
            at = t0 + o.planned.at_s
            if at > deadline:
                break
            delay = at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            o.lag_s = max(time.perf_counter() - at, 0.0)
            tasks.append(asyncio.ensure_future(send(o)))
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=max(deadline - time.perf_counter(),
                                                               0.0))
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        if ticker is not None:
            ticker.cancel()
            await asyncio.gather(ticker, return_exceptions=True)
        wall = time.perf_counter() - t0
    return outcomes, wall


def report(plan: list[Planned], outcomes: list[Outcome], wall: float,
           args: argparse.Namespace) -> dict[str, Any]:
    sent = [o for o in outcomes if o.lag_s >= 0]
    ended = [o.result for o in sent if o.result is not None and o.result.end > 0]
    good = [r for r in ended if r.ok]
    within = [r for r in good if meets_slo(r, args)]
    ttft = [r.first - r.sent for r in good]
    gaps = [g for r in good for g in r.gaps]
    stalls = [sum(g > args.itl_slo_s for g in r.gaps) for r in good]
    tokens = sum(r.tokens for r in good)
    span = plan[-1].at_s - plan[0].at_s
    lags = [o.lag_s for o in sent]
    arrivals: dict[float, int] = {}
    for p in plan:
        arrivals[p.at_s] = arrivals.get(p.at_s, 0) + 1
    n = len(sent)
    misses = [slo_miss(o, args) for o in sent]

    def rate(x: float, t: float) -> Optional[float]:
        return x / t if t > 0 else None

    return {
        "label": args.label, "url": args.url, "trace": args.trace, "start_s": args.start_s,
        "duration_s": args.duration_s, "time_scale": args.time_scale,
        "input_scale": args.input_scale, "output_scale": args.output_scale,
        "block_tokens": args.block_tokens, "max_input": args.max_input,
        "max_output": args.max_output, "seed": args.seed,
        "ttft_slo_s": args.ttft_slo_s, "itl_slo_s": args.itl_slo_s, "itl_stat": args.itl_stat,
        "requests": len(plan), "sent": n, "completed": len(good),
        "failed": len(ended) - len(good), "cut_off": n - len(ended),
        "refused_503": sum(r.status == 503 for r in ended),  # overload, or a server shedding
        "errors": errors(ended),
        "prompt_tokens_mean": sum(p.prompt_tokens for p in plan) / len(plan),
        "prefix_shared_pct": 100 * sum(p.shared_tokens for p in plan)
        / sum(p.prompt_tokens for p in plan),
        "max_burst": max(arrivals.values()),
        "slo_met": len(within), "slo_attainment_pct": 100 * len(within) / n if n else 0.0,
        "goodput_rps": rate(len(within), wall),
        # Misses by reason (ttft, gaps, both, unserved; `slo_miss`): with slo_met, every request
        # sent.
        **{f"slo_missed_{why}": misses.count(why) for why in MISS_REASONS},
        "goodput_tokens_per_s": rate(sum(r.tokens for r in within), wall),
        "offered_rps": rate(len(plan), span),
        "offered_output_tokens_per_s": rate(sum(p.max_tokens for p in plan), span),
        "offered_prompt_tokens_per_s": rate(sum(p.prompt_tokens for p in plan), span),
        "achieved_rps": rate(len(good), wall),
        "output_tokens": tokens, "output_tokens_per_s": rate(tokens, wall),
        "short_outputs": sum(r.tokens < o.planned.max_tokens for o in sent
                             if (r := o.result) is not None and r.ok and r.end > 0),
        "wall_s": wall,
        "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
        "itl_p50_s": percentile(gaps, 50), "itl_p99_s": percentile(gaps, 99),
        "itl_max_s": max(gaps) if gaps else float("nan"),
        "stalls": sum(stalls), "stalls_per_request_mean": sum(stalls) / len(stalls)
        if stalls else 0.0, "stalls_per_request_max": max(stalls, default=0),
        "requests_with_stalls": sum(s > 0 for s in stalls),
        "client_lag_p99_s": percentile(lags, 99), "client_lag_max_s": max(lags, default=0.0),
    }


def request_rows(outcomes: list[Outcome], args: argparse.Namespace) -> list[dict[str, Any]]:
    """One record per planned request (for `--requests-out`): what it asked, what it got."""
    rows = []
    for o in outcomes:
        p, r = o.planned, o.result
        ended = r is not None and r.end > 0
        row: dict[str, Any] = {
            "id": p.id, "at_s": p.at_s, "prompt_tokens": p.prompt_tokens,
            "shared_tokens": p.shared_tokens, "max_tokens": p.max_tokens,
            "state": ("not sent" if o.lag_s < 0 else "cut off" if not ended
                      else "completed" if r is not None and r.ok else "failed"),
            "lag_s": max(o.lag_s, 0.0), "within_slo": meets_slo(r, args) if ended else False,
            "slo_miss": slo_miss(o, args) if o.lag_s >= 0 else "unserved"}
        if r is not None and ended:
            row.update(status=r.status, error=r.error, tokens=r.tokens,
                       ttft_s=r.first - r.sent if r.ok else None, e2e_s=r.end - r.sent,
                       chunks=len(r.gaps) + 1 if r.ok else 0,
                       itl_max_s=max(r.gaps, default=0.0),
                       stalls=sum(g > args.itl_slo_s for g in r.gaps))
        rows.append(row)
    return rows


def build_parser(description: Optional[str] = None) -> argparse.ArgumentParser:
    """The replay's options (`trace_load.py`'s command line)."""
    ap = argparse.ArgumentParser(description=description, allow_abbrev=False)
    ap.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    ap.add_argument("--trace", required=True, help="a trace file (Mooncake JSONL, Azure CSV)")
    ap.add_argument("--label", default="", help="name of the server in the output")
    ap.add_argument("--model", default=None,
                    help="model field sent with each request (default: none, the served one)")
    ap.add_argument("--start-s", type=float, default=0.0,
                    help="where the slice starts, in trace seconds")
    ap.add_argument("--duration-s", type=float, default=None,
                    help="length of the slice in trace seconds (default: to --max-requests)")
    ap.add_argument("--max-requests", type=int, default=100)
    ap.add_argument("--time-scale", type=float, default=1.0,
                    help="multiplies every arrival gap (4: four times slower than recorded)")
    ap.add_argument("--input-scale", type=float, default=1 / 32)
    ap.add_argument("--output-scale", type=float, default=1 / 8)
    ap.add_argument("--min-input", type=int, default=2)
    ap.add_argument("--max-input", type=int, default=768)
    ap.add_argument("--max-output", type=int, default=128)
    ap.add_argument("--block-tokens", type=int, default=None,
                    help="words per trace block (default: 512 x input scale)")
    ap.add_argument("--ttft-slo-s", type=float, default=2.0,
                    help="the SLO's first-token bound, seconds (default: 2)")
    ap.add_argument("--itl-slo-s", type=float, default=0.2,
                    help="the SLO's bound on the --itl-stat gap, seconds (default: 0.2)")
    ap.add_argument("--slo-ttft-ms", dest="ttft_slo_s", type=_ms_as_s,
                    default=argparse.SUPPRESS, metavar="MS",
                    help="--ttft-slo-s in ms, spelled as `serve --slo-ttft-ms` (the server is "
                         "told the SLO by its own flags; this only measures)")
    ap.add_argument("--slo-itl-ms", dest="itl_slo_s", type=_ms_as_s,
                    default=argparse.SUPPRESS, metavar="MS",
                    help="--itl-slo-s in ms, spelled as `serve --slo-itl-ms`")
    ap.add_argument("--itl-stat", choices=ITL_STATS, default="max",
                    help="which of a request's gaps must stay under --itl-slo-s")
    ap.add_argument("--seed", type=int, default=0, help="of the words standing for blocks")
    ap.add_argument("--timeout", type=float, default=600, help="per request, seconds")
    ap.add_argument("--run-timeout", type=float, default=1800,
                    help="the whole replay, seconds: later arrivals are not sent, requests "
                         "still running are cut off (both count as outside the SLO)")
    ap.add_argument("--max-connections", type=int, default=512)
    ap.add_argument("--token-ids", action="store_true",
                    help="ask for token_ids per chunk (this server's extension) to count tokens")
    ap.add_argument("--extra", type=json.loads, default={}, metavar="JSON",
                    help="fields merged into every request body")
    ap.add_argument("--no-warmup", dest="warmup", action="store_false")
    ap.add_argument("--progress-s", type=float, default=5.0,
                    help="seconds between progress lines on stderr (0: none)")
    ap.add_argument("--json", help="append the result as one JSON line to this file")
    ap.add_argument("--requests-out", metavar="FILE",
                    help="write one JSON line per request (times, tokens, stalls) to this file")
    return ap


def _ms_as_s(text: str) -> float:
    """A finite number of ms > 0, in seconds."""
    return positive_ms(text) / 1e3


def check_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse options out of range (through `ap.error`); the default `--block-tokens`."""
    if args.block_tokens is None:
        args.block_tokens = max(1, round(BLOCK_TOKENS * args.input_scale))
    for name in ("time_scale", "input_scale", "output_scale", "ttft_slo_s", "itl_slo_s",
                 "timeout", "run_timeout"):
        value = getattr(args, name)
        if not (math.isfinite(value) and value > 0):
            ap.error(f"--{name.replace('_', '-')} must be a finite number > 0, got {value}")
    for name in ("max_requests", "min_input", "max_output", "block_tokens", "max_connections"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 2 <= args.min_input <= args.max_input:
        ap.error(f"need 2 <= --min-input <= --max-input, got {args.min_input}, "
                 f"{args.max_input}")
    if args.start_s < 0 or (args.duration_s is not None and args.duration_s <= 0):
        ap.error("--start-s must be >= 0 and --duration-s > 0")
    if not isinstance(args.extra, dict):
        ap.error("--extra must be a JSON object")
