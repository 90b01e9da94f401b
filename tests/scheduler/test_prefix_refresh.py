"""A scheduler with an attached prefix store (behaviour.md §2.12), on the native scheduler with
the native store and on the twin with the twin store: restores read at submit, refreshed right
before each admission selection when the store changed since (stale refreshes), the admitted
entry pinned while its sequence is active, argument errors; and a random differential between
the two pairs."""
from __future__ import annotations

import gc
import random

import numpy as np
import pytest

from skippy_scheduler import (
    AdmissionPolicy,
    CacheAffinity,
    CacheAwareAdmission,
    FcfsAdmission,
    IterationPhase,
    IterationPrediction,
    MemoryComponent,
    PrefixRestore,
    PriorityAdmission,
    Scheduler,
    SchedulerConfig,
    Sequence,
    StageCacheAffinity,
    TwinScheduler,
)
from skippy_scheduler.policies import FairShareAdmission
from skippy_scheduler.prefix_store import PrefixStore
from skippy_scheduler.reference import PrefixStoreTwin
from sched_helpers import complete as complete_plan

PAIRS = [pytest.param((Scheduler, PrefixStore), id="native"),
         pytest.param((TwinScheduler, PrefixStoreTwin), id="twin")]

HOT = [1, 2, 3, 4, 5, 6]
PREFIX = HOT[:4]
COLD = [9, 9, 9]
PREFILL_COST = 100  # per prompt token: 4 restored tokens outweigh one turn of aging


def toks(values):
    return np.asarray(values, dtype=np.int32)


class MostSavedFirst(AdmissionPolicy):
    """A Python policy (the callback path): the largest saved cost first, then FIFO."""

    def order(self, candidates, current_turn):
        return sorted(range(len(candidates)),
                      key=lambda i: (-candidates[i].affinity.estimated_saved_cost(),
                                     candidates[i].order))


# name -> (policy factory, whether the order follows the saved cost)
POLICIES = {
    "cache_aware_grouped": (lambda: None, True),
    "cache_aware_ungrouped": (lambda: CacheAwareAdmission(4096, False), True),
    "fcfs": (FcfsAdmission, False),
    "priority": (PriorityAdmission, False),
    "python": (MostSavedFirst, True),
}


@pytest.fixture(params=PAIRS)
def pair(request):
    return request.param


def attached(pair, policy=None, holder_slots=4, capacity_tokens=None, **config):
    """A scheduler of `pair` (two active sequences at most unless told) with a fresh store."""
    sched_cls, store_cls = pair
    config.setdefault("max_active_sequences", 2)
    kwargs = {} if policy is None else {"admission": policy}
    sched = sched_cls(SchedulerConfig(**config), **kwargs)
    store = store_cls(capacity_tokens=capacity_tokens, holder_slots=holder_slots,
                      first_holder_id=20)
    sched.attach_prefix_store(store, prefill_cost_per_token=PREFILL_COST)
    return sched, store


def first_rows(plan):
    """sequence id -> its first row in `plan`, in row order."""
    rows = {}
    for w in plan.work:
        rows.setdefault(w.sequence_id, w)
    return rows


def complete(sched, plan, tokens=None):
    """Complete `plan`; `tokens` maps sequence ids to the token sampled (default 7; negative
    ends the sequence)."""
    tokens = tokens or {}
    preds = [IterationPrediction(i, tokens.get(w.sequence_id, 7))
             for i, w in enumerate(plan.work) if w.sample_last]
    return complete_plan(sched, plan, preds)


# -- (a) an entry evicted while its request waits ------------------------------------------------


@pytest.mark.parametrize("policy", list(POLICIES))
def test_a_waiting_request_whose_entry_is_evicted_is_scored_without_it(pair, policy):
    make, by_score = POLICIES[policy]
    # The premise: left alone, the hot request overtakes the cold one and starts restored.
    sched, store = attached(pair, make())
    store.insert(toks(PREFIX))
    sched.submit(Sequence("cold", COLD, 4))
    sched.submit(Sequence("hot", HOT, 4))
    plan = sched.plan_iteration()
    assert [w.sequence_id for w in plan.work] == (["hot", "cold"] if by_score else ["cold", "hot"])
    assert first_rows(plan)["hot"].positions[0] == 4
    assert sched.metrics().restored_tokens == 4 and sched.metrics().stale_refreshes == 0

    sched, store = attached(pair, make())
    store.insert(toks(PREFIX))
    sched.submit(Sequence("cold", COLD, 4))
    sched.submit(Sequence("hot", HOT, 4))
    assert sched.sequence("hot").prefix_restore.token_count == 4  # read at submit
    assert store.evict_one() is not None  # gone before the selection
    plan = sched.plan_iteration()
    assert [w.sequence_id for w in plan.work] == ["cold", "hot"]  # FIFO: no score left
    hot = first_rows(plan)["hot"]
    assert hot.positions == tuple(range(len(HOT))) and hot.restore_holder is None
    m = sched.metrics()
    assert m.restored_tokens == 0 and m.stale_refreshes == 1
    assert (m.prefix_hits, m.prefix_misses) == (0, 2)
    assert complete(sched, plan).stale_refreshes == 1  # telemetry carries the count


