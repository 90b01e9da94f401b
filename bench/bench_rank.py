"""Ranking microbenchmark: the native kernel against the pure-Python twin (behaviour.md §3).

Workload: W waiting prompts of 512 tokens; half of them start with one of 16 shared 256-token
prefixes, the rest are unrelated; equal priority, equal enqueue turn (so every candidate ties
on score and the waiting-prefix DFS decides), grouping on.

Run: python bench/bench_rank.py [--quick]
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

from skippy_scheduler import _rank
from skippy_scheduler._ordering import order_cache_aware_candidates_py
from skippy_scheduler.cache_policy import (
    CacheAffinity,
    CacheAwareCandidate,
    order_cache_aware_candidates,
)

PROMPT = 512
SHARED = 256
GROUPS = 16
VOCAB = 32_000


def workload(w: int, seed: int = 7, spread_turns: bool = False) -> list[CacheAwareCandidate]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(VOCAB) for _ in range(SHARED)] for _ in range(GROUPS)]
    cold = CacheAffinity()
    cands = []
    for i in range(w):
        if i % 2 == 0:
            head = prefixes[rng.randrange(GROUPS)]
            tokens = head + [rng.randrange(VOCAB) for _ in range(PROMPT - SHARED)]
        else:
            tokens = [rng.randrange(VOCAB) for _ in range(PROMPT)]
        turn = rng.randrange(12) if spread_turns else 0
        cands.append(CacheAwareCandidate(i, 0, cold, tokens, turn, i))
    rng.shuffle(cands)
    return cands


def timed(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        fn()
        out.append((time.perf_counter_ns() - t0) / 1000.0)
    return out


def summary(samples: list[float]) -> tuple[float, float]:
    s = sorted(samples)
    return statistics.median(s), s[min(len(s) - 1, int(round(0.99 * (len(s) - 1))))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    args = ap.parse_args()
    turn, aging = 12, 4096
    rows = []
    for w in (1_000, 10_000):
        for spread in (False, True):
            cands = workload(w, spread_turns=spread)
            packed = _rank.PackedCandidates(cands)
            reps = (50 if args.quick else 400) if w == 1_000 else (20 if args.quick else 200)
            packed.rank_only(turn, aging, True)  # warm the workspace
            kernel = summary(timed(lambda: packed.rank_only(turn, aging, True), reps))
            # One arrival: the packed queue plus one more candidate, ranked from scratch.
            grown = _rank.PackedCandidates(cands + workload(1, seed=99 + w))
            grown.rank_only(turn, aging, True)
            arrival = summary(timed(lambda: grown.rank_only(turn, aging, True), reps))
            api = summary(timed(
                lambda: order_cache_aware_candidates(cands, turn, aging, True),
                max(3, reps // 20)))
            twin_reps = 3 if w == 10_000 else 10
            twin = summary(timed(
                lambda: order_cache_aware_candidates_py(cands, turn, aging, True), twin_reps))
            assert packed.order(turn, aging, True) == order_cache_aware_candidates_py(
                cands, turn, aging, True)
            rows.append((w, "spread" if spread else "same", kernel, arrival, api, twin))

    print("W\tturns\tkernel_med_us\tkernel_p99_us\tarrival_med_us\tarrival_p99_us\t"
          "api_med_us\ttwin_med_us\tkernel/twin\tapi/twin")
    for w, turns, kernel, arrival, api, twin in rows:
        print(f"{w}\t{turns}\t{kernel[0]:.1f}\t{kernel[1]:.1f}\t{arrival[0]:.1f}\t"
              f"{arrival[1]:.1f}\t{api[0]:.1f}\t{twin[0]:.1f}\t{kernel[0] / twin[0]:.5f}\t"
              f"{api[0] / twin[0]:.4f}")
    print("kernel = sk_rank_order on a packed queue (GIL released, result kept native); "
          "arrival = the same\nafter one more candidate, ranked from scratch; api = "
          "order_cache_aware_candidates including\nvalidation and token conversion; "
          "twin = skippy_scheduler._ordering.order_cache_aware_candidates_py")


if __name__ == "__main__":
    main()
