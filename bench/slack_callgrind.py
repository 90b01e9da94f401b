"""Instructions per step, reference rule against the slack rule, counted by callgrind (one run).

The slack rule (docs/behaviour.md §2.13) must cost at most 1.2x the reference rule per step at
N = 256 and 1 024. Wall time on a shared machine is noise; instruction counts are not. For each
N and each rule this runs one Python process under `valgrind --tool=callgrind` with `k`
measured steps and one with `2k`, and reports (Ir(2k) - Ir(k)) / k (set-up and warm-up cancel)
of the scheduler core, `skippy_scheduler_plan` + `skippy_scheduler_complete` inclusive (what
the rule changes; the Python around them is the same code for both rules, and its counts
swing by more than the core's whole cost between two runs of the same process), and the
slack / reference ratio. Workloads (`skippy_scheduler.bench`): `decode` (N steady
decodes: the rule only stamps last-token times) and `mixed` (N decodes plus one 256-token
prefill chunk per step: the rule also reads every row's slack and sizes the chunk; its target
is out of reach, so both rules make the same plans).

    python bench/slack_callgrind.py                     # N = 256,1024, both workloads
    python bench/slack_callgrind.py --sizes 256 --steps 200 --workloads mixed
    python bench/slack_callgrind.py --workloads mixed --position-us 0.001   # position term on

`--position-us Q` gives the slack rule's cost model a position term (`per_prefill_position_us`,
§2.13 step 5a), so each prefill row's chunk is sized by the quadratic in token equivalents;
a small Q keeps the chunk within a token of the reference rule's, the same work per step.

Needs valgrind.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile

from skippy_bench.callgrind import callgrind, counted_steps  # step_callgrind.py's counted run


def _workload(kind: str, rule: str, n: int, steps: int, position_us: float) -> None:
    """The measured child: build the steady state, warm up, then run `steps` steps."""
    from skippy_scheduler import Scheduler, StepCost
    from skippy_scheduler.bench.workloads import (SLACK_SAME_PLANS, mixed_decode_prefill,
                                                  steady_decode)

    cfg = dict(SLACK_SAME_PLANS) if rule == "slack" else {}
    if rule == "slack" and position_us > 0:
        cfg["step_cost"] = StepCost(per_prefill_position_us=position_us)
    if kind == "mixed":
        step = mixed_decode_prefill(Scheduler, n, steps=2 * steps + 100, **cfg)
    else:
        step = steady_decode(Scheduler, n, **cfg)
    counted_steps(step, steps)


def _instructions(kind: str, rule: str, n: int, steps: int, position_us: float) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "cg.out")
        callgrind(sys.executable, __file__, [kind, rule, str(n), str(steps), repr(position_us)],
                  out)
        annotate = shutil.which("callgrind_annotate")
        if annotate is None:
            raise SystemExit("callgrind_annotate not found")
        text = subprocess.run([annotate, "--inclusive=yes", "--threshold=100", out], check=True,
                              capture_output=True, text=True).stdout
    total = 0
    for line in text.splitlines():
        parts = line.split()
        if parts and any(p.endswith(f":{fn}") for p in parts for fn in CORE):
            total += int(parts[0].replace(",", ""))
    if not total:
        raise RuntimeError("no scheduler core functions in the callgrind output")
    return total


CORE = ("skippy_scheduler_plan", "skippy_scheduler_complete")


def per_step(kind: str, rule: str, n: int, k: int, position_us: float = 0.0) -> float:
    return (_instructions(kind, rule, n, 2 * k, position_us)
            - _instructions(kind, rule, n, k, position_us)) / k


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--sizes", default="256,1024")
    ap.add_argument("--steps", type=int, default=500, help="k: measured steps of the short run")
    ap.add_argument("--workloads", default="decode,mixed")
    ap.add_argument("--position-us", type=float, default=0.0,
                    help="the slack rule's per_prefill_position_us (default 0: no position term)")
    ap.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if not (args.position_us >= 0 and args.position_us < float("inf")):
        ap.error(f"--position-us must be a finite number >= 0, got {args.position_us}")
    if args.child:
        kind, rule, n, steps, position_us = args.child
        _workload(kind, rule, int(n), int(steps), float(position_us))
        return 0
    print("N\tworkload\treference core Ir/step\tslack core Ir/step\tslack/reference",
          flush=True)
    for n in (int(x) for x in args.sizes.split(",")):
        for kind in args.workloads.split(","):
            ref = per_step(kind, "reference", n, args.steps)
            slack = per_step(kind, "slack", n, args.steps, args.position_us)
            print(f"{n}\t{kind}\t{ref:.0f}\t{slack:.0f}\t{slack / ref:.4f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
