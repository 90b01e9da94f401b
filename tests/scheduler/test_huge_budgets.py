"""A step budget and a prefill chunk far larger than any plan uses: the native core sizes its
plan buffer for what the sequences can feed, not for a chunk per sequence (which would ask for
tens of gigabytes here), and plans what the twin plans."""
from __future__ import annotations

import pytest

from skippy_scheduler import SchedulerConfig, Sequence
from skippy_scheduler.types import IterationPhase


@pytest.mark.parametrize("depth", [1, 2])
def test_huge_budget_and_chunk_plan_like_small_ones(impl, depth):
    huge = 1 << 34
    s = impl(SchedulerConfig(max_tokens_per_iteration=huge, prefill_chunk_tokens=huge,
                             max_active_sequences=8, max_inflight_plans=depth))
    for i in range(4):
        s.submit(Sequence(f"s{i}", list(range(1, 40 + 10 * i)), max_tokens=3))
    plan = s.plan_iteration()
    assert len(plan) == 4 and plan.token_count == sum(39 + 10 * i for i in range(4))
    assert {int(p) for p in plan.phases} == {IterationPhase.PREFILL.value}
    rows = plan.sample_rows
    out = plan.outputs
    out.request_indexes[:len(rows)] = rows
    out.predicted_tokens[:len(rows)] = 7
    out.count = len(rows)
    s.complete_iteration(plan)
    plan = s.plan_iteration()  # the decode step
    assert len(plan) == 4 and plan.token_count == 4
    s.abort_iteration(plan)
    assert s.metrics().active_sequences == 4


def test_a_replaced_plan_gives_its_tokens_back_within_the_buffer(impl):
    """Depth 1: making a plan while one is live undoes the live one (its rows' cursors go
    back), after the new plan's buffer was sized; the buffer holds what the undone rows feed
    again. (Under the sanitizers a buffer sized from the cursors before the undo overflows.)"""
    big = 1 << 22  # past the size from which the buffer follows what the sequences can feed
    s = impl(SchedulerConfig(max_tokens_per_iteration=big, prefill_chunk_tokens=big,
                             max_active_sequences=8))
    s.submit(Sequence("a", [5] * 4000, max_tokens=2))
    first = s.plan_iteration()
    assert first.token_count == 4000
    s.submit(Sequence("b", [6] * 3000, max_tokens=2))
    second = s.plan_iteration()  # replaces the first: a's 4000 tokens again, and b's
    assert second.token_count == 7000 and len(second) == 2
    assert list(second.tokens[:4000]) == [5] * 4000 and list(second.tokens[4000:]) == [6] * 3000
