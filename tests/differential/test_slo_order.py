"""The slack rule's prefill order with first-token deadlines (behaviour.md §2.13, step 6), on
the native core and on the twin: among the sequences that are not overdue, those with a
deadline they can still meet go first, nearest deadline first (the shortest first among equal
deadlines); then those without one (fewest
tokens left first); then those relegated because theirs cannot be met (Moore and Hodgson's
rule: the longest of the ones kept so far gives way), which the overdue bound still serves in
time. `slo_relegated` counts each relegated sequence once. (That both implementations plan
alike with deadlines drawn at random is in test_slack.py.)
"""
import pytest

from skippy_scheduler import (
    IterationPrediction,
    Scheduler,
    Sequence,
    TwinScheduler,
)
from sched_helpers import complete, row_sizes, seeded_prompt, slack_order_config


@pytest.fixture(params=[Scheduler, TwinScheduler], ids=["native", "twin"])
def impl(request):
    return request.param


def _config(**overrides):
    """slack_order_config with a 40-token budget, so a plan shows the order."""
    return slack_order_config(**{"max_tokens_per_iteration": 40, "prefill_chunk_tokens": 40,
                                 **overrides})


def _first_plan(impl, deadlines, lengths=(30, 12, 20), **overrides):
    """Prompts p0, p1, p2 of `lengths` submitted at 0 with these first-token deadlines (s,
    None = none): the scheduler and its first plan's rows."""
    sched = impl(_config(**overrides))
    sched.set_clock(0.0)
    for k, (n, ttft) in enumerate(zip(lengths, deadlines)):
        sched.submit(Sequence(f"p{k}", seeded_prompt(n, k), 2).with_deadlines(ttft_deadline=ttft))
    return sched, row_sizes(sched.plan_iteration())


def test_without_deadlines_the_shortest_goes_first(impl):
    assert _first_plan(impl, (None, None, None))[1] == [("p1", 12), ("p2", 20), ("p0", 8)]


def test_the_nearest_deadline_goes_first_whatever_its_length(impl):
    sched, rows = _first_plan(impl, (0.5, 0.9, 0.7))
    assert rows == [("p0", 30), ("p2", 10)]
    assert sched.metrics().slo_relegated == 0


def test_a_deadline_goes_before_no_deadline(impl):
    """p0 has a deadline it can meet: before the shorter p1 and p2, which have none."""
    assert _first_plan(impl, (5.0, None, None))[1] == [("p0", 30), ("p1", 10)]


def test_a_deadline_that_cannot_be_met_is_relegated_behind_the_others(impl):
    """p0 needs 1 ms + 30 × 0.1 ms = 4 ms alone, its deadline is 2 ms away: it goes last,
    after p2 (a deadline it meets) and p1 (none); counted once, however many plans see it."""
    sched, rows = _first_plan(impl, (0.002, None, 1.0))
    assert rows == [("p2", 20), ("p1", 12), ("p0", 8)]
    assert sched.metrics().slo_relegated == 1
    plan = sched.plan_iteration()  # a second plan in flight (depth 1 replaces it)
    complete(sched, plan, [IterationPrediction(r, 3) for r, w in enumerate(plan.work)
                           if w.sample_last])
    row_sizes(sched.plan_iteration())
    assert sched.metrics().slo_relegated == 1


def test_the_longest_kept_gives_way_when_two_cannot_both_be_met(impl):
    """p0 (30 tokens, 4.5 ms) and p1 (12, 5 ms) each meet theirs alone, not both: in deadline
    order p0 ends at 4 ms, then p1 at 5.2 ms, late, so the longer, p0, gives way: p1 and p2
    (which still meets 10 s) keep theirs, p0 goes last."""
    sched, rows = _first_plan(impl, (0.0045, 0.005, 10.0))
    assert rows == [("p1", 12), ("p2", 20), ("p0", 8)]
    assert sched.metrics().slo_relegated == 1


def test_equal_deadlines_go_shortest_first(impl):
    """A burst under one SLO: the shortest first brings the most of them within it."""
    assert _first_plan(impl, (1.0, 1.0, 1.0))[1] == [("p1", 12), ("p2", 20), ("p0", 8)]


def test_equal_deadlines_and_lengths_keep_the_walk_order(impl):
    assert _first_plan(impl, (1.0, 1.0, 1.0), lengths=(20, 20, 20))[1] == [("p0", 20),
                                                                          ("p1", 20)]


def test_among_equal_deadlines_the_shortest_are_kept(impl):
    """p0 (30), p1 (12) and p2 (20) share a deadline 4.5 ms away (1 ms + 0.1 ms a token): in
    that order, shortest first, p1 ends at 2.2 ms and p2 at 4.2 ms, p0 would end at 7.2 ms
    and gives way; the two short ones keep theirs."""
    sched, rows = _first_plan(impl, (0.0045, 0.0045, 0.0045))
    assert rows == [("p1", 12), ("p2", 20), ("p0", 8)]
    assert sched.metrics().slo_relegated == 1


def test_a_relegated_sequence_is_served_once_overdue(impl):
    """The starvation bound: p0 was relegated at 0; p1 and p2 (deadlines they meet) arrive at
    1.5 s; with a 1 s age bound p0 is overdue by then and goes first."""
    sched = impl(_config(slack_prefill_age_max=1.0, max_tokens_per_iteration=10,
                         prefill_chunk_tokens=10))
    sched.set_clock(0.0)
    sched.submit(Sequence("p0", seeded_prompt(30, 0), 2).with_deadlines(ttft_deadline=0.002))
    sched.submit(Sequence("q", seeded_prompt(12, 3), 2).with_deadlines(ttft_deadline=1.0))
    assert row_sizes(sched.plan_iteration()) == [("q", 10)]
    assert sched.metrics().slo_relegated == 1
    sched.set_clock(1.5)
    sched.submit(Sequence("p1", seeded_prompt(12, 1), 2).with_deadlines(ttft_deadline=1.6))
    sched.submit(Sequence("p2", seeded_prompt(20, 2), 2).with_deadlines(ttft_deadline=1.7))
    assert row_sizes(sched.plan_iteration())[0] == ("p0", 10)


def test_overdue_prefill_counts_against_the_deadlines_behind_it(impl):
    """An overdue p0 (30 tokens, 3 ms of prefill) goes first, so q's 2 ms of prefill ends at
    1 + 3 + 2 = 6 ms, after its 5 ms deadline: q is relegated behind p1 (no deadline)."""
    sched = impl(_config(slack_prefill_age_max=0.25))
    sched.set_clock(0.0)
    sched.submit(Sequence("p0", seeded_prompt(30, 0), 2))
    sched.set_clock(0.5)
    sched.submit(Sequence("q", seeded_prompt(20, 3), 2).with_deadlines(ttft_deadline=0.505))
    sched.submit(Sequence("p1", seeded_prompt(12, 1), 2))
    assert row_sizes(sched.plan_iteration()) == [("p0", 30), ("p1", 10)]
    assert sched.metrics().slo_relegated == 1

