"""Native fair share (AdmissionKind.FAIR_SHARE, behaviour.md §3.6): the counter, lift, order and
weight rules as spec cases on both schedulers, random scripts on which the native core and the
twin give the same plans and bit-identical counters, and the C entry points' error cases."""
from __future__ import annotations

import math
import zlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scripted import describe_plan

from skippy_scheduler import (
    AdmissionError,
    CacheAffinity,
    CacheAwareAdmission,
    FcfsAdmission,
    IterationPrediction,
    MemoryComponent,
    PrefixRestore,
    Scheduler,
    SchedulerConfig,
    Sequence,
    StageCacheAffinity,
    TwinScheduler,
)
from skippy_scheduler._abi import ffi, lib
from skippy_scheduler.policies import AdmissionKind, FairShareAdmission, VirtualTokenCounters
from sched_helpers import complete


def config(active=1, chunk=64, **more):
    return SchedulerConfig(max_active_sequences=active, sequence_id_limit=64,
                           max_tokens_per_iteration=256, prefill_chunk_tokens=chunk, **more)


def request(rid, tenant, prompt_len=8, max_tokens=1, restore=None):
    # A first token of its own: no two prompts share a prefix, so the cache-aware order within
    # a tenant is the enqueue order unless a test gives a request cache value.
    first = zlib.crc32(rid.encode()) & 0x7FFF_FFFF
    seq = Sequence(rid, [first] + list(range(100, 99 + prompt_len)), max_tokens, tenant=tenant)
    if restore is not None:
        seq.with_prefix_restore(PrefixRestore(f"page-{rid}", restore))
    return seq


def step(s, token=5):
    """Plan, sample `token` on every sampling row, complete; the plan's sequence ids."""
    plan = s.plan_iteration()
    ids = list(plan.sequence_ids)
    complete(s, plan, [IterationPrediction(i, token) for i, w in enumerate(plan.work)
                                if w.sample_last])
    return ids


def drain(s):
    """Run to the end; the ids in the order they first appear in a plan."""
    seen = []
    while True:
        ids = step(s)
        if not ids:
            return seen
        seen += [i for i in ids if i not in seen]


# -- the policy object --------------------------------------------------------------------------


def test_the_default_inner_order_is_native_and_any_other_is_not():
    assert FairShareAdmission().native_kind is AdmissionKind.FAIR_SHARE
    assert FairShareAdmission(within=CacheAwareAdmission(0, False)).native_kind \
        is AdmissionKind.FAIR_SHARE
    assert FairShareAdmission(within=FcfsAdmission()).native_kind is None

    class Custom(CacheAwareAdmission):
        pass

    assert FairShareAdmission(within=Custom()).native_kind is None
    assert FairShareAdmission().resolved(SchedulerConfig()).native_kind is AdmissionKind.FAIR_SHARE


def test_sequences_carry_a_hashable_tenant():
    seq = Sequence("a", [1], 1)
    assert seq.tenant is None
    assert Sequence("a", [1], 1, tenant=("org", 3)).tenant == ("org", 3)
    assert seq.with_tenant("t").tenant == "t"
    with pytest.raises(TypeError, match="tenant must be hashable"):
        Sequence("a", [1], 1, tenant=["x"])
    with pytest.raises(TypeError, match="tenant must be hashable"):
        seq.with_tenant({})


# -- counters: charged at completion ------------------------------------------------------------


def test_completed_rows_charge_their_tenant(impl):
    s = impl(config(chunk=4), admission=FairShareAdmission({"a": 2.0}))
    s.submit(request("r", "a", prompt_len=8, max_tokens=3))
    s.submit(request("q", "b", prompt_len=2, max_tokens=1))
    assert s.tenant_counters() == {None: 0.0, "a": 0.0, "b": 0.0}
    expected = [2.0, 4.0, 5.0, 6.0]  # two prefill chunks of 4, two decode rows, all / 2
    for value in expected:
        assert step(s) == ["r"]
        assert s.tenant_counters()["a"] == value
    assert step(s) == ["q"]
    assert s.tenant_counters() == {None: 0.0, "a": 6.0, "b": 2.0}
    assert s.fair_share_lifts == 0  # q stayed queued from the first ranking on


