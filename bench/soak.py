#!/usr/bin/env python3
"""Soak test: a long steady workload on the native scheduler, watching resident memory.

The engine drives the scheduler (no clock, no recorder) with a host that samples random tokens
into the plan's native outputs block, as a runtime would. Requests arrive at a steady rate, finish by length or end-of-sequence, some are
cancelled (waiting or active) and memory pressure preempts now and then. Resident memory is
read from /proc/self/statm after the warm-up and at the end; the run fails (exit 1) when the end
value is more than 5% above the warm-up value.

    python bench/soak.py                    # 1 000 000 iterations
    python bench/soak.py --iterations 20000 --warmup 5000
"""
import argparse
import os
import random
import sys
import time

from skippy_scheduler import MemoryComponent, Scheduler, SchedulerConfig, Sequence
from skippy_scheduler.engine import Engine

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class SoakHost:
    """Random tokens: 1 in 64 samples ends its sequence, 1 in 4096 plans leaves one sampling row
    without an output (its sequence fails)."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def execute(self, plan) -> None:
        rng = self.rng
        rows = plan.sample_rows
        k = len(rows)
        if k:
            out = plan.outputs
            out.request_indexes[:k] = rows
            tokens = out.predicted_tokens
            for j in range(k):
                tokens[j] = -1 if rng.randrange(64) == 0 else rng.randrange(32000)
            if rng.randrange(4096) == 0:
                k -= 1
            out.count = k
        else:
            plan.outputs.count = 0

    def release(self, sequence_id: str, reason: object = None) -> None:
        pass


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--iterations", type=int, default=1_000_000)
    ap.add_argument("--warmup", type=int, default=100_000)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--limit", type=float, default=1.05, help="maximum end/warm-up RSS ratio")
    args = ap.parse_args(argv)

    rng = random.Random(args.seed)
    kv = MemoryComponent("kv", capacity_bytes=64 * 2400, resident_bytes=0, bytes_per_token=64, bytes_per_sequence=0)
    state = MemoryComponent("recurrent", capacity_bytes=48 * 4096, resident_bytes=0, bytes_per_token=0,
                            bytes_per_sequence=4096)
    config = SchedulerConfig(max_active_sequences=48, max_waiting_sequences=256, max_tokens_per_iteration=512,
                             prefill_chunk_tokens=64, max_consecutive_prefill_iterations=2,
                             memory_components=[kv, state])
    s = Scheduler(config)
    engine = Engine(s, SoakHost(rng), clock=None, record=False)
    prefixes = [[rng.randrange(32000) for _ in range(48)] for _ in range(8)]  # shared system prompts
    next_id = 0
    counts = {"submitted": 0, "finished": 0, "failed": 0, "cancelled": 0, "preempted": 0, "rejected": 0,
              "unknown cancels": 0, "idle steps": 0}
    warm_rss = None
    start = time.perf_counter()
    warm_time = None

    for it in range(args.iterations):
        # ~0.3 arrivals per iteration: about a dozen sequences in flight, the queue bounded.
        for _ in range(rng.choice((0, 0, 0, 0, 0, 0, 0, 0, 1, 2))):
            prompt = prefixes[rng.randrange(8)] + [rng.randrange(32000) for _ in range(rng.randrange(1, 40))]
            sid = f"r{next_id}"
            next_id += 1
            try:
                engine.submit(Sequence(sid, prompt, rng.randrange(1, 64), None, rng.randrange(3)))
            except Exception:  # QueueFull under bursts is part of the workload
                counts["rejected"] += 1
                continue
            counts["submitted"] += 1
        if not engine.step():
            counts["idle steps"] += 1
        elif engine.last_telemetry is not None:
            t = engine.last_telemetry
            counts["finished"] += len(t.finished_ids)
            counts["failed"] += len(t.failed_ids)
        if it % 97 == 0:
            snap = s.snapshot()
            pool = snap.waiting_ids if (it // 97) % 2 and snap.waiting_ids else snap.active_ids
            if pool and engine.cancel(pool[rng.randrange(len(pool))]):
                counts["cancelled"] += 1
            if not engine.cancel(f"r{next_id + 1}"):  # unknown ids are refused
                counts["unknown cancels"] += 1
        if it % 211 == 0:
            # A transient spike of foreign KV usage, then the measurement without it (§2.8
            # keeps a measured figure until the next one).
            spike = kv.capacity_bytes // 2
            used = [u for _, u in s.snapshot().component_used_bytes]
            counts["preempted"] += len(engine.preempt([used[0] + spike, used[1]]))
            used = [u for _, u in s.snapshot().component_used_bytes]
            engine.preempt([max(0, used[0] - spike), used[1]])
        if it + 1 == args.warmup:
            warm_rss = rss_bytes()
            warm_time = time.perf_counter()

    end_rss = rss_bytes()
    elapsed = time.perf_counter() - start
    if warm_rss is None:
        warm_rss = end_rss
        warm_time = start
    ratio = end_rss / warm_rss
    m = s.metrics()
    print(f"iterations          {args.iterations}")
    print(f"warm-up iterations  {args.warmup}")
    print(f"rss after warm-up   {warm_rss / 2**20:.2f} MiB")
    print(f"rss at end          {end_rss / 2**20:.2f} MiB")
    print(f"ratio end/warm-up   {ratio:.4f} (limit {args.limit})")
    print(f"wall time           {elapsed:.1f} s ({(time.perf_counter() - warm_time) / max(1, args.iterations - args.warmup) * 1e6:.1f} us/iteration after warm-up)")
    print("workload            " + ", ".join(f"{k} {v}" for k, v in counts.items()))
    print(f"metrics             iterations {m.iterations}, admitted {m.admitted}, finished {m.finished}, "
          f"failed {m.failed}, cancelled {m.cancelled}, preempted {m.preempted}, "
          f"decode tokens {m.decode_tokens}, prefill tokens {m.prefill_tokens}, recompute tokens {m.recompute_tokens}")
    assert m.iterations == args.iterations - counts["idle steps"]
    return 0 if ratio <= args.limit else 1


if __name__ == "__main__":
    sys.exit(main())