# -- (b) a prefix made resident while its request waits ------------------------------------------


@pytest.mark.parametrize("policy", list(POLICIES))
def test_a_waiting_request_whose_prefix_becomes_resident_gains_the_score(pair, policy):
    make, by_score = POLICIES[policy]
    sched, store = attached(pair, make())
    sched.submit(Sequence("cold", COLD, 4))
    sched.submit(Sequence("hot", HOT, 4))
    assert sched.sequence("hot").prefix_restore is None  # nothing resident at submit
    entry = store.insert(toks(PREFIX))
    plan = sched.plan_iteration()
    assert [w.sequence_id for w in plan.work] == (["hot", "cold"] if by_score else ["cold", "hot"])
    hot = first_rows(plan)["hot"]
    assert hot.positions == tuple(range(4, len(HOT))) and hot.tokens == tuple(HOT[4:])
    assert hot.restore_holder == entry.holder == 20
    assert first_rows(plan)["cold"].restore_holder is None
    m = sched.metrics()
    assert m.stale_refreshes == 1 and m.restored_tokens == 4
    assert (m.prefix_hits, m.prefix_misses) == (1, 1)


def test_a_change_that_leaves_the_match_as_it_was_is_no_stale_refresh(pair):
    sched, store = attached(pair)
    store.insert(toks(PREFIX))
    sched.submit(Sequence("hot", HOT, 4))
    store.insert(toks([7, 7]))  # elsewhere
    store.insert(toks(HOT[:2] + [8]))  # under a shared prefix, but not longer than the match
    plan = sched.plan_iteration()
    assert sched.metrics().stale_refreshes == 0
    assert first_rows(plan)["hot"].positions[0] == 4


def test_a_request_refreshed_twice_counts_twice(pair):
    full = MemoryComponent("kv", 0, 0, 1, 0)  # nothing fits: the request keeps waiting
    sched, store = attached(pair, memory_components=[full])
    sched.submit(Sequence("hot", HOT, 4))
    entry = store.insert(toks(PREFIX))
    sched.plan_iteration()
    assert sched.metrics().stale_refreshes == 1
    store.insert(toks(HOT[:5]), parent=entry)  # a longer match
    sched.plan_iteration()
    assert sched.metrics().stale_refreshes == 2
    assert sched.sequence("hot").prefix_restore.token_count == 5
    sched.plan_iteration()  # no change since: nothing to refresh
    assert sched.metrics().stale_refreshes == 2


# -- (c) the admitted entry is pinned while its sequence is active -------------------------------


def _admit_hot(pair, **config):
    sched, store = attached(pair, capacity_tokens=6, **config)
    entry = store.insert(toks(PREFIX))
    sched.submit(Sequence("hot", HOT, 3))
    plan = sched.plan_iteration()
    assert first_rows(plan)["hot"].positions[0] == 4
    assert entry.pins == 1
    # neither an explicit eviction nor capacity pressure can take it
    assert store.evict_one() is None
    assert store.insert(toks([8, 8, 8])) is None and entry.alive
    assert store.refused_inserts == 1
    return sched, store, entry, plan


def _evictable(store, entry):
    assert entry.pins == 0 and store.lru_order() == [entry]
    assert store.evict_one() is entry


def test_the_entry_is_pinned_until_the_sequence_finishes(pair):
    sched, store, entry, plan = _admit_hot(pair)
    complete(sched, plan)  # one token: still running
    plan = sched.plan_iteration()
    assert entry.pins == 1 and plan.work[0].restore_holder == entry.holder
    complete(sched, plan, {"hot": -1})
    assert sched.metrics().finished == 1
    _evictable(store, entry)


def test_the_entry_is_pinned_until_the_sequence_is_cancelled(pair):
    sched, store, entry, plan = _admit_hot(pair)
    complete(sched, plan)
    assert sched.cancel("hot") and entry.pins == 0
    _evictable(store, entry)


