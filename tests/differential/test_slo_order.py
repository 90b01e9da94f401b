"""The slack rule's prefill order with first-token deadlines (behaviour.md §2.13, step 6), on
the native core and on the twin: among the sequences that are not overdue, those with a
deadline they can still meet go first, in the order that meets them all with the least total
time to first token (Smith's rule; the shortest first among equal deadlines); then those
without one (fewest
tokens left first); then those relegated because theirs cannot be met (Moore and Hodgson's
rule: the longest of the ones kept so far gives way), which the overdue bound still serves in
time. `slo_relegated` counts each relegated sequence once. (That both implementations plan
alike with deadlines drawn at random is in test_slack.py.)
"""
import pytest

from skippy_scheduler import (
    IterationPhase,
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


def test_deadlines_every_order_meets_go_shortest_first(impl):
    """Deadlines 0.5-0.9 s away, prefill in milliseconds: any order meets them all, so the
    one with the least total time to first token, shortest first, is taken."""
    sched, rows = _first_plan(impl, (0.5, 0.9, 0.7))
    assert rows == [("p1", 12), ("p2", 20), ("p0", 8)]
    assert sched.metrics().slo_relegated == 0


def test_a_deadline_shortest_first_would_miss_goes_first_whatever_its_length(impl):
    """p0 (30 tokens) must end by 4.5 ms; shortest first it would end at 1 + 6.2 = 7.2 ms.
    Smith's rule: p2 (20, deadline 1 s) takes the last place, then p1 (12), and p0 (4.5 ms
    >= the 4 ms left) the first: all three meet theirs."""
    sched, rows = _first_plan(impl, (0.0045, 1.0, 1.0))
    assert rows == [("p0", 30), ("p1", 10)]
    assert sched.metrics().slo_relegated == 0


def test_the_nearest_deadline_first_when_the_shortest_does_not_fit_before_it(impl):
    """Deadlines 4.1, 6.5 and 7.2 ms: the total ends at 7.2 ms, where only p2 (20) may stand
    last; then 5.2 ms, where p1 (12, 6.5 ms) may; p0 (30, 4.1 ms) first, ending at 4 ms.
    Shortest first would miss p0's."""
    sched, rows = _first_plan(impl, (0.0041, 0.0065, 0.0072))
    assert rows == [("p0", 30), ("p1", 10)]
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


def _relegated_p0(impl):
    """p0 (30 tokens, deadline 2 ms) relegated at 0 behind q (12, deadline 1 s), a 1 s age
    bound and a 10-token budget: the scheduler after that first plan."""
    sched = impl(_config(slack_prefill_age_max=1.0, max_tokens_per_iteration=10,
                         prefill_chunk_tokens=10))
    sched.set_clock(0.0)
    sched.submit(Sequence("p0", seeded_prompt(30, 0), 2).with_deadlines(ttft_deadline=0.002))
    sched.submit(Sequence("q", seeded_prompt(12, 3), 2).with_deadlines(ttft_deadline=1.0))
    assert row_sizes(sched.plan_iteration()) == [("q", 10)]
    assert sched.metrics().slo_relegated == 1
    return sched


def _p1_p2_at(sched, now):
    """p1 and p2 (deadlines 1.6 and 1.7 s, which they meet) arrive at `now`: the next plan's
    rows."""
    sched.set_clock(now)
    sched.submit(Sequence("p1", seeded_prompt(12, 1), 2).with_deadlines(ttft_deadline=1.6))
    sched.submit(Sequence("p2", seeded_prompt(20, 2), 2).with_deadlines(ttft_deadline=1.7))
    return row_sizes(sched.plan_iteration())


def test_a_relegated_sequence_is_served_once_overdue(impl):
    """The starvation bound: p0 was relegated at 0; p1 and p2 (deadlines they meet) arrive at
    1.5 s; with a 1 s age bound p0 is overdue by then and goes first."""
    assert _p1_p2_at(_relegated_p0(impl), 1.5)[0] == ("p0", 10)


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


def test_a_deadline_still_ahead_keeps_its_order_past_the_age_bound(impl):
    """A burst under one SLO, its deadline 3 s away and the age bound 1 s: at 1.5 s its
    prompts are still ordered by the deadline, shortest first, not overdue in walk order
    (which would serve the 30-token p0 first); the age bound counts from the deadline."""
    sched = impl(_config(slack_prefill_age_max=1.0))
    sched.set_clock(0.0)
    for k, n in enumerate((30, 12, 20)):
        sched.submit(Sequence(f"p{k}", seeded_prompt(n, k), 2).with_deadlines(ttft_deadline=3.0))
    sched.set_clock(1.5)
    assert row_sizes(sched.plan_iteration()) == [("p1", 12), ("p2", 20), ("p0", 8)]


def test_a_missed_deadline_is_overdue_the_age_bound_after_it(impl):
    """p0 (deadline 2 ms, relegated at 0) becomes overdue 1 s after its deadline, not 1 s
    after its submit: at 1.0015 s it still goes behind p1 and p2 (deadlines they meet) and q
    (relegated, fewer tokens left), at 1.0025 s first."""
    sched = _relegated_p0(impl)
    assert _p1_p2_at(sched, 1.0015) == [("p1", 10)]
    sched.set_clock(1.0025)
    assert row_sizes(sched.plan_iteration())[0] == ("p0", 10)


def test_smiths_order_meets_every_deadline_with_the_least_total_time_to_first_token():
    """The twin's placement (the core's is the same, test_slack.py) on 3 000 random sets of
    up to 6 prompts whose nearest-first order meets every deadline: its order meets them all
    too, and no order that does has a smaller sum of prefill end times (all orders tried).
    Integer costs keep every sum exact."""
    import itertools
    import random

    from skippy_scheduler.reference.planning import _smith_order

    rng = random.Random(7)
    checked = 0
    while checked < 3000:
        n = rng.randint(1, 6)
        lengths = [rng.randint(1, 50) for _ in range(n)]
        per_token, start = float(rng.randint(1, 20)), float(rng.randint(0, 100))
        total = start + per_token * sum(lengths)
        deadlines = [float(rng.randint(int(start), int(total * 1.5) + 1)) for _ in range(n)]
        pending = [Sequence(f"s{i}", seeded_prompt(lengths[i], i), 2)
                   .with_deadlines(ttft_deadline=deadlines[i] / 1e6) for i in range(n)]
        edf = sorted(range(n), key=lambda i: (pending[i].ttft_deadline * 1e6, lengths[i]))

        def ends(order):
            t, out = start, []
            for i in order:
                t += per_token * lengths[i]
                out.append(t)
            return out

        def meets(order):
            return all(e <= pending[i].ttft_deadline * 1e6 for i, e in zip(order, ends(order)))

        if not meets(edf):
            continue
        rank = _smith_order(pending, edf, ends(edf)[-1], per_token)
        smith = sorted(range(n), key=lambda i: rank[i])
        assert meets(smith), (lengths, deadlines, smith)
        best = min(sum(ends(p)) for p in itertools.permutations(range(n)) if meets(p))
        assert sum(ends(smith)) == best, (lengths, deadlines, smith)
        checked += 1


# The first-token hold (§2.13, slack_first_token_hold). Under _config a full step is predicted
# at 1 + 0.1 x 40 = 5 ms, so at depth 1 a deadline more than 15 ms away is far enough to hold.
HELD = (60, 24, 40)  # 124 tokens: 2 x (1 + 12.4) ms = 26.8 ms, pressed for a 20 ms deadline


def test_pressed_prompts_far_from_their_deadline_keep_their_last_token(impl):
    sched, rows = _first_plan(impl, (0.02, 0.02, 0.02), HELD, slack_first_token_hold=True)
    assert rows == [("p1", 23), ("p2", 17)]
    plain = _first_plan(impl, (0.02, 0.02, 0.02), HELD)[1]
    assert plain == [("p1", 24), ("p2", 16)]


def test_a_held_last_token_goes_first_once_its_deadline_is_near(impl):
    sched = impl(_config(slack_first_token_hold=True))
    sched.set_clock(0.0)
    for k, n in enumerate(HELD):
        sched.submit(Sequence(f"p{k}", seeded_prompt(n, k), 2).with_deadlines(ttft_deadline=0.02))
    plan = sched.plan_iteration()
    assert row_sizes(plan) == [("p1", 23), ("p2", 17)]
    complete(sched, plan)
    sched.set_clock(0.002)  # 18 ms left: still held, and nothing for it in this plan
    plan = sched.plan_iteration()
    assert row_sizes(plan) == [("p2", 22), ("p0", 18)]
    complete(sched, plan)
    sched.set_clock(0.006)  # 14 ms left, within three full steps: released, first, toll-free
    plan = sched.plan_iteration()
    rows = row_sizes(plan)
    assert rows[:2] == [("p1", 1), ("p2", 1)] and plan.work[0].sample_last
    assert rows[2] == ("p0", 38)


def test_without_pressure_nothing_is_held(impl):
    """The same prompts with a 1 s deadline: their prefill takes a few ms, so none is held."""
    assert _first_plan(impl, (1.0, 1.0, 1.0), HELD, slack_first_token_hold=True)[1] == \
        [("p1", 24), ("p2", 16)]


def test_the_only_prompt_with_more_than_one_token_left_is_not_held(impl):
    """A one-token prompt is held while a longer one waits beside it; the longer one is not
    (nothing else with more than one token left would gain from it)."""
    deadlines, lengths = (0.02, 0.02), (100, 1)  # 2 x (1 + 10.1) ms >= 20 ms: pressed
    assert _first_plan(impl, deadlines, lengths, slack_first_token_hold=True)[1] == \
        [("p0", 40)]
    assert _first_plan(impl, deadlines, lengths)[1] == [("p1", 1), ("p0", 39)]


@pytest.mark.parametrize("hold", [True, False])
def test_a_released_last_token_rides_a_decode_only_plan(impl, hold):
    """The slack rule leaves no room for a chunk (d's 1 ms target is spent by its own decode
    step), so the plan is decode-only; with the hold on, a first-pending prompt with one token
    left and its deadline near goes in beside the decode row."""
    sched = impl(_config(slack_first_token_hold=hold))
    sched.set_clock(0.0)
    sched.submit(Sequence("d", seeded_prompt(5, 1), 4).with_deadlines(itl_target=0.001))
    plan = sched.plan_iteration()
    assert row_sizes(plan) == [("d", 5)]
    complete(sched, plan, [(0, 3)])
    sched.submit(Sequence("p", [4], 2).with_deadlines(ttft_deadline=0.005))
    plan = sched.plan_iteration()
    assert row_sizes(plan) == ([("d", 1), ("p", 1)] if hold else [("d", 1)])
    assert [w.phase for w in plan.work][:1] == [IterationPhase.DECODE]
