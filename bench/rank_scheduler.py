"""Waiting-queue ranking through the scheduler: what a dirty `plan_iteration()` costs.

Workload (as in bench_rank.py): W waiting prompts of 512 tokens, half of them starting with one
of 16 shared 256-token prefixes, all other tokens random; equal priority; grouping on (the
default CACHE_AWARE policy). 64 sequences are decoding and fill the active set, so every plan
re-ranks the whole queue when it is dirty and admits nothing.

Rows:
  * full re-rank: the first plan after W submits (a fresh scheduler per sample);
  * submit one: one more `submit()` into the queue of W;
  * plan after one arrival: the plan right after that submit (a dirty queue of W + 1).

Run: python bench/rank_scheduler.py [--quick] [--no-twin] [--sizes 1000,10000] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

from skippy_scheduler import Scheduler, SchedulerConfig, Sequence, TwinScheduler
from skippy_scheduler.bench import BenchHost
from skippy_scheduler.engine import Engine

IMPLS = {"native": Scheduler, "twin": TwinScheduler}
ACTIVE = 64
PROMPT = 512
SHARED = 256
GROUPS = 16
LONG = 1 << 30


def prompts(count: int, seed: int = 7) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    heads = rng.integers(0, 32000, (GROUPS, SHARED))
    body = rng.integers(0, 32000, (count, PROMPT))
    body[0::2, :SHARED] = heads[rng.integers(0, GROUPS, (count + 1) // 2)]
    return body.tolist()


def build(cls, w: int, extra: int, pool: list[list[int]]) -> Engine:
    s = cls(SchedulerConfig(max_active_sequences=ACTIVE, sequence_id_limit=ACTIVE + 16,
                            max_waiting_sequences=w + extra + 16, max_tokens_per_iteration=2048,
                            group_waiting_prefixes=True))
    engine = Engine(s, BenchHost(), clock=None, record=False)
    engine.profile = True  # the engine times plan_iteration (last_plan_ns)
    busy = [(i * 7919) % 32000 for i in range(PROMPT)]
    for i in range(ACTIVE):
        engine.submit(Sequence(f"d{i}", busy, LONG).with_prefilled_generation([1]))
    engine.step()  # fills the active set while the queue is still empty
    for i in range(w):
        engine.submit(Sequence(f"w{i}", pool[i], LONG))
    return engine


def step(engine: Engine) -> int:
    """One engine step; the time its plan_iteration took (ns)."""
    engine.step()
    assert engine.last_telemetry.admitted == 0
    return engine.last_plan_ns


def run_one(impl: str, w: int, full_reps: int, arrivals: int) -> dict[str, float]:
    cls = IMPLS[impl]
    pool = prompts(w + arrivals)
    full = []
    for _ in range(full_reps):
        s = build(cls, w, arrivals, pool)
        full.append(step(s))
    seqs = [Sequence(f"a{i}", pool[w + i], LONG) for i in range(arrivals)]
    sub, plan = [], []
    for q in seqs:
        t0 = time.perf_counter_ns()
        s.submit(q)  # through the engine: the submit a serving loop makes
        sub.append(time.perf_counter_ns() - t0)
        plan.append(step(s))
    return {"full re-rank (first plan after W submits)": statistics.median(full) / 1e3,
            "submit one": statistics.median(sub) / 1e3,
            "plan after one arrival": statistics.median(plan) / 1e3}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-twin", action="store_true")
    ap.add_argument("--sizes", default="1000,10000")
    ap.add_argument("--json", help="also write the medians (µs) to this file")
    args = ap.parse_args(argv)
    sizes = [int(x) for x in args.sizes.split(",")]
    impls = ["native"] + ([] if args.no_twin else ["twin"])
    out: dict[str, dict[str, float]] = {}
    for w in sizes:
        for impl in impls:
            print(f"W={w} {impl} ...", file=sys.stderr, flush=True)
            big = w >= 5000
            if impl == "native":
                reps, arr = (3, 15) if args.quick else ((7, 60) if big else (15, 200))
            else:
                reps, arr = (1, 3) if args.quick else ((2, 5) if big else (3, 10))
            out[f"{impl} {w}"] = run_one(impl, w, reps, arr)
    head = f"{'operation':<44} {'W':>6} {'native µs':>11} {'twin µs':>11} {'twin/native':>11}"
    print(head)
    print("-" * len(head))
    for w in sizes:
        nat = out[f"native {w}"]
        twin = out.get(f"twin {w}")
        for op, v in nat.items():
            t = twin[op] if twin else float("nan")
            ratio = f"{t / v:.1f}x" if twin else ""
            print(f"{op:<44} {w:>6} {v:>11.1f} {t:>11.1f} {ratio:>11}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
