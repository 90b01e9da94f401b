"""The slack rule's prefill order (behaviour.md §2.13) on the native core and on the twin: its
prefill walks visit the sequences submitted at least `slack_prefill_age_max` ago first (walk
order), then the others by fewest prefill tokens left (ties in walk order); an age bound of 0
is the walk order. (That both implementations plan alike for any bound is in test_slack.py.)
"""
import math

import pytest

from skippy_scheduler import (
    IterationPrediction,
    MemoryComponent,
    PlanningRule,
    Scheduler,
    SchedulerConfig,
    Sequence,
    TwinScheduler,
)
from sched_helpers import complete, row_sizes, seeded_prompt, slack_order_config


@pytest.fixture(params=[Scheduler, TwinScheduler], ids=["native", "twin"])
def impl(request):
    return request.param


def _three_pending(impl, **overrides):
    """Three prompts of 30, 12 and 20 tokens pending, nothing decoding, a 10-token budget:
    the first plan's rows."""
    sched = impl(slack_order_config(**overrides))
    sched.set_clock(0.0)
    for k, n in enumerate([30, 12, 20]):
        sched.submit(Sequence(f"p{k}", seeded_prompt(n, k), 2))
    return row_sizes(sched.plan_iteration())


def test_the_shortest_remaining_prefill_goes_first(impl):
    assert _three_pending(impl) == [("p1", 10)]
    assert _three_pending(impl, slack_prefill_age_max=1e9) == [("p1", 10)]


def test_an_age_bound_of_zero_is_the_walk_order(impl):
    assert _three_pending(impl, slack_prefill_age_max=0.0) == [("p0", 10)]


def test_the_reference_rule_keeps_the_walk_order(impl):
    assert _three_pending(impl, planning_rule=PlanningRule.REFERENCE) == [("p0", 10)]


def test_the_budget_flows_on_in_the_same_order(impl):
    """A 40-token budget: p1 (12) whole, then p2 (20) whole, then 8 tokens of p0."""
    rows = _three_pending(impl, max_tokens_per_iteration=40, prefill_chunk_tokens=40)
    assert rows == [("p1", 12), ("p2", 20), ("p0", 8)]


def test_remaining_counts_what_is_left_to_feed(impl):
    """After p1 got 10 of its 12 tokens, its 2 left go before p2's 20 and p0's 30; then p2."""
    sched = impl(slack_order_config())
    sched.set_clock(0.0)
    for k, n in enumerate([30, 12, 20]):
        sched.submit(Sequence(f"p{k}", seeded_prompt(n, k), 2))
    plan = sched.plan_iteration()
    assert row_sizes(plan) == [("p1", 10)]
    complete(sched, plan)
    plan = sched.plan_iteration()
    assert row_sizes(plan) == [("p1", 2), ("p2", 8)]


def test_an_overdue_prefill_goes_first_whatever_its_length(impl):
    """p0 (30 tokens) was submitted at 0, the short ones at 0.5 s: with a bound of 0.25 s p0 is
    overdue and goes first; with 1 s nobody is and the shortest does."""
    for bound, first in ((0.25, "p0"), (1.0, "p1")):
        sched = impl(slack_order_config(slack_prefill_age_max=bound))
        sched.set_clock(0.0)
        sched.submit(Sequence("p0", seeded_prompt(30, 0), 2))
        sched.set_clock(0.5)
        sched.submit(Sequence("p1", seeded_prompt(12, 1), 2))
        sched.submit(Sequence("p2", seeded_prompt(20, 2), 2))
        assert row_sizes(sched.plan_iteration()) == [(first, 10)]


def test_overdue_ones_keep_the_walk_order_among_them(impl):
    """All three overdue: walk order (p0 first), though p1 is the shortest."""
    sched = impl(slack_order_config(slack_prefill_age_max=0.25))
    sched.set_clock(0.0)
    for k, n in enumerate([30, 12, 20]):
        sched.submit(Sequence(f"p{k}", seeded_prompt(n, k), 2))
    sched.set_clock(0.25)
    assert row_sizes(sched.plan_iteration()) == [("p0", 10)]