def test_costs_come_from_the_policy(impl):
    policy = FairShareAdmission(prefill_cost=0.5, decode_cost=3.0)
    s = impl(config(), admission=policy)
    s.submit(request("r", "a", prompt_len=8, max_tokens=3))
    drain(s)
    assert s.tenant_counters()["a"] == 0.5 * 8 + 3.0 * 2
    assert policy.counters.counter("a") == 0.0  # the scheduler keeps its own counters


def test_recompute_is_charged_as_prefill_and_void_rows_are_not_charged(impl):
    kv = MemoryComponent("kv", 1_000, 0, 1, 0)
    s = impl(config(memory_components=[kv]), admission=FairShareAdmission())
    s.submit(request("r", "a", prompt_len=4, max_tokens=4))
    step(s)  # prefill 4
    step(s)  # decode
    assert s.tenant_counters()["a"] == 4 + 2
    # A plan whose sequence is preempted before completion computed nothing it keeps.
    plan = s.plan_iteration()
    assert s.preempt_for_component_pressure([5_000]) == ["r"]
    s.complete_iteration(plan)
    assert s.tenant_counters()["a"] == 6
    s.preempt_for_component_pressure([0])  # the runtime reports its memory back
    # Re-admitted: the replay (prompt + the first generated token) is recomputed.
    plan = s.plan_iteration()
    assert [w.phase.name for w in plan.work] == ["RECOMPUTE"] and plan.token_count == 5
    s.complete_iteration(plan)
    assert s.tenant_counters()["a"] == 11
    # Cancelled between plan and completion: not charged either.
    plan = s.plan_iteration()
    assert s.cancel("r")
    s.complete_iteration(plan)
    assert s.tenant_counters()["a"] == 11


def test_a_tagged_affinity_still_names_the_tenant(impl):
    s = impl(config(), admission=FairShareAdmission())
    seq = Sequence("r", [1, 2, 3], 1).with_cache_affinity(FairShareAdmission.tag(None, "t", "r"))
    s.submit(seq)
    drain(s)
    assert s.tenant_counters() == {None: 0.0, "t": 3.0}


def test_snapshots_keep_the_tenant_object(impl):
    s = impl(config(), admission=FairShareAdmission())
    s.submit(request("r", ("org", 7)))
    assert s.sequence("r").tenant == ("org", 7)
    other = impl(config())
    other.submit(request("r", "x"))
    assert other.sequence("r").tenant == "x" and other.tenant_counters() == {}


# -- lift -----------------------------------------------------------------------------------------


def test_a_returning_tenant_is_lifted_to_the_lowest_counter_that_stayed(impl):
    s = impl(config(), admission=FairShareAdmission())
    s.submit(request("a1", "a"))
    s.submit(request("a2", "a"))
    assert step(s) == ["a1"]  # a1's prefill samples its only token: a = 8
    s.submit(request("b1", "b"))
    # a2 stayed queued since the last ranking, b is new: b rises to a's 8, and the tie goes
    # to the earlier request. Without the lift b (at 0) would go first.
    assert drain(s) == ["a2", "b1"]
    assert s.fair_share_lifts == 1
    assert s.tenant_counters() == {None: 0.0, "a": 16.0, "b": 16.0}


def test_after_the_queue_drained_the_floor_is_the_last_queued_tenants(impl):
    s = impl(config(), admission=FairShareAdmission())
    s.submit(request("a1", "a"))
    assert drain(s) == ["a1"]
    s.submit(request("b1", "b", prompt_len=2))
    s.submit(request("b2", "b", prompt_len=2))
    # Nobody stayed: b rises to the lowest counter among the tenants queued last time (a: 8).
    assert step(s) == ["b1"]
    assert s.fair_share_lifts == 1 and s.tenant_counters()["b"] == 8 + 2
    s.submit(request("a3", "a"))
    # b2 stayed (b at 10): a returns at 8 and rises to 10; a counter never goes down.
    assert drain(s) == ["b2", "a3"]
    assert s.fair_share_lifts == 2
    assert s.tenant_counters() == {None: 0.0, "a": 18.0, "b": 12.0}


