"""What plans in flight cost the scheduler itself: steady decode at depth 1 and depth 2, one run.

Both sides drive the native scheduler directly (no engine): N sequences decoding; a step makes
one plan, writes one token per sampling row into its output block, and completes the oldest
live plan (at depth 2 that is the plan made one step earlier, so every decode row's input is
deferred). Deferred inputs are not filled here: a native host fills them on its device; this
measures plan_iteration + complete_iteration alone. Samples alternate between the two depths.

Run: python bench/inflight_cost.py [--sizes 256,1024] [--steps 4000]
"""
from __future__ import annotations

import sys

from skippy_bench.reports import paired_medians_table
from skippy_scheduler import Scheduler, SchedulerConfig, Sequence


def stepper(n: int, depth: int):
    s = Scheduler(SchedulerConfig(max_active_sequences=n, sequence_id_limit=n + 16,
                                  max_waiting_sequences=n + 16,
                                  max_tokens_per_iteration=max(2048, n), max_inflight_plans=depth))
    for i in range(n):
        s.submit(Sequence(f"d{i}", [(i * 7919 + k) % 32000 for k in range(512)], 1 << 30)
                 .with_prefilled_generation([1]))
    live: list = []

    def step() -> None:
        plan = s.plan_iteration()
        rows = plan.sample_rows
        out = plan.outputs
        out.request_indexes[:len(rows)] = rows
        out.predicted_tokens[:len(rows)] = 7
        out.count = len(rows)
        live.append(plan)
        if len(live) >= depth:
            s.complete_iteration(live.pop(0))

    return step


def main(argv: list[str] | None = None) -> int:
    return paired_medians_table(argv, __doc__.splitlines()[0],
                                ("depth1_median_us", "depth2_median_us", "depth2/depth1"),
                                lambda n: (stepper(n, 1), stepper(n, 2)))


if __name__ == "__main__":
    sys.exit(main())
