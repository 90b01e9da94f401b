"""The `skippy-scheduler bench` report: every workload on each implementation, as a table.

Times on shared machines are noisy: compare ratios measured in one run, and use the callgrind
instruction counts of BENCHMARKS.md for anything finer.
"""
from __future__ import annotations

import os
import sys
import tempfile
from typing import Any, Callable

from .._core import Scheduler
from .c_api import build_c, callgrind_per_step, run_c
from .timing import Result, measure, measure_pairs, measure_ranking, summary
from .workloads import (IMPLEMENTATIONS, SLACK_SAME_PLANS, admission_churn, mixed_decode_prefill,
                        steady_decode, steady_decode_inflight)


def _result(workload: str, impl: str, size: int, unit: str, per: int, samples: list[int],
            note: str = "") -> Result:
    med, p99 = summary(samples)
    return Result(workload, impl, size, unit, per, med, p99, len(samples), note)


def slack_pairs(steps: int, budget: float, log: Callable[[str], object]) -> list[Result]:
    """The slack rule's per-step cost against the reference rule's, paired sample by sample
    (one run, so load hits both alike), at N = 256 and 1 024: steady decode (the rule only
    stamps last-token times) and decode + 256-token chunk (it also reads every row's slack)."""
    results = []
    for n in (256, 1024):
        def decode(cfg: dict[str, Any], n: int = n) -> Callable[[], object]:
            return steady_decode(Scheduler, n, **cfg)

        def mixed(cfg: dict[str, Any], n: int = n) -> Callable[[], object]:
            return mixed_decode_prefill(Scheduler, n, steps=2 * steps + 80, **cfg)

        for name, make in (("decode", decode), ("mixed: decode + 256-token chunk", mixed)):
            log(f"{name} N={n}, reference and slack rule ...")
            ref, slack = measure_pairs(make({}), make(SLACK_SAME_PLANS), steps, budget)
            ratio = summary(slack)[0] / summary(ref)[0]
            rows = n + 1 if name.startswith("mixed") else n
            results.append(_result(f"{name}, reference rule (paired)", "native", n, "row", rows,
                                   ref))
            results.append(_result(f"{name}, slack rule (paired)", "native", n, "row", rows,
                                   slack, note=f"slack / reference = {ratio:.2f}"))
    return results


