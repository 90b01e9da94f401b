"""The cold prefix hold (behaviour.md §2.3a) on the native scheduler with the native store and
on the twin with the twin store: who is held and for how long, what is reported to keep, and
the bounds (the leader leaving, the step limit, no store, a restore that already covers the
shared part)."""
from __future__ import annotations

import numpy as np
import pytest

from skippy_scheduler import (
    IterationPrediction,
    MemoryComponent,
    PlanningRule,
    Scheduler,
    SchedulerConfig,
    Sequence,
    StepCost,
    TwinScheduler,
)
from skippy_scheduler.prefix_store import PrefixStore
from skippy_scheduler.reference import PrefixStoreTwin
from sched_helpers import complete as complete_plan

PAIRS = [pytest.param((Scheduler, PrefixStore), id="native"),
         pytest.param((TwinScheduler, PrefixStoreTwin), id="twin")]
HEAD = list(range(100, 112))  # 12 shared tokens


@pytest.fixture(params=PAIRS)
def pair(request):
    return request.param


def make(pair, store=True, **config):
    sched_cls, store_cls = pair
    config.setdefault("max_active_sequences", 8)
    config.setdefault("prefill_chunk_tokens", 4)
    config.setdefault("cold_prefix_hold_tokens", 4)
    sched = sched_cls(SchedulerConfig(**config))
    st = store_cls(capacity_tokens=None, holder_slots=8, first_holder_id=240) if store else None
    if st is not None:
        sched.attach_prefix_store(st)
    return sched, st


def burst(sched, n=3, tail=2):
    for i in range(n):
        sched.submit(Sequence(f"s{i}", HEAD + [i] * tail, 3))


def step(sched, store=None, token=7):
    """One plan, completed; with `store`, the reported prompts are inserted (what the engine
    has the host do). Returns (rows as (id, first position, tokens), keeps)."""
    plan = sched.plan_iteration()
    rows = [(w.sequence_id, w.positions[0], len(w.tokens)) for w in plan.work]
    telemetry = complete_plan(sched, plan, [IterationPrediction(i, token)
                                            for i, w in enumerate(plan.work) if w.sample_last])
    keeps = telemetry.prompt_keeps
    if store is not None:
        for sid, n in keeps:
            store.insert(np.asarray(PROMPTS[sid][:n], dtype=np.int32))
    return rows, keeps


PROMPTS = {f"s{i}": HEAD + [i] * 2 for i in range(4)}


def test_off_by_default_a_burst_is_admitted_at_once(pair):
    sched, _ = make(pair, cold_prefix_hold_tokens=0)
    burst(sched)
    rows, keeps = step(sched)
    assert [r[0] for r in rows] == ["s0", "s1", "s2"] and keeps == ()


def test_peers_wait_for_the_leaders_prompt_then_restore_it(pair):
    sched, store = make(pair)
    burst(sched)
    sched.submit(Sequence("u", [5, 6, 7], 2))  # shares nothing: never held
    rows, keeps = step(sched, store)
    assert sorted(r[0] for r in rows) == ["s0", "u"]
    assert sched.snapshot().waiting_ids == ["s1", "s2"]
    for _ in range(2):  # the rest of s0's 14-token prompt, 4 tokens a plan
        rows, keeps = step(sched, store)
        assert "s1" not in [r[0] for r in rows] and keeps == ()
    rows, keeps = step(sched, store)  # its last chunk samples its first token
    assert keeps == (("s0", 14),)
    rows, keeps = step(sched, store)
    assert keeps == ()  # each leader once
    first = {sid: (pos, n) for sid, pos, n in rows}
    assert first["s1"] == (12, 2) and first["s2"] == (12, 2)  # the shared head restored
    m = sched.metrics()
    assert m.restored_tokens == 24 and m.stale_refreshes == 2


def test_a_cancelled_leader_releases_its_peers(pair):
    sched, store = make(pair)
    burst(sched)
    step(sched, store)
    assert sched.cancel("s0")
    rows, _ = step(sched, store)
    # s1 now leads (no restore to wait for) and s2 is held on it
    assert [r[0] for r in rows] == ["s1"] and sched.snapshot().waiting_ids == ["s2"]


