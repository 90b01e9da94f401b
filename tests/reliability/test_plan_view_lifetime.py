"""Numpy views of a plan's native memory keep that memory alive: a view kept after its
Scheduler is gone reads and writes memory that still exists (under the sanitizer run, a view
that did not keep it would be a use after free). The plan classes are made only by
`plan_iteration`: constructing one directly is a TypeError, not a crash."""
from __future__ import annotations

import gc

import numpy as np
import pytest

from skippy_scheduler import (IterationPlan, PlanOutputs, Scheduler, SchedulerConfig,
                              Sequence)


def test_views_kept_after_the_scheduler_is_gone_still_read_their_memory():
    s = Scheduler(SchedulerConfig(max_tokens_per_iteration=64, prefill_chunk_tokens=32))
    s.submit(Sequence("a", list(range(40)), max_tokens=4))
    plan = s.plan_iteration()
    tokens, positions = plan.tokens, plan.positions
    outputs = plan.outputs.predicted_tokens
    seen = (tokens.copy(), positions.copy())
    del s, plan
    gc.collect()
    for _ in range(50):  # allocations that would reuse freed memory
        Scheduler(SchedulerConfig()).submit(Sequence("b", [1, 2, 3], max_tokens=2))
    assert np.array_equal(tokens, seen[0]) and np.array_equal(positions, seen[1])
    tokens[:] = 7
    outputs[:] = 9
    assert (tokens == 7).all() and (outputs == 9).all()
    del tokens, positions, outputs
    gc.collect()


@pytest.mark.parametrize("cls", [IterationPlan, PlanOutputs])
def test_plan_objects_are_made_by_the_scheduler_only(cls):
    with pytest.raises(TypeError, match="plan_iteration"):
        cls()