def test_the_entry_is_unpinned_when_the_sequence_is_preempted(pair):
    kv = MemoryComponent("kv", 1000, 0, 1, 0)
    sched, store, entry, plan = _admit_hot(pair, memory_components=[kv])
    complete(sched, plan)
    assert sched.preempt_for_component_pressure([2000]) == ["hot"]
    sched.preempt_for_component_pressure([0])  # the measured pressure is gone again
    assert entry.pins == 0  # waiting again: only the restore is read, nothing pinned
    assert sched.sequence("hot").prefix_restore.token_count == 4
    _evictable(store, entry)
    plan = sched.plan_iteration()  # re-admitted without the evicted prefix
    hot = first_rows(plan)["hot"]
    assert hot.positions[0] == 0 and hot.phase is IterationPhase.RECOMPUTE
    assert sched.metrics().stale_refreshes == 1


def test_a_preempted_sequence_pins_the_entry_it_is_readmitted_with(pair):
    kv = MemoryComponent("kv", 1000, 0, 1, 0)
    sched, store, entry, plan = _admit_hot(pair, memory_components=[kv])
    complete(sched, plan)
    sched.preempt_for_component_pressure([2000])
    sched.preempt_for_component_pressure([0])
    plan = sched.plan_iteration()
    hot = first_rows(plan)["hot"]
    assert hot.positions[0] == 4 and hot.restore_holder == entry.holder and entry.pins == 1
    assert sched.metrics().restored_tokens == 8  # restored at each admission


@pytest.mark.parametrize("depth", [1, 2])
def test_the_holder_a_row_names_is_the_one_at_planning(pair, depth):
    sched, store = attached(pair, max_inflight_plans=depth)
    entry = store.insert(toks(PREFIX))
    sched.submit(Sequence("hot", HOT, 3))
    plan = sched.plan_iteration()
    sched.cancel("hot")  # before the rows are first read
    if depth > 1:
        sched.submit(Sequence("next", [1, 2, 9], 3))  # may take the cancelled one's slot
        sched.plan_iteration()
    assert [(w.sequence_id, w.restore_holder) for w in plan.work] == [("hot", entry.holder)]


# -- (d) a hit on the whole prompt ---------------------------------------------------------------


def test_a_full_prompt_hit_replays_the_last_prompt_token(pair):
    sched, store = attached(pair)
    entry = store.insert(toks(HOT))
    sched.submit(Sequence("hot", HOT, 3))
    plan = sched.plan_iteration()
    (row,) = plan.work
    assert row.positions == (len(HOT) - 1,) and row.tokens == (HOT[-1],) and row.sample_last
    assert row.restore_holder == entry.holder
    m = sched.metrics()
    assert m.restored_tokens == len(HOT) and m.prefix_hits == 1
    assert sched.sequence("hot").prefix_restore.token_count == len(HOT)


# -- (e) argument errors -------------------------------------------------------------------------


def test_attach_only_while_the_scheduler_holds_no_sequence(pair):
    sched_cls, store_cls = pair
    sched = sched_cls(SchedulerConfig())
    sched.submit(Sequence("a", [1, 2], 2))
    with pytest.raises(ValueError, match="holds no sequence"):
        sched.attach_prefix_store(store_cls())
    assert sched.prefix_store is None
    sched, store = attached(pair)
    sched.submit(Sequence("a", [1, 2], 2))
    with pytest.raises(ValueError, match="holds no sequence"):
        sched.attach_prefix_store(None)
    assert sched.prefix_store is store


def test_a_store_serves_one_scheduler(pair):
    sched_cls, store_cls = pair
    sched, store = attached(pair)
    other = sched_cls(SchedulerConfig())
    with pytest.raises(ValueError, match="another scheduler"):
        other.attach_prefix_store(store)
    assert other.prefix_store is None
    sched.attach_prefix_store(store)  # again to its own scheduler: fine
    sched.attach_prefix_store(store_cls())  # the first store is released by the switch
    other.attach_prefix_store(store)
    assert other.prefix_store is store
    other.attach_prefix_store(None)
    sched.attach_prefix_store(None)
    sched.attach_prefix_store(store)


def test_a_store_is_released_by_a_scheduler_that_is_gone(pair):
    sched_cls, _ = pair
    sched, store = attached(pair)
    del sched
    gc.collect()
    other = sched_cls(SchedulerConfig())
    other.attach_prefix_store(store)
    assert other.prefix_store is store