def test_a_peer_is_held_for_at_most_the_step_limit(pair):
    sched, store = make(pair, prefill_chunk_tokens=1, cold_prefix_hold_max_steps=3)
    burst(sched, n=2)
    held = 0
    while sched.snapshot().waiting_ids:
        step(sched)  # nothing is inserted: the prompt never becomes resident
        held += 1
    assert held == 4  # admitted at the fourth plan, unrestored


def test_no_hold_without_a_store_or_with_the_shared_part_resident(pair):
    sched, _ = make(pair, store=False)
    burst(sched)
    assert len(step(sched)[0]) == 3
    sched, store = make(pair)
    store.insert(np.asarray(HEAD, dtype=np.int32))
    burst(sched)
    assert len(step(sched)[0]) == 3  # each restores the head: nothing left to wait for
    sched, store = make(pair, cold_prefix_hold_tokens=13)  # more than they share
    burst(sched)
    assert len(step(sched)[0]) == 3


def test_a_preempted_leader_holds_nobody_and_everything_finishes(pair):
    sched, store = make(pair, memory_components=[MemoryComponent("kv", 10**6, 0, 1, 0)])
    burst(sched, n=4)
    step(sched, store)
    assert sched.preempt_for_component_pressure([10**7]) == ["s0"]
    assert sched.preempt_for_component_pressure([0]) == []  # the spike is over
    for _ in range(40):
        if not (sched.snapshot().waiting_ids or sched.snapshot().active_ids):
            break
        step(sched, store)
    m = sched.metrics()
    assert m.finished == 4 and m.restored_tokens > 0


@pytest.mark.parametrize("value,error", [(-1, ValueError), (True, TypeError), (1.5, TypeError)])
def test_the_settings_are_checked(value, error):
    with pytest.raises(error):
        SchedulerConfig(cold_prefix_hold_tokens=value)
    with pytest.raises(error):
        SchedulerConfig(cold_prefix_hold_max_steps=value)


def test_a_prompt_the_store_never_gets_holds_its_peers_no_longer_than_the_leaders_prefill(pair):
    """The leader leads until its first token; at depth 1 the keep would be applied before the
    next plan, so if the prefix is still not resident then, its peers are admitted as they are."""
    sched, _ = make(pair)
    burst(sched, n=2)
    plans = []
    while sched.snapshot().waiting_ids:
        rows, keeps = step(sched)  # the reported prompt is never inserted
        plans.append((rows, keeps))
    assert len(plans) == 5 and plans[3][1] == (("s0", 14),)  # 4 chunks, then s1 at plan 5
    s1 = sched.sequence("s1")
    assert s1.prefix_restore is None and s1.prefill_cursor == 4  # first chunk, unrestored


def test_at_depth_two_the_leader_leads_one_plan_more(pair):
    sched, _ = make(pair, max_inflight_plans=2)
    burst(sched, n=2)
    live = []
    made = 0
    while sched.snapshot().waiting_ids:
        live.append(sched.plan_iteration())
        made += 1
        if len(live) == 2:
            plan = live.pop(0)
            complete_plan(sched, plan, [IterationPrediction(i, 7)
                                        for i, w in enumerate(plan.work) if w.sample_last])
    # s0's 4 chunks are plans 1-4; plan 5 is made before plan 4 completes, plan 6 before its
    # keep could be applied, so s1 is admitted by plan 7
    assert made == 7


def test_with_priority_preemption_the_peers_are_still_held(pair):
    """The priority pass (§2.8a) runs after the walk: what the walk held stays waiting, so the
    burst restores the head as without that pass."""
    sched, store = make(pair, priority_preemption=True)
    burst(sched)
    rows, _ = step(sched, store)
    assert [r[0] for r in rows] == ["s0"] and sched.snapshot().waiting_ids == ["s1", "s2"]
    while sched.snapshot().waiting_ids:
        step(sched, store)
    assert sched.metrics().restored_tokens == 24


