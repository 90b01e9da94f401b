"""FairShareAdmission: the virtual-token-counter rules (service, lift, order, weights) as spec
cases, and the policy driven by both schedulers (the native one through its Python callback)."""
from __future__ import annotations

import pytest

from skippy_scheduler import SchedulerConfig, Sequence
from skippy_scheduler.cache_policy import CacheAffinity, CacheAwareCandidate, StageCacheAffinity
from skippy_scheduler.engine import CostModelHost
from skippy_scheduler.policies import (CacheAwareAdmission, FairShareAdmission, FcfsAdmission,
                                       VirtualTokenCounters)

# -- service ---------------------------------------------------------------------------------


def test_counters_grow_by_weighted_prefill_and_decode_tokens():
    c = VirtualTokenCounters({"gold": 2.0}, prefill_cost=1.0, decode_cost=2.0)
    c.charge("gold", prefill_tokens=100, decode_tokens=10)
    c.charge("plain", prefill_tokens=100, decode_tokens=10)
    assert c.counter("gold") == 60.0  # (100 + 2 * 10) / 2
    assert c.counter("plain") == 120.0  # default weight 1
    assert c.counter("never") == 0.0
    c.charge("gold", decode_tokens=1)
    assert c.counter("gold") == 61.0
    assert VirtualTokenCounters(prefill_cost=0.5, decode_cost=0).cost("x", 10, 99) == 5.0


@pytest.mark.parametrize("bad", [dict(weights={"a": 0}), dict(weights={"a": -1.0}),
                                 dict(prefill_cost=-1), dict(decode_cost=float("inf"))])
def test_bad_settings(bad):
    with pytest.raises(ValueError):
        VirtualTokenCounters(**bad)


# -- lift --------------------------------------------------------------------------------------


def test_a_returning_tenant_is_lifted_to_the_lowest_counter_that_stayed():
    c = VirtualTokenCounters()
    assert c.observe_queue({"a": ["a1"]}) == []  # nothing was queued before: no floor
    c.charge("a", 50)
    c.charge("c", 500)
    assert c.observe_queue({"a": ["a1"], "b": ["b1"]}) == ["b"]
    assert c.counter("b") == 50.0 and c.lifts == 1
    # c returns too; the floor is the smallest counter among those that stayed (a and b: 50)
    assert c.observe_queue({"a": ["a1"], "b": ["b1"], "c": ["c1"]}) == []
    assert c.counter("c") == 500.0  # a counter never decreases


def test_a_tenant_that_stayed_queued_is_not_lifted():
    c = VirtualTokenCounters()
    c.observe_queue({"a": ["a1"], "b": ["b1"]})
    c.charge("a", 100)
    # b's first request is still queued (b2 is new): b did not leave, so it keeps its credit.
    assert c.observe_queue({"a": ["a1"], "b": ["b1", "b2"]}) == []
    assert c.counter("b") == 0.0
    # b's queued request was admitted and a new one came: b left and returned.
    assert c.observe_queue({"a": ["a1"], "b": ["b3"]}) == ["b"]
    assert c.counter("b") == 100.0


def test_after_the_queue_drained_the_floor_is_the_last_queued_tenants():
    c = VirtualTokenCounters()
    c.observe_queue({"a": ["a1"], "d": ["d1"]})
    c.charge("a", 80)
    c.charge("d", 30)
    # Nobody stayed: the floor is the lowest counter among the tenants queued last time.
    assert c.observe_queue({"b": ["b1"]}) == ["b"] and c.counter("b") == 30.0


# -- order -------------------------------------------------------------------------------------


def test_lowest_counter_first_ties_by_enqueue_order():
    c = VirtualTokenCounters()
    queues = {"a": [(0, 0, 100), (1, 1, 100)], "b": [(2, 2, 100)]}
    assert c.interleave(queues) == [0, 2, 1]
    c.charge("a", 1)
    assert c.interleave(queues) == [2, 0, 1]
    assert c.interleave({}) == [] and c.counters == {"a": 1.0}  # a ranking charges nothing


def test_weights_share_the_queue_in_proportion():
    c = VirtualTokenCounters({"a": 2.0, "b": 1.0})
    queues = {"a": [(k, k, 100) for k in range(0, 12)],
              "b": [(k, k, 100) for k in range(100, 112)]}
    order = c.interleave(queues)
    first = order[:9]
    assert sum(1 for i in first if i < 100) == 6  # two of a's for each of b's
    assert sorted(order) == sorted(i for q in queues.values() for i, _, _ in q)


def candidate(index, tenant, prompt=(1, 2, 3), matched=0, order=None):
    affinity = None
    if matched:
        affinity = CacheAffinity.from_stage(StageCacheAffinity(0, matched, 1, 0))
    return CacheAwareCandidate(index=index, affinity=FairShareAdmission.tag(affinity, tenant,
                                                                            f"{tenant}{index}"),
                               prompt_tokens=prompt, order=index if order is None else order)