def test_submitted_sequences_carry_no_restore_or_affinity_while_a_store_is_attached(pair):
    sched, _ = attached(pair)
    with pytest.raises(ValueError, match="prefix store is attached"):
        sched.submit(Sequence("a", HOT, 2).with_prefix_restore(PrefixRestore("page", 2)))
    affinity = CacheAffinity.from_stage(StageCacheAffinity(0, 2, 5))
    with pytest.raises(ValueError, match="prefix store is attached"):
        sched.submit(Sequence("b", HOT, 2).with_cache_affinity(affinity))
    assert sched.snapshot().waiting_ids == [] and sched.metrics().waiting_sequences == 0


def test_bad_costs_are_refused(pair):
    sched_cls, store_cls = pair
    sched = sched_cls(SchedulerConfig())
    for kwargs in ({"prefill_cost_per_token": -1}, {"restore_cost_per_token": -1}):
        with pytest.raises(ValueError):
            sched.attach_prefix_store(store_cls(), **kwargs)
    assert sched.prefix_store is None


# -- (g) native and twin under random operations ----------------------------------------------


PROMPTS = [
    [1, 2, 3, 4, 5, 6],
    [1, 2, 3, 4, 7],
    [1, 2, 3, 8, 8, 8, 8],
    [1, 2, 9],
    [1, 5, 5, 5],
    [6, 6, 6, 6, 6],
    [6, 6, 2],
    [1, 2, 3, 4, 5, 6, 0, 0],
]
IDS = [f"s{k}" for k in range(6)]


def _kt(entry):
    return None if entry is None else tuple(entry.key.tolist())


def store_picture(store):
    return ([(_kt(e), _kt(e.parent), e.pins, e.children, e.holder, e.last_used)
             for e in store.resident()],
            (store.used_tokens, store.entries, store.evictions, store.refused_inserts,
             store.epoch))


def _outcome(fn):
    try:
        return "ok", fn()
    except Exception as exc:  # noqa: BLE001 - the type is what is compared
        return "raised", type(exc)


class Side:
    def __init__(self, sched_cls, store_cls, config, policy, store_args, costs):
        self.sched = sched_cls(config, **({} if policy is None else {"admission": policy()}))
        self.store = store_cls(**store_args)
        self.sched.attach_prefix_store(self.store, prefill_cost_per_token=costs[0],
                                       restore_cost_per_token=costs[1])
        self.plans = []  # live plans, oldest first

    def new_plan(self, depth):
        plan = self.sched.plan_iteration()
        # at depth 1 a new plan replaces the live one
        self.plans = [plan] if depth == 1 else self.plans + [plan]
        return plan

    def insert(self, prompt, length):
        # the deepest resident proper prefix is the parent, so segments nest as a host's would
        parent = None
        for k in range(length - 1, 0, -1):
            parent = self.store.find(toks(prompt[:k]))
            if parent is not None:
                break
        return _kt(self.store.insert(toks(prompt[:length]), parent=parent))


def _views(side):
    s = side.sched
    snap = s.snapshot()
    return snap, s.metrics(), {i: s.sequence(i) for i in IDS}


def _plan_view(plan):
    return [(w.sequence_id, w.tokens, w.positions, w.phase, w.sample_last, w.restore_holder)
            for w in plan.work], plan.admitted, plan.token_count


# The operations of the differential and their weights ("keep": a replay made resident, as a
# host's release does; test_resume_restore.py runs a differential centred on it).
WEIGHTS = {"submit": 14, "insert": 12, "evict": 6, "touch": 3, "plan": 16, "complete": 16,
           "cancel": 3, "preempt": 5, "keep": 4}