def test_a_held_peer_of_higher_priority_takes_no_victim(pair):
    """A peer the walk could not admit (no lane), that would preempt a lower-priority sequence,
    is put to the hold first: while its leader computes the shared head it waits and preempts
    nobody; once the head is resident it preempts and restores it."""
    sched, store = make(pair, priority_preemption=True, max_active_sequences=2)
    sched.submit(Sequence("s0", PROMPTS["s0"], 3))
    sched.submit(Sequence("u", [5, 6, 7, 8], 20))
    step(sched, store)  # both admitted; s0 computes its head
    sched.submit(Sequence("s1", PROMPTS["s1"], 3, priority=5))
    rows, keeps = step(sched, store)
    assert "s1" not in [r[0] for r in rows] and sched.snapshot().waiting_ids == ["s1"]
    assert sched.metrics().preempted_priority == 0
    while "s1" in sched.snapshot().waiting_ids:
        step(sched, store)
    m = sched.metrics()
    assert m.preempted_priority == 1 and m.restored_tokens == 12
    assert sched.snapshot().waiting_ids == ["u"]


def test_the_first_token_hold_never_holds_a_leader(pair):
    """Under the slack rule's first-token hold (§2.13 step 7, on in `serve`), a pressed burst
    holds back the last token of prompts with time to spare; a leader's peers wait for its
    first token, so the leader's last token goes in at once, and its peers follow restoring."""
    sched, store = make(pair, planning_rule=PlanningRule.SLACK, slack_first_token_hold=True,
                        step_cost=StepCost(base_us=2000, per_prefill_token_us=50_000),
                        max_tokens_per_iteration=8, prefill_chunk_tokens=8, itl_target=1.0)
    sched.set_clock(0.0)
    for sid, prompt in (("s0", PROMPTS["s0"]), ("s1", PROMPTS["s1"]), ("u", [5] * 40)):
        sched.submit(Sequence(sid, prompt, 3).with_deadlines(ttft_deadline=3.0))
    # pressed: the 94 prompt tokens at 50 ms each, twice, run past the 3 s deadlines; each
    # deadline is later than the release margin (3 full steps of 8 tokens, 1.2 s)
    rows, keeps = step(sched, store)
    assert rows == [("s0", 0, 8)] and sched.snapshot().waiting_ids == ["s1"]
    rows, keeps = step(sched, store)
    assert rows[0] == ("s0", 8, 6)  # the whole rest of its prompt, last token included
    assert keeps == (("s0", 14),)
    rows, keeps = step(sched, store)
    # s1 restores the shared head; not a leader, its own last token is held like any other
    assert ("s1", 12, 1) in rows


def test_a_peer_arriving_while_the_leader_decodes_waits_for_its_keep(pair):
    """A late leader (§2.3a): s0 has its first token when s1, sharing its head, arrives. s1 is
    held one plan, s0's prompt is reported at that plan's completion, and s1 restores it."""
    sched, store = make(pair)
    sched.submit(Sequence("s0", PROMPTS["s0"], 10))
    for _ in range(4):  # 14 prompt tokens, 4 a plan: the fourth samples the first token
        rows, keeps = step(sched, store)
        assert keeps == ()
    sched.submit(Sequence("s1", PROMPTS["s1"], 3))
    rows, keeps = step(sched, store)
    assert [r[0] for r in rows] == ["s0"] and sched.snapshot().waiting_ids == ["s1"]
    assert keeps == (("s0", 14),)
    rows, keeps = step(sched, store)
    assert ("s1", 12, 2) in rows and keeps == ()
    m = sched.metrics()
    assert m.restored_tokens == 12 and m.stale_refreshes == 1
    # a third peer finds the head resident: restored at once, nobody held or kept
    sched.submit(Sequence("s2", PROMPTS["s2"], 3))
    rows, keeps = step(sched, store)
    assert ("s2", 12, 2) in rows and keeps == ()


