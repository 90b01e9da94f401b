"""Ranking microbenchmark: the native kernel against the pure-Python twin (behaviour.md §3).

Workload: W waiting prompts of 512 tokens; half of them start with one of 16 shared 256-token
prefixes, the rest are unrelated; equal priority, equal enqueue turn (so every candidate ties
on score and the waiting-prefix DFS decides), grouping on. A second row per W spreads the
enqueue turns over 12 turns (three score bands).

Run: python bench/bench_rank.py [--quick]
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import time

from skippy_scheduler import _rank
from skippy_scheduler.cache_policy import (
    CacheAffinity,
    CacheAwareCandidate,
    order_cache_aware_candidates,
)
from skippy_scheduler.reference import reference_order

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


def timed(fn, repeats: int, cpu: list[float] | None = None) -> list[float]:
    """Wall-clock microseconds per call; thread CPU microseconds go to `cpu` when given."""
    out = []
    for _ in range(repeats):
        c0 = time.thread_time_ns()
        t0 = time.perf_counter_ns()
        fn()
        out.append((time.perf_counter_ns() - t0) / 1000.0)
        if cpu is not None:
            cpu.append((time.thread_time_ns() - c0) / 1000.0)
    return out


def summary(samples: list[float]) -> tuple[float, float]:
    s = sorted(samples)
    return statistics.median(s), s[min(len(s) - 1, int(round(0.99 * (len(s) - 1))))]


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False)
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
            kernel_cpu: list[float] = []
            kernel = summary(timed(lambda: packed.rank_only(turn, aging, True), reps, kernel_cpu))
            # One arrival into a persistent ranked set holding the other W candidates.
            rs = _rank.RankSet()
            for c in cands:
                rs.add(c.priority, c.affinity.estimated_saved_cost(), c.enqueued_turn, c.order,
                       c.prompt_tokens)
            newcomer = workload(1, seed=99 + w)[0]
            samples, arrival_cpu = [], []
            for i in range(reps):
                c0 = time.thread_time_ns()
                t0 = time.perf_counter_ns()
                h = rs.add(0, 0, turn, w + i, newcomer.prompt_tokens)
                rs.rank_only(turn, aging, True)
                samples.append((time.perf_counter_ns() - t0) / 1000.0)
                arrival_cpu.append((time.thread_time_ns() - c0) / 1000.0)
                rs.remove(h)
            arrival = summary(samples)
            rs.add(0, 0, turn, w, newcomer.prompt_tokens)
            with_newcomer = cands + [CacheAwareCandidate(w, 0, CacheAffinity(),
                                                         newcomer.prompt_tokens, turn, w)]
            assert rs.order(turn, aging, True) == _rank.PackedCandidates(with_newcomer).positions(
                turn, aging, True)
            api = summary(timed(
                lambda: order_cache_aware_candidates(cands, turn, aging, True),
                max(3, reps // 20)))
            twin_reps = 3 if w == 10_000 else 10
            twin = summary(timed(
                lambda: reference_order(cands, turn, aging, True), twin_reps))
            assert packed.order(turn, aging, True) == reference_order(
                cands, turn, aging, True)
            rows.append((w, "spread" if spread else "same", kernel,
                         statistics.median(kernel_cpu), arrival, statistics.median(arrival_cpu),
                         api, twin))

    print(f"load average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print("W\tturns\tfull_med_us\tfull_p99_us\tfull_cpu_med_us\tarrival_med_us\t"
          "arrival_p99_us\tarrival_cpu_med_us\tapi_med_us\ttwin_med_us\tfull/twin\tapi/twin")
    for w, turns, kernel, kcpu, arrival, acpu, api, twin in rows:
        print(f"{w}\t{turns}\t{kernel[0]:.1f}\t{kernel[1]:.1f}\t{kcpu:.1f}\t{arrival[0]:.1f}\t"
              f"{arrival[1]:.1f}\t{acpu:.1f}\t{api[0]:.1f}\t{twin[0]:.1f}\t"
              f"{kernel[0] / twin[0]:.5f}\t{api[0] / twin[0]:.4f}")
    print("kernel = sk_rank_order on a packed queue, full rank (GIL released, result kept "
          "native);\narrival = one new candidate added to a persistent sk_rank_set of W, then "
          "a re-rank of W+1;\napi = order_cache_aware_candidates including validation and "
          "token conversion;\ntwin = skippy_scheduler.reference.order_cache_aware_candidates; "
          "*_us are wall clock,\n*_cpu_* the calling thread's CPU time (excludes time lost to "
          "other processes).")


if __name__ == "__main__":
    main()
