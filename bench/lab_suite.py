"""Time the lab workload suite at scale (default: 100 000 requests, one run per policy/mode).

    python bench/lab_suite.py [--requests 100000] [--backend native] [--policy fcfs ...]

Prints one line per run: policy, mode, wall and CPU seconds, iterations, p99 TTFT, throughput.
"""
from __future__ import annotations

import argparse
import time

from skippy_scheduler.lab.suite import MODES, POLICIES, SuiteOptions, run_policy
from skippy_scheduler.lab.workload import WorkloadSpec, generate


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rate", type=float, default=WorkloadSpec.rate)
    parser.add_argument("--backend", default="native")
    parser.add_argument("--policy", action="append")
    parser.add_argument("--mode", action="append")
    args = parser.parse_args()
    start = time.perf_counter()
    workload = generate(WorkloadSpec(requests=args.requests, seed=args.seed, rate=args.rate))
    print(f"generate {args.requests} requests: {time.perf_counter() - start:.2f}s", flush=True)
    for mode in args.mode or MODES:
        for policy in args.policy or POLICIES:
            start, cpu = time.perf_counter(), time.process_time()
            run = run_policy(workload, policy, mode, SuiteOptions(), backend=args.backend)
            wall, cpu = time.perf_counter() - start, time.process_time() - cpu
            f = run.figures
            print(f"{policy}\t{mode}\twall_s={wall:.2f}\tcpu_s={cpu:.2f}\t"
                  f"iterations={f['iterations']}\t"
                  f"p99_ttft_ms={f['p99_ttft_ms']:.3f}\tthroughput_rps={f['throughput_rps']:.2f}",
                  flush=True)


if __name__ == "__main__":
    main()