def test_a_late_leader_whose_keep_never_lands_holds_for_one_plan_a_depth(pair):
    """The store never gets the late leader's prompt: at depth D its peer is held for the D
    plans made before a keep could be applied, then admitted unrestored; the leader is
    reported once."""
    for depth in (1, 2):
        sched, _ = make(pair, max_inflight_plans=depth)
        sched.submit(Sequence("s0", PROMPTS["s0"], 20))
        live = []

        def advance():
            live.append(sched.plan_iteration())
            if len(live) == depth:
                plan = live.pop(0)
                return complete_plan(sched, plan, [IterationPrediction(i, 7) for i, w
                                                   in enumerate(plan.work) if w.sample_last])
            return None

        while not sched.sequence("s0").generated_tokens:  # confirmed tokens only
            advance()
        sched.submit(Sequence("s1", PROMPTS["s1"], 3))
        held, keeps = 0, []
        while "s1" in sched.snapshot().waiting_ids:
            telemetry = advance()
            if telemetry is not None:
                keeps.extend(telemetry.prompt_keeps)
            held += 1
        assert held == depth + 1 and keeps == [("s0", 14)]
        assert sched.sequence("s1").prefix_restore is None


def test_a_sequence_recomputing_after_preemption_leads_nobody_while_it_replays(pair):
    """s0 has 4 tokens when it is preempted, and is readmitted replaying its 14-token prompt and
    3 of them (17 tokens, 4 a plan). Past its prompt but not through its replay, it is no late
    leader yet: a sharer that comes then is admitted at once."""
    sched, store = make(pair, memory_components=[MemoryComponent("kv", 10**6, 0, 1, 0)])
    sched.submit(Sequence("s0", PROMPTS["s0"], 20))
    for _ in range(7):  # 4 chunks of the prompt, then 3 decodes
        step(sched, store)
    assert sched.preempt_for_component_pressure([10**7]) == ["s0"]
    assert sched.preempt_for_component_pressure([0]) == []
    for _ in range(4):
        step(sched, store)
    s0 = sched.sequence("s0")
    assert s0.prefill_cursor == 16 and s0.recompute_token_count() == 17
    sched.submit(Sequence("s1", PROMPTS["s1"], 3))
    rows, keeps = step(sched, store)
    assert ("s1", 0, 4) in rows and keeps == ()


def test_a_leader_is_reported_only_once_its_rows_before_the_hold_have_run(pair):
    """Depth 3: s0 recomputes its 14-token prompt after a preemption in three chunks, all
    planned; a sharer held on it then must not get s0's prompt reported by the completion of
    the second chunk (the third, which ends the prompt, is still in flight), only by the one
    that confirms s0's next token (its decode row, planned with the sharer held)."""
    sched, store = make(pair, max_inflight_plans=3, prefill_chunk_tokens=5,
                        memory_components=[MemoryComponent("kv", 10**6, 0, 1, 0)])
    sched.submit(Sequence("s0", PROMPTS["s0"], 20))
    while not sched.sequence("s0").generated_tokens:
        step(sched, store)  # one plan at a time
    assert sched.preempt_for_component_pressure([10**7]) == ["s0"]
    assert sched.preempt_for_component_pressure([0]) == []
    live = [sched.plan_iteration() for _ in range(3)]  # the replay: 5 + 5 + 4 tokens
    assert [[(w.sequence_id, w.positions[0]) for w in p.work] for p in live] == [
        [("s0", 0)], [("s0", 5)], [("s0", 10)]]

    def finish():
        plan = live.pop(0)
        return complete_plan(sched, plan, [IterationPrediction(i, 7)
                                           for i, w in enumerate(plan.work) if w.sample_last])

    assert finish().prompt_keeps == ()
    sched.submit(Sequence("s1", PROMPTS["s1"], 3))
    live.append(sched.plan_iteration())
    assert sched.snapshot().waiting_ids == ["s1"]  # held on s0, its replay all planned
    assert finish().prompt_keeps == ()  # the prompt's last chunk has not run
    assert finish().prompt_keeps == ()  # it has; no new token yet
    assert finish().prompt_keeps == (("s0", 14),)


