"""The shedding rule follows the slack rule's prefill order (serve/slo.py): a request is shed
only when its deadline and the admitted ones the rule keeps cannot all be met, in whatever order
the prompts are prefilled; no server needed (10 ms a prompt token, no fixed cost)."""
from __future__ import annotations

import itertools
import random

import pytest

from skippy_scheduler.serve.errors import RequestError
from skippy_scheduler.serve.slo import Slo, SloSettings
from skippy_scheduler.slack import StepCost

MS_PER_TOKEN = 10.0


def _slo(age_max_ms: float = 2000.0, shed: bool = True,
         batch_tokens: int = 512) -> tuple[Slo, list[float]]:
    now = [0.0]
    slo = Slo(SloSettings(ttft_ms=1000.0, shed=shed),
              cost=lambda: StepCost(base_us=0.0, per_prefill_token_us=MS_PER_TOKEN * 1e3),
              batch_tokens=batch_tokens, age_max_ms=age_max_ms, clock=lambda: now[0])
    return slo, now


def test_a_short_request_goes_ahead_of_long_ones_with_later_deadlines():
    slo, _ = _slo()
    slo.hold([200, 200], 5000.0)  # 2 s and 4 s of prefill, both within 5 s
    p = slo.predict(20, 1000.0)  # placed first: 0.2 s; the two then end at 2.2 and 4.2 s
    assert p is not None and p.met
    assert (p.ttft_ms, p.tokens, p.displaced) == (200.0, 20, 0)
    slo.admit(20, 1000.0)  # not shed
    # Counted in arrival order, as the order before deadlines did, it would be 4.2 s late.
    walk, _ = _slo(age_max_ms=0.0)
    walk.hold([200, 200], 5000.0)
    p = walk.predict(20, 1000.0)
    assert p is not None and not p.met and p.ttft_ms == 4200.0
    with pytest.raises(RequestError) as info:
        walk.admit(20, 1000.0)
    assert info.value.status == 503 and info.value.retry_after == 4
    assert "4200 ms" in str(info.value) and "420 prompt tokens" in str(info.value)


def test_a_request_that_would_make_an_admitted_one_miss_is_shed():
    slo, now = _slo()
    slo.hold([200], 2500.0)  # 2 s of prefill, within 2.5 s
    p = slo.predict(100, 1500.0)  # its own in 1 s, but the admitted one would end at 3 s
    assert p is not None and not p.met
    assert (p.ttft_ms, p.displaced, p.late_ms, p.retry_after_s) == (1000.0, 1, 500.0, 1)
    with pytest.raises(RequestError) as info:
        slo.admit(100, 1500.0)
    message = str(info.value)
    assert "1000 ms, within its TTFT budget of 1500 ms" in message
    assert "1 admitted request miss its own" in message
    assert slo.waiting_prefill_tokens == 200  # nothing held for the shed one
    now[0] = 1000.0  # later, 1 s of the admitted one's budget spent: 1.5 s left, 2 s of work
    p = slo.predict(10, 500.0)  # the admitted one is past saving: it no longer counts
    assert p is not None and p.met and p.ttft_ms == 100.0


def test_requests_past_saving_count_ahead_once_they_turn_overdue():
    slo, _ = _slo(age_max_ms=2000.0)
    slo.hold([300], 1000.0)  # 3 s of work for a 1 s budget: relegated; overdue at 3 s
    p = slo.predict(50, 1000.0)  # its deadline (1 s) comes before that: goes first
    assert p is not None and p.met and p.ttft_ms == 500.0
    p = slo.predict(50, 4000.0)  # by its deadline the relegated one is overdue, ahead of it
    assert p is not None and p.met and p.ttft_ms == 3500.0 and p.tokens == 350


def test_an_admitted_request_late_whatever_it_does_is_not_held_against_it():
    slo, _ = _slo(age_max_ms=1000.0)
    slo.hold([300], 1000.0)  # past saving: relegated, overdue at 2 s
    slo.hold([100], 3500.0)  # kept (1 s of work), but ends at 4 s once the overdue one is ahead
    p = slo.predict(10, 5000.0)  # after both: 4.1 s, within 5 s; the kept one's lateness is
    assert p is not None and p.met  # the overdue one's doing, not this request's
    assert (p.ttft_ms, p.displaced) == (4100.0, 0)
    p = slo.predict(10, 3000.0)  # before the kept one now: pushes it from 4.0 to 4.1 s, late
    assert p is not None and p.ttft_ms == 3100.0 and not p.met  # either way; itself late too
    assert p.displaced == 0


def test_prompts_without_a_budget_count_ahead_once_they_turn_overdue():
    """The rule serves a prompt without a budget after the deadlines, until it has waited the
    age bound (2 s here): then it is overdue and goes first."""
    slo, now = _slo()
    slo.hold([250], None)
    p = slo.predict(50, 1000.0)  # its deadline comes first: the other goes after it
    assert p is not None and p.met and p.ttft_ms == 500.0
    p = slo.predict(50, 2900.0)  # the other turns overdue at 2 s, before 2.9 s: ahead of it
    assert p is not None and not p.met and p.ttft_ms == 3000.0
    now[0] = 2000.0  # overdue now: ahead of any deadline
    p = slo.predict(50, 1000.0)
    assert p is not None and not p.met and p.ttft_ms == 3000.0