def collect(quick: bool = False, twin: bool = True, c_api: bool = True, callgrind: bool = False,
            log: Callable[[str], object] = print,
            slack: bool = False) -> tuple[list[Result], list[str]]:
    sizes = (64, 256, 1024)
    steps = 300 if quick else 3000
    budget = 1.0 if quick else 4.0
    impls = ["native"] + (["twin"] if twin else [])
    results: list[Result] = []
    notes: list[str] = []

    for n in sizes:
        for impl in impls:
            log(f"steady decode N={n} {impl} ...")
            st = steady_decode(IMPLEMENTATIONS[impl], n)
            results.append(_result("decode", impl, n, "row", n,
                                   measure(st, steps if impl == "native" else steps // 10, budget_s=budget)))
    for n in (256, 1024):
        # Depth 1 and depth 2 alternate sample by sample, so load hits both alike: the ratio is
        # measured in one run.
        log(f"steady decode N={n}, depth 1 and 2 ...")
        depth1, depth2 = measure_pairs(steady_decode_inflight(Scheduler, n, 1),
                                       steady_decode_inflight(Scheduler, n, 2), steps, budget)
        ratio = summary(depth2)[0] / summary(depth1)[0]
        results.append(_result("decode, depth 1 (paired)", "native", n, "row", n, depth1))
        results.append(_result("decode, depth 2 (paired)", "native", n, "row", n, depth2,
                               note=f"depth 2 / depth 1 = {ratio:.2f}"))

    if c_api:
        with tempfile.TemporaryDirectory() as d:
            exe, msg = build_c(d)
            if exe is None:
                notes.append(msg)
            else:
                notes.append(f"C API rows: {msg}")
                for n in sizes:
                    log(f"C API decode N={n} ...")
                    med, p99, k = run_c(exe, n, 512, steps * 2)
                    results.append(Result("decode (C API)", "C", n, "row", n, med, p99, k))
                med, p99, k = run_c(exe, 256, 8192, steps * 2)
                results.append(Result("decode (C API), 8192-token prompts", "C", 256, "row", 256, med, p99, k))
                if callgrind:
                    for n, prompt in ((64, 512), (256, 512), (1024, 512), (256, 8192)):
                        log(f"callgrind N={n} prompt={prompt} ...")
                        ins = callgrind_per_step(exe, n, prompt)
                        notes.append("callgrind: valgrind not available" if ins is None else
                                     f"callgrind, one C API decode step at N={n}, {prompt}-token "
                                     f"prompts: {ins} instructions ({ins / n:.1f} per row)")

    for impl in impls:
        log(f"context length 8192 {impl} ...")
        st = steady_decode(IMPLEMENTATIONS[impl], 256, prompt=8192)
        results.append(_result("decode, 8192-token prompts", impl, 256, "row", 256,
                               measure(st, steps if impl == "native" else steps // 10, budget_s=budget)))

    for n in (64, 256):
        for impl in impls:
            log(f"mixed N={n} {impl} ...")
            k = steps if impl == "native" else steps // 10
            st = mixed_decode_prefill(IMPLEMENTATIONS[impl], n, steps=k + 40)
            results.append(_result("mixed: decode + 256-token chunk", impl, n, "row", n + 1,
                                   measure(st, k, budget_s=budget)))
            log(f"admission churn N={n} {impl} ...")
            arrive, finish = admission_churn(IMPLEMENTATIONS[impl], n)
            a, b = measure_pairs(arrive, finish, steps // 2 if impl == "native" else steps // 20, budget)
            results.append(_result("arrival: submit+admit+prefill", impl, n, "row", n, a))
            results.append(_result("decode step with one finish", impl, n, "row", n, b))

    if slack:
        results.extend(slack_pairs(steps, budget, log))

    for w in (1000, 10000):
        for impl in impls:
            log(f"ranking W={w} {impl} ...")
            reps = (60 if w == 1000 else 20) if impl == "native" else (10 if w == 1000 else 3)
            if quick:
                reps = max(3, reps // 4)
            dirty, clean = measure_ranking(IMPLEMENTATIONS[impl], w, reps, budget_s=budget * 3)
            results.append(_result("admission ranking (dirty queue)", impl, w, "waiting", w, dirty,
                                   note="64 active, plan after cancel+submit"))
            results.append(_result("same plan, clean queue", impl, w, "waiting", w, clean))
    return results, notes


def format_table(results: list[Result]) -> str:
    native = {(r.workload, r.size): r for r in results if r.impl == "native"}
    head = (f"{'workload':<38} {'impl':<6} {'N/W':>6} {'median µs':>10} {'p99 µs':>10} "
            f"{'per row/req':>12} {'twin/native':>11}")
    lines = [head, "-" * len(head)]
    for r in results:
        ratio = ""
        if r.impl == "twin" and (r.workload, r.size) in native:
            ratio = f"{r.median_ns / native[(r.workload, r.size)].median_ns:.1f}x"
        per = f"{r.per_unit_ns:.1f} ns" if r.per_unit_ns < 10_000 else f"{r.per_unit_ns / 1e3:.1f} µs"
        lines.append(f"{r.workload:<38} {r.impl:<6} {r.size:>6} {r.median_us:>10.2f} "
                     f"{r.p99_us:>10.2f} {per:>12} {ratio:>11}")
    return "\n".join(lines)


def context_line(results: list[Result]) -> str:
    parts = []
    for impl in ("native", "C", "twin"):
        short = [r for r in results if r.impl == impl and r.size == 256 and r.workload.startswith("decode")]
        a = [r for r in short if "8192" not in r.workload]
        b = [r for r in short if "8192" in r.workload]
        if a and b:
            parts.append(f"{impl}: {a[0].median_us:.2f} µs at 512 vs {b[0].median_us:.2f} µs at 8192 "
                         f"({b[0].median_ns / a[0].median_ns:.2f}x)")
    return "context length, N=256 decode step: " + "; ".join(parts)


def machine() -> str:
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{model or 'unknown CPU'}, {os.cpu_count()} logical CPUs, Python {sys.version.split()[0]}"
