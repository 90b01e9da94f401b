"""`skippy-scheduler bench`: the per-step scheduler overhead report of BENCHMARKS.md."""
from __future__ import annotations

import argparse
import sys
from typing import Any

from .. import bench
from .._core import Scheduler
from ..selection import IMPLEMENTATIONS
from .vocabulary import add_flag, add_old

DESCRIPTION = "Per-step scheduler overhead report (median and p99 µs per step, per row)."


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("bench", help="per-step scheduler overhead report",
                              description=DESCRIPTION)
    p.add_argument("--quick", action="store_true",
                   help="fewer steps (a smoke run, noisier; default: off)")
    which = p.add_mutually_exclusive_group()  # --no-twin would replace every --scheduler
    add_flag(which, "scheduler", action="append",
             note="repeatable; the native rows are always timed (the others are read against "
                  "them), --scheduler native alone leaves the twin's out",
             default_text="native and twin")
    add_old(which, "--no-twin", "--scheduler native", "scheduler", const=["native"], flag=True)
    p.add_argument("--no-c", action="store_true", help="skip the C API program (default: off)")
    p.add_argument("--compare-slack", action="store_true",
                   help="also time the slack planning rule against the reference rule, paired "
                        "in one run, at N = 256 and 1 024 (steady decode, and decode + a "
                        "256-token chunk); default: off")
    p.add_argument("--callgrind", action="store_true",
                   help="also count instructions per C API step with valgrind (stable on noisy "
                        "machines; default: off)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    chosen = set(args.scheduler or IMPLEMENTATIONS)
    results, notes = bench.collect(quick=args.quick, twin="twin" in chosen,
                                   c_api=not args.no_c, callgrind=args.callgrind, log=log,
                                   slack=args.compare_slack)
    print(f"machine: {bench.machine()}")
    print(bench.format_table(results))
    print(bench.context_line(results))
    for n in (512, 8192):
        print(f"tokens in a steady decode plan at N=256, {n}-token prompts: "
              f"{bench.first_plan_token_count(Scheduler, 256, n)} (one pending token per row)")
    for note in notes:
        print(note)
    for r in results:
        if r.note and "slack" in r.workload:
            print(f"{r.workload} N={r.size}: {r.note}")
    return 0