def test_hold_and_release_keep_one_entry_per_prompt():
    slo, _ = _slo()
    keys = slo.hold([40, 60], 1000.0)
    assert len(keys) == 2 and slo.waiting_prefill_tokens == 100
    slo.release(keys[0])
    slo.release(keys[0])  # released already: ignored
    assert slo.waiting_prefill_tokens == 60
    slo.release(keys[1])
    assert slo.waiting_prefill_tokens == 0
    off, _ = _slo(shed=False)
    assert off.hold([40], 1000.0) == [] and off.waiting_prefill_tokens == 0
    off.admit(10_000, 1.0)  # shedding off: never raises


def _most_on_time(jobs: list[tuple[float, int]]) -> int:
    """The most of `jobs` (deadline ms, tokens) any prefill order serves by their deadlines."""
    best = 0
    for r in range(len(jobs), 0, -1):
        for subset in itertools.combinations(jobs, r):
            # a set can be met in some order exactly when deadline order meets it
            end, ok = 0.0, True
            for d, w in sorted(subset):
                end += w * MS_PER_TOKEN
                ok = ok and end <= d
            if ok:
                return r
    return best


def test_only_what_is_left_of_a_tracked_prompt_counts():
    """The engine's report of how far each prompt got (`prefilled`) is subtracted from the
    prompts held with its sequence ids; those held without one count whole, and a released
    prompt counts no more whatever the report says."""
    done: dict[str, int] = {}
    slo, _ = _slo()
    slo.prefilled = done
    a, b = slo.hold([200, 200], 5000.0, ["seq-a", None])
    walk, _ = _slo(age_max_ms=0.0)
    walk.prefilled = done
    (w,) = walk.hold([300], 5000.0, ["seq-w"])
    p = slo.predict(20, 6000.0)  # behind both: 400 + 20 tokens
    assert p is not None and (p.tokens, p.ttft_ms) == (420, 4200.0)
    done["seq-a"] = 150  # 50 of a left
    done["seq-b"] = 150  # b was held without an id: it counts whole
    p = slo.predict(20, 6000.0)
    assert p is not None and (p.tokens, p.ttft_ms) == (270, 2700.0)
    done["seq-w"] = 280
    p = walk.predict(20, 1000.0)  # the walk order: everything ahead, what is left of it
    assert p is not None and p.tokens == 40
    done["seq-a"] = 500  # more than it holds (a restore counted in): nothing left, not less
    p = slo.predict(20, 6000.0)
    assert p is not None and p.tokens == 220
    slo.release(a, first_token=True)
    done["seq-a"] = 0  # released: the report no longer concerns it
    p = slo.predict(20, 6000.0)
    assert p is not None and p.tokens == 220 and slo.waiting_prefill_tokens == 200
    slo.release(b)
    assert slo.waiting_prefill_tokens == 0


def test_admitting_never_costs_an_on_time_request_brute_force():
    """On random sets: whenever the rule admits, the most requests any order can bring in
    time, the new one included, is one more than without it (no admitted deadline the order
    could meet is given up); and when every admitted deadline can be met, it admits exactly
    when all of them and the new one can be."""
    rng = random.Random(7)
    admitted = checked = 0
    for _ in range(1500):
        slo, _ = _slo(age_max_ms=1e9)  # nothing turns overdue within these deadlines
        held = [(float(rng.randrange(100, 3000)), rng.randrange(1, 120))
                for _ in range(rng.randrange(0, 6))]
        for d, w in held:
            slo.hold([w], d)
        new = (float(rng.randrange(100, 3000)), rng.randrange(1, 120))
        p = slo.predict(new[1], new[0])
        assert p is not None
        before = _most_on_time(held)
        if p.met:
            admitted += 1
            assert _most_on_time(held + [new]) == before + 1
        if before == len(held):
            checked += 1
            assert p.met == (_most_on_time(held + [new]) == len(held) + 1)
    assert admitted > 200 and checked > 200  # both sides of the rule were exercised


def test_the_prediction_takes_the_drain_rate_the_server_achieved_when_slower():
    """Prompts that took 20 ms a token to reach their first token (not the model's 10) make
    the prediction 20 ms a token; the rate counts only time with a backlog (at least a step's
    100 tokens waiting), only prompts that got a first token, and only once enough was
    measured."""
    slo, now = _slo(batch_tokens=100)
    assert slo.drain_rate() is None
    keys = slo.hold([100, 100], 10_000.0)
    now[0] = 2000.0
    slo.release(keys[0], first_token=True)  # 100 tokens in 2 s: too few to read yet
    assert slo.drain_rate() is None
    now[0] = 4000.0
    slo.release(keys[1], first_token=True)  # 200 tokens in 4 s, still under 256
    assert slo.drain_rate() is None
    now[0] = 100_000.0  # idle time (nothing waiting) does not count
    (key,) = slo.hold([200], 10_000.0)
    gone = slo.hold([1000], 10_000.0)  # ended before a first token: not drained
    now[0] = 104_000.0
    slo.release(gone[0])
    slo.release(key, first_token=True)  # 400 tokens in 8 s of waiting: 0.05 a ms
    assert slo.drain_rate() == pytest.approx(0.05)
    p = slo.predict(10, 1000.0)
    assert p is not None and p.ttft_ms == pytest.approx(200.0) and p.met  # 20 ms a token
    # Faster than the model: the model's cost stays the floor.
    fast, now2 = _slo()
    k = fast.hold([1000], 10_000.0)
    now2[0] = 1000.0
    fast.release(k[0], first_token=True)  # 1 token a ms
    assert fast.drain_rate() == pytest.approx(1.0)
    p = fast.predict(10, 1000.0)
    assert p is not None and p.ttft_ms == pytest.approx(100.0)