def _run_differential(seed, steps):
    rng = random.Random(seed)
    aging = rng.choice([1, 50, 4096])
    depth = rng.choice([1, 1, 2])
    policy = rng.choice([None, lambda: CacheAwareAdmission(aging, False), FcfsAdmission,
                         PriorityAdmission, MostSavedFirst,
                         lambda: FairShareAdmission({"t1": 3.0})])
    kv = MemoryComponent("kv", rng.choice([60, 200]), 0, rng.choice([1, 2]), rng.choice([0, 5]))
    config = SchedulerConfig(
        max_active_sequences=rng.choice([1, 2, 3, 6]),
        max_inflight_plans=depth,
        max_tokens_per_iteration=rng.choice([4, 8, 64]),
        prefill_chunk_tokens=rng.choice([2, 3, 256]),
        mixed_prefill_decode=rng.random() < 0.3,
        cache_aging_cost_per_iteration=aging,
        memory_components=[kv] if rng.random() < 0.7 else [],
    )
    store_args = {"capacity_tokens": rng.choice([None, 6, 10, 16]),
                  "holder_slots": rng.choice([None, 2, 4]),
                  "first_holder_id": rng.choice([0, 16])}
    costs = (rng.choice([1, 10, 100]), rng.choice([0, 1, 3]))
    sides = [Side(Scheduler, PrefixStore, config, policy, store_args, costs),
             Side(TwinScheduler, PrefixStoreTwin, config, policy, store_args, costs)]
    seen = dict.fromkeys(["refreshes", "restored", "preempted", "cancelled", "finished",
                          "evictions"], 0)

    def both(fn):
        a, b = (_outcome(lambda s=side: fn(s)) for side in sides)
        assert a == b, (seed, step, a, b)
        return a

    for step in range(steps):
        op = rng.choices(list(WEIGHTS), weights=list(WEIGHTS.values()))[0]
        if op == "submit":
            sid, prompt = rng.choice(IDS), rng.choice(PROMPTS)
            max_tokens, priority = rng.randint(1, 4), rng.randint(0, 2)
            both(lambda side: side.sched.submit(Sequence(sid, prompt, max_tokens, None, priority)))
        elif op == "insert":
            prompt = rng.choice(PROMPTS)
            length = rng.randint(1, len(prompt))
            both(lambda side: side.insert(prompt, length))
        elif op == "keep":
            # What a host keeps of a sequence it lets go: part of its replay, generated tokens
            # included, which a preempted sequence then restores (§2.12).
            views = [v for v in map(sides[0].sched.sequence, IDS)
                     if v is not None and len(v.generated_tokens) >= 2]
            if not views:
                continue
            view = rng.choice(views)
            key = list(view.prompt_tokens) + list(view.generated_tokens[:-1])
            length = rng.randint(len(view.prompt_tokens) + 1, len(key))
            both(lambda side: side.insert(key, length))
        elif op == "evict":
            both(lambda side: _kt(side.store.evict_one()))
        elif op == "touch":
            live = [_kt(e) for e in sides[0].store.resident()]
            if live:
                key = rng.choice(live)
                both(lambda side: side.store.touch(side.store.find(toks(key))))
        elif op == "plan":
            outcome = both(lambda side: _plan_view(side.new_plan(depth)))
            assert outcome[0] == "ok" or len(sides[0].plans) == depth
        elif op == "complete":
            if not sides[0].plans:
                continue
            work = sides[1].plans[0].work
            preds = [IterationPrediction(i, -1 if rng.random() < 0.15 else rng.randrange(20))
                     for i, w in enumerate(work) if w.sample_last]
            both(lambda side: complete_plan(side.sched, side.plans.pop(0), preds))
        elif op == "cancel":
            sid = rng.choice(IDS)
            both(lambda side: side.sched.cancel(sid))
        else:
            # measured usage: over the capacity (victims) or under it (room again)
            used = [rng.randint(0, 2 * kv.capacity_bytes)]
            both(lambda side: side.sched.preempt_for_component_pressure(used))
        assert _views(sides[0]) == _views(sides[1]), (seed, step, op)
        assert store_picture(sides[0].store) == store_picture(sides[1].store), (seed, step, op)
    m = sides[0].sched.metrics()
    seen.update(refreshes=m.stale_refreshes, restored=m.restored_tokens, preempted=m.preempted,
                cancelled=m.cancelled, finished=m.finished, evictions=sides[0].store.evictions)
    # Every sequence gone: no pin is left behind.
    for side in sides:
        while side.plans:
            complete_plan(side.sched, side.plans.pop(0), [])
        for sid in IDS:
            side.sched.cancel(sid)
        side.sched.plan_iteration()
        assert side.sched.metrics().active_sequences == 0
        assert all(e.pins == 0 for e in side.store.resident())
    return seen



@pytest.mark.parametrize("seed", range(12))
def test_native_and_twin_agree_with_an_attached_store(seed):
    seen = _run_differential(seed, 300)
    assert seen["restored"] > 0 and seen["evictions"] > 0


def test_a_dropped_scheduler_gives_its_pins_back(pair):
    """A host's store outlives the schedulers it serves: one dropped while its sequences run
    must not leave their entries pinned."""
    sched_cls, store_cls = pair
    store = store_cls(holder_slots=4)
    entry = store.insert(list(range(8)))
    sched = sched_cls(SchedulerConfig(max_active_sequences=1))
    sched.attach_prefix_store(store)
    sched.submit(Sequence("a", list(range(8)) + [50], max_tokens=4))
    sched.plan_iteration()
    assert entry.pins == 1
    del sched
    gc.collect()
    assert entry.pins == 0 and store.evict_one() is entry
    again = sched_cls(SchedulerConfig())
    again.attach_prefix_store(store)  # and it serves the next scheduler