def test_a_preempted_request_keeps_its_identity(impl):
    kv = MemoryComponent("kv", 1_000, 0, 1, 0)
    s = impl(config(active=2, memory_components=[kv]), admission=FairShareAdmission())
    s.submit(request("a1", "a", max_tokens=3))
    s.submit(request("e1", "e", prompt_len=2))
    assert step(s) == ["a1", "e1"]  # a = 8, e = 2, and e is done
    assert s.preempt_for_component_pressure([5_000]) == ["a1"]
    s.preempt_for_component_pressure([0])  # the runtime reports its memory back
    s.submit(request("d1", "d"))
    # a1 was queued at the last ranking and is again: a stayed, so d rises to a's 8. Were a1 a
    # new request, nobody would have stayed and the floor would be min(a, e) = 2.
    assert step(s) == ["a1", "d1"]
    assert s.fair_share_lifts == 1
    assert s.tenant_counters() == {None: 0.0, "a": 16.0, "e": 2.0, "d": 16.0}


# -- order ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("restored, order", [(38, ["a0", "b0", "a1", "b1"]),
                                             (0, ["a0", "b0", "b1", "a1"])])
def test_each_pick_charges_its_uncached_prompt_while_ranking(impl, restored, order):
    s = impl(config(active=8), admission=FairShareAdmission())
    s.submit(request("a0", "a", prompt_len=40, restore=restored))
    s.submit(request("a1", "a", prompt_len=40))
    s.submit(request("b0", "b", prompt_len=20))
    s.submit(request("b1", "b", prompt_len=20))
    s.plan_iteration()
    # All four are admitted by one ranking, in its order (the active set's walk order). a0 goes
    # first (equal counters, enqueued first) and charges a its 2 or 40 uncached tokens.
    assert s.snapshot().active_ids == order


def test_within_a_tenant_the_cache_aware_order_holds(impl):
    s = impl(config(active=8), admission=FairShareAdmission())
    warm = CacheAffinity.from_stage(StageCacheAffinity(0, 8, 100, 0))
    s.submit(request("a0", "a"))
    s.submit(request("a1", "a").with_cache_affinity(warm))
    s.submit(request("b0", "b"))
    s.plan_iteration()
    assert s.snapshot().active_ids == ["a1", "b0", "a0"]


def test_a_heavier_weight_gets_more_turns(impl):
    s = impl(config(), admission=FairShareAdmission({"gold": 2.0}))
    for rid in ["g0", "g1", "g2", "g3", "p0", "p1"]:
        s.submit(request(rid, "gold" if rid[0] == "g" else "plain"))
    assert drain(s) == ["g0", "p0", "g1", "g2", "p1", "g3"]
    assert s.tenant_counters() == {None: 0.0, "gold": 16.0, "plain": 16.0}


def test_set_tenant_weight_applies_to_later_charges(impl):
    s = impl(config(), admission=FairShareAdmission())
    s.set_tenant_weight("a", 4.0)
    assert s.tenant_counters() == {None: 0.0, "a": 0.0}
    s.submit(request("r", "a", max_tokens=2))
    step(s)
    assert s.tenant_counters()["a"] == 2.0
    s.set_tenant_weight("a", 1.0)
    step(s)
    assert s.tenant_counters()["a"] == 4.0


def test_a_default_weight_reaches_tenants_seen_later(impl):
    counters = VirtualTokenCounters({"b": 1.0}, default_weight=4.0)
    s = impl(config(), admission=FairShareAdmission(counters=counters))
    s.submit(request("a1", "a"))
    s.submit(request("n1", None))
    s.submit(request("b1", "b"))
    drain(s)
    assert s.tenant_counters() == {None: 2.0, "b": 8.0, "a": 2.0}


@pytest.mark.parametrize("weight", [0, -1.0, math.nan, math.inf, True, "2"])
def test_bad_weights_are_refused(impl, weight):
    s = impl(config(), admission=FairShareAdmission())
    with pytest.raises(ValueError, match="weight"):
        s.set_tenant_weight("a", weight)
    assert s.tenant_counters() == {None: 0.0}


