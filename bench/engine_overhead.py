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

import sys

from skippy_bench.reports import paired_medians_table
from skippy_scheduler import Scheduler
from skippy_scheduler.bench import BenchHost, decoding_engine


def bare_step(scheduler, host: BenchHost):
    def step():
        plan = scheduler.plan_iteration()
        host.execute(plan)
        return scheduler.complete_iteration(plan)

    return step


def sides(n: int):
    engine = decoding_engine(Scheduler, n, 512)
    bare = decoding_engine(Scheduler, n, 512).scheduler  # same state, driven by hand
    return bare_step(bare, BenchHost()), engine.step


def main(argv: list[str] | None = None) -> int:
    return paired_medians_table(argv, __doc__.splitlines()[0],
                                ("bare_median_us", "engine_median_us", "engine/bare"), sides)


if __name__ == "__main__":
    sys.exit(main())