@pytest.mark.parametrize("depth", [1, 2])
def test_a_refused_keep_does_not_make_a_burst_wait_peer_after_peer(pair, depth):
    """The store takes none of the prompts (the reported one is never inserted, as when every
    holder is pinned): after the first leader's keep fails to land, its three peers are
    admitted together, not each held on the one admitted before it (a peer admitted after a
    hold that gained it nothing leads nobody). A new burst is held as usual."""
    sched, store = make(pair, max_inflight_plans=depth, prefill_chunk_tokens=8)
    burst(sched, n=4)
    live, admitted_at, made = [], {}, 0

    def advance(insert=False):
        nonlocal made
        live.append(sched.plan_iteration())
        made += 1
        for w in live[-1].work:
            admitted_at.setdefault(w.sequence_id, made)
        if len(live) == depth:
            plan = live.pop(0)
            complete_plan(sched, plan, [IterationPrediction(i, 7)
                                        for i, w in enumerate(plan.work) if w.sample_last])

    while sched.snapshot().waiting_ids:
        advance()
    # s0's 14 tokens are 2 plans; its keep is reported when its first token is confirmed and
    # its window ends `depth` tokens after: the three peers come in one plan
    assert admitted_at["s0"] == 1
    assert admitted_at["s1"] == admitted_at["s2"] == admitted_at["s3"] == 1 + 2 * depth
    while sched.snapshot().active_ids:
        advance()
    for plan in live:  # what is still in flight lands
        complete_plan(sched, plan, [])
    live.clear()
    for i in range(2):
        sched.submit(Sequence(f"t{i}", [50 + j for j in range(12)] + [i] * 2, 3))
    admitted_at.clear()
    advance()
    assert "t0" in admitted_at and "t1" not in admitted_at  # held again


def test_a_late_leader_that_does_not_decode_is_kept_at_once(pair):
    """A late leader is reported at the next completion whether or not it decodes then: here an
    unrelated 64-token prompt runs prefill-only plans (the reference's phase rule) while A, whose
    prompt shares 40 tokens with W's, waits to decode; W restores them at the second plan."""
    sched, store = make(pair, prefill_chunk_tokens=8, max_tokens_per_iteration=64,
                        max_consecutive_prefill_iterations=8)
    head = list(range(100, 140))
    PROMPTS.update(A=head + [0, 0], W=head + [1, 1], U=list(range(500, 564)))
    try:
        sched.submit(Sequence("A", PROMPTS["A"], 100))
        while not sched.sequence("A").generated_tokens:
            step(sched, store)
        step(sched, store)  # A decodes
        sched.submit(Sequence("U", PROMPTS["U"], 3))
        sched.submit(Sequence("W", PROMPTS["W"], 3))
        rows, keeps = step(sched, store)
        assert "W" not in [r[0] for r in rows] and keeps == (("A", 42),)
        rows, keeps = step(sched, store)
        assert ("W", 40, 2) in rows
    finally:
        for k in ("A", "W", "U"):
            del PROMPTS[k]


def test_a_refused_keep_in_one_group_leaves_the_others_held(pair):
    """Group 1's leader has its keep refused, group 2's is taken: group 1's peer is admitted
    unrestored and leads nobody; group 2's peer still waits for its leader and restores."""
    sched, store = make(pair, prefill_chunk_tokens=4)
    g1, g2 = list(range(100, 108)), list(range(200, 230))
    prompts = {"a1": g1 + [0], "b1": g1 + [1], "a2": g2 + [0], "b2": g2 + [1]}
    for sid, p in prompts.items():
        sched.submit(Sequence(sid, p, 50))
    first = {}
    for n in range(1, 14):
        plan = sched.plan_iteration()
        telemetry = complete_plan(sched, plan, [IterationPrediction(i, 7) for i, w
                                                in enumerate(plan.work) if w.sample_last])
        for sid, k in telemetry.prompt_keeps:
            if sid != "a1":  # a1's keep is refused
                store.insert(np.asarray(prompts[sid][:k], dtype=np.int32))
        for w in plan.work:
            first.setdefault(w.sequence_id, (n, w.positions[0]))
    assert first["b1"][1] == 0  # unrestored
    assert first["b2"][1] == 30 and first["b2"][0] > first["b1"][0]  # waited, then restored
    assert sched.metrics().restored_tokens == 30