def test_numpy_weights_are_numbers(impl):
    import numpy as np

    s = impl(config(), admission=FairShareAdmission())
    s.set_tenant_weight("a", np.int64(2))
    s.set_tenant_weight("b", np.float32(0.5))
    assert set(s.tenant_counters()) == {None, "a", "b"}


@pytest.mark.parametrize("admission", [None, FairShareAdmission(within=FcfsAdmission())])
def test_weights_need_the_native_fair_share(impl, admission):
    s = impl(config(), admission=admission)
    with pytest.raises(ValueError, match="fair-share"):
        s.set_tenant_weight("a", 2.0)
    assert s.tenant_counters() == {} and s.fair_share_lifts == 0


# -- native == twin on random scripts ------------------------------------------------------------

TENANTS = [None, "a", "b", ("c", 1), 7]

submits = st.tuples(
    st.just("submit"), st.integers(0, 9), st.sampled_from(TENANTS),
    st.lists(st.integers(0, 3), min_size=1, max_size=14),  # shared prefixes are likely
    st.integers(1, 5),  # max_tokens
    st.one_of(st.none(), st.integers(0, 14)),  # prefix restore
    st.sampled_from([0, 0, 3, 50]),  # saved cost per matched token
    st.integers(0, 1),  # priority
)
steps = st.tuples(st.just("step"), st.integers(0, 2**16))
ops = st.one_of(
    submits, submits, submits, steps, steps, steps, steps,
    st.tuples(st.just("plan")),
    st.tuples(st.just("complete"), st.integers(0, 2**16)),
    st.tuples(st.just("abort")),
    st.tuples(st.just("cancel"), st.integers(0, 9)),
    st.tuples(st.just("preempt"), st.integers(0, 400)),
    st.tuples(st.just("weight"), st.sampled_from(TENANTS), st.sampled_from([0.5, 1.0, 3.0, 7.0])),
)
setups = st.fixed_dictionaries({
    "active": st.integers(1, 4),
    "budget": st.integers(4, 40),
    "chunk": st.integers(1, 16),
    "depth": st.integers(1, 3),
    "mixed": st.booleans(),
    "memory": st.booleans(),
    "aging": st.sampled_from([0, 1, 40]),
    "grouping": st.booleans(),
    "weights": st.dictionaries(st.sampled_from(TENANTS), st.sampled_from([0.25, 1.0, 2.0, 3.0]),
                               max_size=3),
    "costs": st.sampled_from([(1.0, 2.0), (0.3, 1.7), (0.0, 1.0), (2.5, 0.0)]),
    "default_weight": st.sampled_from([1.0, 1.0, 0.7]),
})


def build(impl, setup):
    memory = [MemoryComponent("kv", 120, 0, 2, 4)] if setup["memory"] else []
    cfg = SchedulerConfig(max_active_sequences=setup["active"], sequence_id_limit=64,
                          max_waiting_sequences=64,
                          max_tokens_per_iteration=setup["budget"],
                          prefill_chunk_tokens=setup["chunk"],
                          max_inflight_plans=setup["depth"],
                          mixed_prefill_decode=setup["mixed"], memory_components=memory)
    prefill, decode = setup["costs"]
    counters = VirtualTokenCounters(setup["weights"], prefill_cost=prefill, decode_cost=decode,
                                    default_weight=setup["default_weight"])
    within = CacheAwareAdmission(setup["aging"], setup["grouping"])
    return impl(cfg, admission=FairShareAdmission(within=within, counters=counters))


def predictions(plan, seed):
    out = []
    for index, work in enumerate(plan.work):
        if work.sample_last and (seed + index) % 11:
            out.append(IterationPrediction(index, -1 if (seed * 7 + index) % 9 == 0 else 3))
    return out


