"""Instructions per steady-decode step, engine and bare loop, counted by callgrind (one run).

Wall time on a shared machine is noise; instruction counts are not. For each N this runs the
same Python process twice under `valgrind --tool=callgrind` per side, once with `k` measured
steps and once with `2k`, and reports (Ir(2k) - Ir(k)) / k: set-up, imports and warm-up cancel.
The sides are `engine` (`Engine.step()` on `skippy_scheduler.bench`'s steady-decode engine: no
clock, no recorder, no observers) and `bare` (plan_iteration + the bench host writing one token
per sampling row + complete_iteration on the same state, the way a host writes it by hand).

Run the same file from two environments to compare packages, e.g. before and after a change:

    python bench/step_callgrind.py --sizes 256,1024            # this environment
    python bench/step_callgrind.py --python /path/to/other/python   # ratio other/this -> new/old

With `--python OTHER` each figure is measured for both interpreters and the ratio is
this/OTHER (so run it from the new environment with OTHER the old one). Needs valgrind.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

from skippy_bench.callgrind import callgrind, counted_steps


def _workload(side: str, n: int, steps: int) -> None:
    """The measured child: build the steady state, warm up, then run `steps` steps."""
    from skippy_scheduler import Scheduler
    import skippy_scheduler.bench as b

    build = getattr(b, "decoding_engine", None) or getattr(b, "_decoding")  # older packages
    engine = build(Scheduler, n, 512)
    if side == "engine":
        step = engine.step
    else:
        sched, host = engine.scheduler, b.BenchHost()

        def step() -> object:
            plan = sched.plan_iteration()
            host.execute(plan)
            return sched.complete_iteration(plan)
    counted_steps(step, steps)


def _instructions(python: str, side: str, n: int, steps: int) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "cg.out")
        callgrind(python, __file__, [side, str(n), str(steps)], out)
        with open(out) as f:
            for line in f:
                if line.startswith("summary:") or line.startswith("totals:"):
                    return int(line.split()[1])
    raise RuntimeError("no totals in callgrind output")


def per_step(python: str, side: str, n: int, k: int) -> float:
    return (_instructions(python, side, n, 2 * k) - _instructions(python, side, n, k)) / k


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--sizes", default="256,1024")
    ap.add_argument("--steps", type=int, default=1000, help="k: measured steps of the short run")
    ap.add_argument("--sides", default="engine,bare")
    ap.add_argument("--python", help="another interpreter to compare with (this/OTHER)")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        side, n, steps = args.child
        _workload(side, int(n), int(steps))
        return 0
    pythons = [sys.executable] + ([args.python] if args.python else [])
    head = "N\tside\tIr/step" + ("\tIr/step(other)\tthis/other" if args.python else "")
    print(head, flush=True)
    for n in (int(x) for x in args.sizes.split(",")):
        for side in args.sides.split(","):
            figs = [per_step(py, side, n, args.steps) for py in pythons]
            row = f"{n}\t{side}\t{figs[0]:.0f}"
            if len(figs) == 2:
                row += f"\t{figs[1]:.0f}\t{figs[0] / figs[1]:.4f}"
            print(row, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