def test_the_policy_charges_uncached_prompt_tokens_while_it_ranks():
    policy = FairShareAdmission(within=FcfsAdmission())
    policy.charge("b", 5)
    # a's first request is mostly cached (2 of 40 tokens to prefill): a is still below b
    # after it and goes again.
    cands = [candidate(0, "a", prompt=tuple(range(40)), matched=38),
             candidate(1, "a", prompt=(1,) * 40), candidate(2, "b", prompt=(2,) * 20)]
    assert policy.order(cands, 0) == [0, 1, 2]
    cold = FairShareAdmission(within=FcfsAdmission())
    cold.charge("b", 5)
    cands = [candidate(0, "a", prompt=(1,) * 40), candidate(1, "a", prompt=(1,) * 40),
             candidate(2, "b", prompt=(2,) * 20)]
    assert cold.order(cands, 0) == [0, 2, 1]  # 40 uncached tokens put a above b


def test_within_a_tenant_the_inner_order_holds():
    policy = FairShareAdmission()  # cache-aware within a tenant
    cands = [candidate(0, "a"), candidate(1, "a", matched=3), candidate(2, "b")]
    order = policy.order(cands, 0)
    assert order.index(1) < order.index(0)  # the cached request of a goes first among a's


def test_untagged_candidates_form_one_tenant():
    policy = FairShareAdmission(within=FcfsAdmission())
    cands = [CacheAwareCandidate(index=k, order=5 - k) for k in range(4)]
    assert policy.order(cands, 0) == [3, 2, 1, 0]
    assert FairShareAdmission.key_of(cands[0]) == ("enqueue-order", 5)


def test_resolved_policies_share_the_counters():
    policy = FairShareAdmission({"a": 3.0})
    resolved = policy.resolved(SchedulerConfig())
    assert resolved.counters is policy.counters and isinstance(resolved.within,
                                                               CacheAwareAdmission)
    policy.charge("a", 30)
    assert resolved.counters.counter("a") == 10.0
    with pytest.raises(ValueError):
        FairShareAdmission({"a": 1.0}, counters=policy.counters)


# -- through the schedulers --------------------------------------------------------------------


def config(active=1):
    return SchedulerConfig(max_active_sequences=active, sequence_id_limit=64,
                           max_tokens_per_iteration=256, prefill_chunk_tokens=64)


def tagged(rid, tenant, prompt_len=8, max_tokens=1):
    seq = Sequence(rid, list(range(1, prompt_len + 1)), max_tokens)
    return seq.with_cache_affinity(FairShareAdmission.tag(None, tenant, rid))


def admitted_in_order(scheduler, policy, ids):
    """Run to completion; charge each plan's tokens like a host; return first-plan order."""
    host = CostModelHost()
    seen = []
    while True:
        plan = scheduler.plan_iteration()
        if not len(plan):
            return seen
        for rid in plan.sequence_ids:
            if rid not in seen:
                seen.append(rid)
        host.execute(plan)
        for work in plan.work:
            policy.charge(ids[work.sequence_id], len(work.tokens))
        scheduler.complete_iteration(plan)


def test_the_least_served_tenant_is_admitted_first(impl):
    policy = FairShareAdmission(within=FcfsAdmission())
    policy.charge("heavy", 1_000)
    s = impl(config(), admission=policy)
    tenants = {"h1": "heavy", "h2": "heavy", "h3": "heavy", "l1": "light"}
    for rid, tenant in tenants.items():
        s.submit(tagged(rid, tenant))
    # light arrived last but has the lower counter; afterwards heavy (lifted by nothing: it
    # stayed queued) keeps its order.
    assert admitted_in_order(s, policy, tenants) == ["l1", "h1", "h2", "h3"]


def test_backlogged_tenants_alternate_by_service(impl):
    policy = FairShareAdmission(within=FcfsAdmission())
    s = impl(config(), admission=policy)
    tenants = {f"a{k}": "a" for k in range(3)} | {f"b{k}": "b" for k in range(3)}
    for rid in ["a0", "a1", "a2", "b0", "b1", "b2"]:
        s.submit(tagged(rid, tenants[rid]))
    order = admitted_in_order(s, policy, tenants)
    assert order == ["a0", "b0", "a1", "b1", "a2", "b2"]
    fcfs = impl(config(), admission=FcfsAdmission())
    for rid in ["a0", "a1", "a2", "b0", "b1", "b2"]:
        fcfs.submit(tagged(rid, tenants[rid]))
    assert admitted_in_order(fcfs, policy, tenants) == ["a0", "a1", "a2", "b0", "b1", "b2"]


def test_a_heavier_weight_gets_more_turns(impl):
    policy = FairShareAdmission({"gold": 2.0}, within=FcfsAdmission())
    s = impl(config(), admission=policy)
    ids = [f"g{k}" for k in range(4)] + [f"p{k}" for k in range(2)]
    tenants = {rid: ("gold" if rid[0] == "g" else "plain") for rid in ids}
    for rid in ids:
        s.submit(tagged(rid, tenants[rid]))
    assert admitted_in_order(s, policy, tenants) == ["g0", "p0", "g1", "g2", "p1", "g3"]
