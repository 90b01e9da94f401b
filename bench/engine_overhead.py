"""What the engine adds to a scheduler step: the engine's step against a bare loop, one run.

Both sides run the same steady-decode workload (`skippy_scheduler.bench.steady_decode`'s
scheduler: N sequences decoding, 512-token prompts): the bare loop is plan_iteration + the
bench host writing one token per sampling row + complete_iteration, the way a host would
write it by hand; the engine side is `Engine.step()` with no clock and no recorder (what
`skippy-scheduler bench` times). Samples alternate between the two, so machine load hits
both alike; the figure that matters is the ratio of medians.

Run: python bench/engine_overhead.py [--sizes 256,1024] [--steps 4000]
"""
from __future__ import annotations

import argparse
import sys

from skippy_scheduler import Scheduler
from skippy_scheduler.bench import BenchHost, decoding_engine, paired_medians_us


def bare_step(scheduler, host: BenchHost):
    def step():
        plan = scheduler.plan_iteration()
        host.execute(plan)
        return scheduler.complete_iteration(plan)

    return step


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--sizes", default="256,1024")
    ap.add_argument("--steps", type=int, default=4000)
    args = ap.parse_args(argv)
    print("N\tbare_median_us\tengine_median_us\tengine/bare")
    for n in (int(x) for x in args.sizes.split(",")):
        engine = decoding_engine(Scheduler, n, 512)
        bare = decoding_engine(Scheduler, n, 512).scheduler  # same state, driven by hand
        ma, mb = paired_medians_us(bare_step(bare, BenchHost()), engine.step, args.steps)
        print(f"{n}\t{ma:.2f}\t{mb:.2f}\t{mb / ma:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
