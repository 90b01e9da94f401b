"""A preempted sequence resumes from its own resident KV (behaviour.md §2.12, §2.8a), native
and twin: with a prefix store attached, the store is matched against the sequence's replay
(prompt and generated tokens but the pending one), so when the host kept what the victim had
computed, the re-admission restores all of it, counts it in `restored_tokens`, and starts with
the decode row of its pending token; when the entry is evicted meanwhile the refresh notices
(a stale refresh) and the resume recomputes."""
from __future__ import annotations

import numpy as np
import pytest

from skippy_scheduler import (IterationPhase, IterationPrediction, MemoryComponent, Scheduler,
                              SchedulerConfig, Sequence, TwinScheduler)
from skippy_scheduler.prefix_store import PrefixStore
from skippy_scheduler.reference import PrefixStoreTwin
from sched_helpers import complete as complete_plan

PAIRS = [pytest.param((Scheduler, PrefixStore), id="native"),
         pytest.param((TwinScheduler, PrefixStoreTwin), id="twin")]
PROMPT = [1, 2, 3, 4, 5, 6]


@pytest.fixture(params=PAIRS)
def pair(request):
    return request.param


def toks(values):
    return np.asarray(values, dtype=np.int32)


def attached(pair, capacity_tokens=None, **config):
    sched_cls, store_cls = pair
    config.setdefault("max_active_sequences", 1)
    sched = sched_cls(SchedulerConfig(**config))
    store = store_cls(capacity_tokens=capacity_tokens, holder_slots=4, first_holder_id=20)
    sched.attach_prefix_store(store, prefill_cost_per_token=10)
    return sched, store


def run_steps(sched, n, token=7):
    """n plans, each completed with `token` for every sampling row."""
    for _ in range(n):
        plan = sched.plan_iteration()
        preds = [IterationPrediction(i, token + k) for k, (i, w) in
                 enumerate((i, w) for i, w in enumerate(plan.work) if w.sample_last)]
        complete_plan(sched, plan, preds)


def first_rows(plan):
    rows = {}
    for i, w in enumerate(plan.work):
        rows.setdefault(w.sequence_id, (i, w))
    return rows


def preempted_low(pair, **kw):
    """`low` prefilled and decoded three tokens, then preempted for priority by `high`."""
    sched, store = attached(pair, priority_preemption=True, **kw)
    sched.submit(Sequence("low", PROMPT, 20, None, 0))
    run_steps(sched, 4)  # prefill (samples 7), then three decodes
    low = sched.sequence("low")
    assert len(low.generated_tokens) == 4
    sched.submit(Sequence("high", [9, 9], 5, None, 5))
    plan = sched.plan_iteration()
    assert plan.priority_victims == ("low",)
    return sched, store, plan


def keep_replay(store, sched, sid):
    """What a host's release keeps: every position its lane computed (the replay)."""
    s = sched.sequence(sid)
    key = list(s.prompt_tokens) + list(s.generated_tokens[:-1])
    return store.insert(toks(key))


def test_a_victim_whose_kv_was_kept_resumes_from_it_with_nothing_recomputed(pair):
    sched, store, plan = preempted_low(pair)
    entry = keep_replay(store, sched, "low")  # the host releases the victim's lane
    complete_plan(sched, plan, [IterationPrediction(i, -1) for i, w in enumerate(plan.work)
                                if w.sample_last])  # high ends
    replay = len(PROMPT) + 3
    restored_before = sched.metrics().restored_tokens
    plan = sched.plan_iteration()
    i, row = first_rows(plan)["low"]
    # The first row after the resume is the decode of the pending token, at the replay's end.
    assert row.phase is IterationPhase.DECODE and list(row.positions) == [replay]
    assert plan.new_rows[i] == 1 and int(plan.restored_tokens[i]) == replay
    assert row.restore_holder == entry.holder and entry.pins == 1
    m = sched.metrics()
    assert m.restored_tokens - restored_before == replay and m.stale_refreshes == 1
    complete_plan(sched, plan, [IterationPrediction(i, 7) for i, w in enumerate(plan.work)
                                if w.sample_last])
    assert sched.metrics().recompute_tokens == 0
    assert sched.sequence("low").prefix_restore.token_count == replay


