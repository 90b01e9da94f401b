"""`skippy-scheduler bench`: the per-step scheduler overhead report of BENCHMARKS.md."""
from __future__ import annotations

import sys

from .. import bench
from .._core import Scheduler

DESCRIPTION = "Per-step scheduler overhead report (median and p99 µs per step, per row)."


def register(subparsers) -> None:
    p = subparsers.add_parser("bench", help="per-step scheduler overhead report",
                              description=DESCRIPTION)
    p.add_argument("--quick", action="store_true", help="fewer steps (a smoke run, noisier)")
    p.add_argument("--no-twin", action="store_true", help="skip the pure-Python twin")
    p.add_argument("--no-c", action="store_true", help="skip the C API program")
    p.add_argument("--callgrind", action="store_true",
                   help="also count instructions per C API step with valgrind (stable on noisy "
                        "machines)")
    p.set_defaults(func=run)


def run(args) -> int:
    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    results, notes = bench.collect(quick=args.quick, twin=not args.no_twin, c_api=not args.no_c,
                                   callgrind=args.callgrind, log=log)
    print(f"machine: {bench.machine()}")
    print(bench.format_table(results))
    print(bench.context_line(results))
    for n in (512, 8192):
        print(f"tokens in a steady decode plan at N=256, {n}-token prompts: "
              f"{bench.first_plan_token_count(Scheduler, 256, n)} (one pending token per row)")
    for note in notes:
        print(note)
    return 0