def run_script(impl, setup, script):
    s = build(impl, setup)
    live = []
    trace = []
    for op in script:
        kind = op[0]
        result = None
        try:
            if kind == "submit":
                _, n, tenant, prompt, max_tokens, restore, saved, priority = op
                seq = Sequence(f"r{n}", prompt, max_tokens, priority=priority, tenant=tenant)
                if restore is not None:
                    seq.with_prefix_restore(PrefixRestore("p", restore))
                if saved:
                    seq.with_cache_affinity(CacheAffinity.from_stage(
                        StageCacheAffinity(0, min(restore or 0, len(prompt)), saved, 0)))
                s.submit(seq)
            elif kind in ("step", "plan"):
                if setup["depth"] == 1:
                    live.clear()  # making a plan replaces (aborts) the live one
                plan = s.plan_iteration()
                live.append(plan)
                result = [describe_plan(plan)]
                while kind == "step" and live:  # complete everything live, oldest first
                    done = live.pop(0)
                    result.append(vars(complete(s, done, predictions(done, op[1]))))
            elif kind == "complete" and live:
                plan = live.pop(0)
                result = vars(complete(s, plan, predictions(plan, op[1])))
            elif kind == "abort" and live:
                s.abort_iteration(live[-1])
                live.pop()
            elif kind == "cancel":
                result = s.cancel(f"r{op[1]}")
            elif kind == "preempt":
                result = s.preempt_for_component_pressure([op[1]] if setup["memory"] else [])
            elif kind == "weight":
                s.set_tenant_weight(op[1], op[2])
        except ValueError as exc:  # PlanInFlight among them: part of the trace
            result = type(exc).__name__
        except AdmissionError as exc:
            result = repr(exc)
        snap = s.snapshot()
        trace.append((op, result, snap.active_ids, snap.waiting_ids, s.tenant_counters(),
                      s.fair_share_lifts))
    return trace


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(setup=setups, script=st.lists(ops, min_size=10, max_size=60))
def test_native_and_twin_agree_on_random_scripts(setup, script):
    twin = run_script(TwinScheduler, setup, script)
    native = run_script(Scheduler, setup, script)
    for k, (expected, got) in enumerate(zip(twin, native)):
        # Counters compare with ==: the core computes them exactly as the Python rules do.
        assert got == expected, f"step {k}: {expected[0]}"


def test_a_long_random_run_agrees_and_actually_lifts():
    """One long seeded script with many tenants, so the lift and weight paths are exercised
    (the hypothesis scripts above are short)."""
    import random

    rng = random.Random(11)
    setup = {"active": 3, "budget": 48, "chunk": 16, "depth": 2, "mixed": True, "memory": True,
             "aging": 1, "grouping": True, "weights": {"a": 3.0, 7: 0.5},
             "costs": (0.3, 1.7), "default_weight": 1.0}
    script = []
    for k in range(3_000):
        r = rng.random()
        if r < 0.3:
            script.append(("submit", k, rng.choice(TENANTS),
                           [rng.randrange(4) for _ in range(rng.randrange(1, 30))],
                           rng.randrange(1, 6), rng.choice([None, 0, 4, 12]), rng.choice([0, 5]),
                           rng.randrange(2)))
        elif r < 0.85:
            script.append(("step", rng.randrange(1 << 16)))
        elif r < 0.9:
            script.append(("cancel", rng.randrange(max(k, 1))))
        elif r < 0.95:
            script.append(("preempt", rng.randrange(0, 300)))
        else:
            script.append(("weight", rng.choice(TENANTS), rng.choice([0.5, 1.0, 3.0])))
    twin = run_script(TwinScheduler, setup, script)
    native = run_script(Scheduler, setup, script)
    assert native == twin
    final = native[-1]
    assert final[5] > 10  # lifts happened
    assert len([c for c in final[4].values() if c > 0]) == len(TENANTS)


# -- the C entry points ------------------------------------------------------------------------------


def make_native(policy=lib.SKIPPY_ADMISSION_FAIR_SHARE, **fields):
    cfg = ffi.new("skippy_scheduler_config *")
    lib.skippy_scheduler_config_default(cfg)
    cfg.admission_policy = policy
    for name, value in fields.items():
        setattr(cfg, name, value)
    out = ffi.new("skippy_scheduler **")
    status = lib.skippy_scheduler_create(cfg, out, ffi.NULL)
    return status, (ffi.gc(out[0], lib.skippy_scheduler_free) if out[0] != ffi.NULL else None)