def test_an_evicted_victim_entry_falls_back_to_recompute(pair):
    sched, store, plan = preempted_low(pair)
    entry = keep_replay(store, sched, "low")
    complete_plan(sched, plan, [IterationPrediction(i, 7) for i, w in enumerate(plan.work)
                                if w.sample_last])  # high's first token is not final
    run_steps(sched, 1)  # low is re-read before this plan: a restore of its whole replay
    assert sched.sequence("low").prefix_restore.token_count == len(PROMPT) + 3
    assert sched.metrics().stale_refreshes == 1
    assert store.evict_one() is entry  # pressure on the store before low resumes
    run_steps(sched, 1, token=-1)  # low is re-read again (nothing resident), high ends
    assert sched.metrics().stale_refreshes == 2
    plan = sched.plan_iteration()
    i, row = first_rows(plan)["low"]
    assert row.phase is IterationPhase.RECOMPUTE and row.positions[0] == 0
    assert int(plan.restored_tokens[i]) == 0 and row.restore_holder is None
    assert sched.metrics().restored_tokens == 0


def test_a_partly_kept_replay_restores_what_is_resident(pair):
    sched, store, plan = preempted_low(pair)
    store.insert(toks(PROMPT + [7]))  # the prompt and the first generated token only
    complete_plan(sched, plan, [IterationPrediction(i, -1) for i, w in enumerate(plan.work)
                                if w.sample_last])  # high ends
    plan = sched.plan_iteration()
    i, row = first_rows(plan)["low"]
    assert int(plan.restored_tokens[i]) == len(PROMPT) + 1
    assert row.phase is IterationPhase.RECOMPUTE and list(row.positions) == [7, 8]
    complete_plan(sched, plan, [IterationPrediction(i, 7) for i, w in enumerate(plan.work)
                                if w.sample_last])
    assert sched.metrics().recompute_tokens == 2  # the generated tokens the entry lacked


def test_a_memory_victim_resumes_from_its_kept_kv_too(pair):
    kv = MemoryComponent("kv", 1000, 0, 1, 0)
    sched, store = attached(pair, memory_components=[kv])
    sched.submit(Sequence("a", PROMPT, 20))
    run_steps(sched, 3)
    assert sched.preempt_for_component_pressure([2000]) == ["a"]
    sched.preempt_for_component_pressure([0])
    keep_replay(store, sched, "a")
    plan = sched.plan_iteration()
    i, row = first_rows(plan)["a"]
    assert row.phase is IterationPhase.DECODE and int(plan.restored_tokens[i]) == len(PROMPT) + 2


def test_a_waiting_prompt_is_not_matched_past_its_own_tokens(pair):
    """A sequence with nothing generated still matches only its prompt (a longer resident key
    restores at most the prompt, less the last token whose logits are needed)."""
    sched, store = attached(pair, max_active_sequences=2)
    store.insert(toks(PROMPT + [7, 8, 9]))
    sched.submit(Sequence("b", PROMPT, 3))
    plan = sched.plan_iteration()
    i, row = first_rows(plan)["b"]
    assert int(plan.restored_tokens[i]) == len(PROMPT) - 1
    assert sched.sequence("b").prefix_restore.token_count == len(PROMPT)


# -- native and twin under random schedules with priority victims whose KV is kept ------------

PROMPTS = [[1, 2, 3, 4], [1, 2, 3, 5, 5], [1, 2], [6, 6, 6], [1, 2, 3, 4, 8]]
IDS = [f"s{k}" for k in range(7)]


def _outcome(fn):
    try:
        return "ok", fn()
    except Exception as exc:  # noqa: BLE001 - the type is what is compared
        return "raised", type(exc)


def _plan_view(plan):
    return ([(w.sequence_id, w.tokens, w.positions, w.phase, w.sample_last, w.restore_holder)
             for w in plan.work], plan.admitted, plan.preempted,
            np.asarray(plan.new_rows).tolist(), np.asarray(plan.restored_tokens).tolist())