def test_the_drain_rate_counts_only_time_with_a_backlog():
    slo, now = _slo(batch_tokens=512)
    for _ in range(5):  # a lone 300-token prompt at a time, 10 s each: the server is not
        (k,) = slo.hold([300], 100_000.0)  # prefill-bound, so its wait says nothing of its
        now[0] += 10_000.0  # throughput
        slo.release(k, first_token=True)
    assert slo.drain_rate() is None
    ks = slo.hold([300, 300], 100_000.0)  # 600 waiting: a backlog, drained at 0.2 a ms
    now[0] += 3000.0
    slo.release(ks[0], first_token=True)
    now[0] += 1.0  # the same step's other first token: the backlog ended a moment ago
    slo.release(ks[1], first_token=True)
    assert slo.drain_rate() == pytest.approx(0.2)
    (k,) = slo.hold([300], 100_000.0)  # a lone one again, long after the backlog
    now[0] += 10_000.0
    slo.release(k, first_token=True)
    assert slo.drain_rate() == pytest.approx(0.2)


def test_the_drain_rate_forgets_what_is_older_than_its_window():
    slo, now = _slo(batch_tokens=100)
    (k,) = slo.hold([400], 100_000.0)
    now[0] = 40_000.0
    slo.release(k, first_token=True)  # 0.01 a ms, 40 s of waiting ago
    for i in range(31):
        (k,) = slo.hold([1000], 100_000.0)
        now[0] += 1000.0
        slo.release(k, first_token=True)  # then 1 token a ms for 31 s
    assert slo.drain_rate() == pytest.approx(1.0)  # the last 30 s of waiting alone


def test_an_admitted_request_of_lower_priority_does_not_shed_a_higher_one():
    """The server puts a request of higher priority first (admission, preemption for priority):
    making an admitted request of lower priority late does not shed it; one of the same or a
    higher priority still does."""
    slo, _ = _slo()
    slo.hold([200], 2500.0)  # priority 0: 2 s of prefill, within 2.5 s
    p = slo.predict(100, 1500.0, priority=5)  # its own in 1 s; the admitted one then at 3 s
    assert p is not None and p.met and (p.ttft_ms, p.displaced) == (1000.0, 0)
    slo.admit(100, 1500.0, priority=5)  # not shed
    p = slo.predict(100, 1500.0)  # the same priority as the admitted one: shed, as before
    assert p is not None and not p.met and p.displaced == 1
    urgent, _ = _slo()
    urgent.hold([200], 2500.0, priority=9)  # an admitted request of higher priority
    p = urgent.predict(100, 1500.0, priority=5)
    assert p is not None and not p.met and p.displaced == 1


def test_the_time_spent_before_admission_counts_against_the_budget():
    """A request admitted `spent_ms` after its arrival (reading and tokenizing it): its
    predicted TTFT and its deadline count from its arrival, in both walk orders."""
    for age in (2000.0, 0.0):
        slo, now = _slo(age_max_ms=age)
        now[0] = 5000.0
        p = slo.predict(50, 1000.0, spent_ms=400.0)  # 0.5 s of prefill, 0.4 s already gone
        assert p is not None and p.met and p.ttft_ms == 900.0
        p = slo.predict(50, 1000.0, spent_ms=600.0)  # 1.1 s from arrival: over
        assert p is not None and not p.met and p.ttft_ms == 1100.0 and p.late_ms == 100.0
        with pytest.raises(RequestError) as info:
            slo.admit(50, 1000.0, spent_ms=600.0)
        assert "1100 ms" in str(info.value) and "budget of 1000 ms" in str(info.value)
    # A held prompt's deadline counts from its arrival too: 0.3 s of prefill due 0.7 s from
    # now. A request of 45 tokens due in 0.5 s goes first and would push it to 0.75 s: shed.
    # Had the held one arrived now (due in 1 s), the same request would be served.
    slo, now = _slo()
    slo.hold([30], 1000.0, spent_ms=300.0)
    p = slo.predict(45, 500.0)
    assert p is not None and not p.met and p.displaced == 1 and p.late_ms == 50.0
    fresh, _ = _slo()
    fresh.hold([30], 1000.0)
    q = fresh.predict(45, 500.0)
    assert q is not None and q.met and q.ttft_ms == 450.0