def test_c_config_defaults_and_bad_costs():
    cfg = ffi.new("skippy_scheduler_config *")
    lib.skippy_scheduler_config_default(cfg)
    assert (cfg.fair_prefill_cost, cfg.fair_decode_cost) == (1.0, 2.0)
    for bad in ({"fair_prefill_cost": -1.0}, {"fair_decode_cost": math.nan},
                {"fair_prefill_cost": math.inf}):
        status, s = make_native(**bad)
        assert status == lib.SKIPPY_STATUS_INVALID_ARGUMENT and s is None
    # The costs are only read under fair share.
    status, s = make_native(lib.SKIPPY_ADMISSION_FCFS, fair_decode_cost=math.nan)
    assert status == lib.SKIPPY_STATUS_OK
    status, s = make_native(5)
    assert status == lib.SKIPPY_STATUS_INVALID_ARGUMENT


def test_c_set_tenant_weight_errors():
    status, s = make_native()
    assert status == lib.SKIPPY_STATUS_OK
    err = ffi.new("skippy_error **")
    for bad in (0.0, -2.0, math.nan, math.inf, -math.inf):
        assert lib.skippy_scheduler_set_tenant_weight(s, 3, bad, err) \
            == lib.SKIPPY_STATUS_INVALID_ARGUMENT
        assert lib.skippy_scheduler_last_code(s) == lib.SKIPPY_SCHED_INVALID
        assert b"weight" in ffi.string(err[0].message)
        lib.skippy_scheduler_error_free(err[0])
    assert lib.skippy_scheduler_set_tenant_weight(s, 3, 0.5, ffi.NULL) == lib.SKIPPY_STATUS_OK
    _, fcfs = make_native(lib.SKIPPY_ADMISSION_FCFS)
    assert lib.skippy_scheduler_set_tenant_weight(fcfs, 3, 2.0, ffi.NULL) \
        == lib.SKIPPY_STATUS_INVALID_ARGUMENT
    assert lib.skippy_scheduler_tenant_counter(fcfs, 3) == 0.0
    assert lib.skippy_scheduler_fair_share_lifts(fcfs) == 0


def test_c_tenants_are_any_uint32_and_charged_at_completion():
    status, s = make_native(fair_decode_cost=0.5)
    assert status == lib.SKIPPY_STATUS_OK
    big = 0xFFFF_FFFF
    assert lib.skippy_scheduler_set_tenant_weight(s, big, 4.0, ffi.NULL) == lib.SKIPPY_STATUS_OK
    prompt = ffi.new("int32_t[]", [1, 2, 3, 4])
    desc = ffi.new("skippy_sequence_desc *")
    lib.skippy_sequence_desc_init(desc, b"x", 1, prompt, 4, 2)
    assert desc.tenant == 0
    desc.tenant = big
    slot = ffi.new("uint32_t *")
    assert lib.skippy_scheduler_submit(s, desc, slot, ffi.NULL) == lib.SKIPPY_STATUS_OK
    info = ffi.new("skippy_sequence_info *")
    assert lib.skippy_scheduler_sequence(s, slot[0], info) and info.tenant == big
    plan = ffi.new("skippy_plan **")
    before = 0.0
    for expected in (1.0, 1.125):  # 4 prefill tokens / 4, then one decode token * 0.5 / 4
        assert lib.skippy_scheduler_plan(s, plan, ffi.NULL) == lib.SKIPPY_STATUS_OK
        p = plan[0]
        assert lib.skippy_scheduler_tenant_counter(s, big) == before  # planning charges nothing
        p.outputs.sampled_request_indexes[0] = 0
        p.outputs.predicted_tokens[0] = 9
        p.outputs.count = 1
        assert lib.skippy_scheduler_complete(s, p.serial, ffi.NULL, ffi.NULL) \
            == lib.SKIPPY_STATUS_OK
        assert lib.skippy_scheduler_tenant_counter(s, big) == expected
        before = expected
    assert lib.skippy_scheduler_tenant_counter(s, 12345) == 0.0