def _run_resumes(seed, steps=240):
    """Random submits at mixed priorities, plans, completions, memory pressure; after every
    plan each priority victim's replay is kept (or not) as a host's release would, and
    entries are evicted now and then. Returns how many resumes restored generated tokens."""
    import random

    rng = random.Random(seed)
    depth = rng.choice([1, 2])
    kv = MemoryComponent("kv", rng.choice([40, 80]), 0, 1, 0)
    config = SchedulerConfig(max_active_sequences=rng.choice([1, 2, 3]), max_inflight_plans=depth,
                             max_tokens_per_iteration=rng.choice([4, 16]),
                             prefill_chunk_tokens=rng.choice([2, 16]),
                             mixed_prefill_decode=rng.random() < 0.5,
                             priority_preemption=True,
                             priority_preemption_guard_steps=rng.choice([1, 3]),
                             memory_components=[kv] if rng.random() < 0.5 else [])
    capacity = rng.choice([None, 24, 48])
    sides = []
    for sched_cls, store_cls in ((Scheduler, PrefixStore), (TwinScheduler, PrefixStoreTwin)):
        sched = sched_cls(config)
        store = store_cls(capacity_tokens=capacity, holder_slots=6, first_holder_id=8)
        sched.attach_prefix_store(store, prefill_cost_per_token=10)
        sides.append([sched, store, []])
    resumes = 0

    def both(fn):
        a, b = (_outcome(lambda side=side: fn(*side)) for side in sides)
        assert a == b, (seed, step, a, b)
        return a

    def keep(sched, store, plans, sid):
        view = sched.sequence(sid)
        key = list(view.prompt_tokens) + list(view.generated_tokens[:-1])
        entry = store.insert(toks(key))
        return None if entry is None else entry.holder

    for step in range(steps):
        op = rng.choices(["submit", "plan", "complete", "evict", "pressure"],
                         weights=[10, 14, 14, 2, 2])[0]
        if op == "submit":
            sid, prompt = rng.choice(IDS), rng.choice(PROMPTS)
            spec = (sid, prompt, rng.randint(2, 9), None, rng.randint(0, 3))
            both(lambda s, st, pl: s.submit(Sequence(*spec)))
        elif op == "plan":
            if len(sides[0][2]) >= depth:
                continue

            def plan(s, st, pl):
                p = s.plan_iteration()
                pl[:] = [p] if depth == 1 else pl + [p]
                return _plan_view(p), p.priority_victims

            _, (view, victims) = both(plan)
            rows, new, restored = view[0], view[3], view[4]
            for (sid, *_), is_new, n in zip(rows, new, restored):
                if is_new and n > len(sides[0][0].sequence(sid).prompt_tokens):
                    resumes += 1
            for sid in victims:
                if rng.random() < 0.8:
                    both(lambda s, st, pl: keep(s, st, pl, sid))
        elif op == "complete":
            if not sides[0][2]:
                continue
            work = sides[0][2][0].work
            preds = [IterationPrediction(i, -1 if rng.random() < 0.1 else rng.randrange(10, 20))
                     for i, w in enumerate(work) if w.sample_last]
            both(lambda s, st, pl: complete_plan(s, pl.pop(0), preds).finished_ids)
        elif op == "evict":
            both(lambda s, st, pl: _key(st.evict_one()))
        else:
            used = [rng.randint(0, 2 * kv.capacity_bytes)]
            victims = both(lambda s, st, pl: s.preempt_for_component_pressure(used))[1]
            for sid in victims if isinstance(victims, list) else []:
                both(lambda s, st, pl: keep(s, st, pl, sid))
        a, b = ((s.snapshot(), s.metrics(), {i: s.sequence(i) for i in IDS}) for s, _, _ in sides)
        assert a == b, (seed, step, op)
    for sched, store, plans in sides:
        while plans:
            complete_plan(sched, plans.pop(0), [])
        for sid in IDS:
            sched.cancel(sid)
        sched.plan_iteration()
        assert all(e.pins == 0 for e in store.resident())
    return resumes


def _key(entry):
    return None if entry is None else tuple(entry.key.tolist())


def test_native_and_twin_agree_when_victims_resume_from_their_kept_kv():
    resumes = sum(_run_resumes(seed) for seed in range(16))
    assert resumes > 10