def test_mixed_steps_take_the_same_order(impl):
    """A live decode "d" beside the three prompts: the mixed step's chunk goes to p1."""
    sched = impl(slack_order_config(max_tokens_per_iteration=11))
    sched.set_clock(0.0)
    sched.submit(Sequence("d", [1, 2], 100))
    plan = sched.plan_iteration()
    complete(sched, plan, [IterationPrediction(0, 5)])
    for k, n in enumerate([30, 12, 20]):
        sched.submit(Sequence(f"p{k}", seeded_prompt(n, k), 2))
    assert row_sizes(sched.plan_iteration()) == [("d", 1), ("p1", 10)]


def _long_behind_shorts(impl, bound, steps=24):
    """A 100-token prompt "long" at t = 0, then an 8-token prompt each step (one step = 0.125
    s, budget 8 tokens): the step indexes at which long got a row."""
    sched = impl(slack_order_config(max_tokens_per_iteration=8, prefill_chunk_tokens=8,
                         slack_prefill_age_max=bound, max_active_sequences=64))
    served = []
    for i in range(steps):
        sched.set_clock(i * 0.125)
        if i == 0:
            sched.submit(Sequence("long", seeded_prompt(100, 0), 1))
        sched.submit(Sequence(f"s{i}", seeded_prompt(8, i + 1), 1))
        plan = sched.plan_iteration()
        if "long" in [w.sequence_id for w in plan.work]:
            served.append(i)
        complete(sched, plan, [IterationPrediction(r, 3) for r, w in enumerate(plan.work)
                               if w.sample_last])
    return served


def test_a_long_prompt_among_arriving_short_ones_gets_its_chunk_once_overdue(impl):
    """Pure shortest-first starves it (a short one always waits); with a 1 s bound it is
    overdue from step 8 (t = 1 s) on and from then gets every chunk until it is done."""
    assert _long_behind_shorts(impl, 1e9) == []
    assert _long_behind_shorts(impl, 1.0) == list(range(8, 21))  # 13 chunks: 12 × 8 + 4


def _preempted_then_young(impl, bound):
    """"old" (30 tokens) submitted at 0 and prefilled, preempted at 1 s, back in the active set
    beside "young" (5 tokens, submitted at 1 s): the rows of the plan that readmits it."""
    kv = MemoryComponent("kv", 60, 0, 1, 0)
    sched = impl(slack_order_config(slack_prefill_age_max=bound, memory_components=[kv],
                         max_tokens_per_iteration=40, prefill_chunk_tokens=40))
    sched.set_clock(0.0)
    sched.submit(Sequence("old", seeded_prompt(30, 0), 20))
    plan = sched.plan_iteration()
    assert row_sizes(plan) == [("old", 30)]
    complete(sched, plan, [IterationPrediction(0, 3)])
    sched.set_clock(1.0)
    assert sched.preempt_for_component_pressure([61]) == ["old"]
    assert sched.preempt_for_component_pressure([0]) == []  # the pressure is gone
    sched.submit(Sequence("young", seeded_prompt(5, 1), 2))
    return row_sizes(sched.plan_iteration())


def test_the_age_survives_preemption(impl):
    """A preempted sequence keeps the clock of its submit: readmitted after the bound, it is
    overdue and goes first; under pure shortest-first the younger short one does."""
    assert _preempted_then_young(impl, 0.5) == [("old", 30), ("young", 5)]
    assert _preempted_then_young(impl, 1e9) == [("young", 5), ("old", 30)]


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf, -math.inf])
def test_a_bad_age_bound_is_refused(bad):
    with pytest.raises(ValueError, match="slack_prefill_age_max"):
        SchedulerConfig(slack_prefill_age_max=bad)
    config = SchedulerConfig()
    with pytest.raises(ValueError, match="slack_prefill_age_max"):
        config.slack_prefill_age_max = bad
    assert config.slack_prefill_age_max == 2.0


@pytest.mark.parametrize("bad", [True, "1", None])
def test_an_age_bound_of_the_wrong_type_is_refused(bad):
    with pytest.raises(TypeError, match="slack_prefill_age_max"):
        SchedulerConfig(slack_prefill_age_max=bad)
