"""Admission and preemption policy objects (§0.3), built-in and user-written."""
import pytest
from sched_helpers import affinity, complete, make_scheduler, pred, row_ids, seq

from skippy_scheduler import (
    AdmissionPolicy,
    CacheAwareAdmission,
    CacheAwareCandidate,
    FcfsAdmission,
    FewestComputedTokens,
    LowestPriorityNewest,
    MemoryComponent,
    PreemptionPolicy,
    PriorityAdmission,
    SchedulerConfig,
    Sequence,
    VictimCandidate,
)


class ReverseFcfs(AdmissionPolicy):
    """Newest enqueue first (a user policy, run in Python)."""

    def __init__(self):
        self.calls = 0

    def order(self, candidates, current_turn):
        self.calls += 1
        return [c.index for c in sorted(candidates, key=lambda c: -c.order)]


class LargestPrompt(PreemptionPolicy):
    def select_victim(self, candidates):
        sizes = [c.computed_tokens for c in candidates]
        return sizes.index(max(sizes))


def test_builtin_native_kinds():
    assert CacheAwareAdmission.native_kind == 0 and FcfsAdmission.native_kind == 1
    assert PriorityAdmission.native_kind == 2 and AdmissionPolicy.native_kind is None
    assert LowestPriorityNewest.native_kind == 0 and FewestComputedTokens.native_kind == 1
    assert ReverseFcfs.native_kind is None and PreemptionPolicy.native_kind is None


def test_cache_aware_resolution_takes_the_config_values():
    config = SchedulerConfig(cache_aging_cost_per_iteration=0, group_waiting_prefixes=False)
    resolved = CacheAwareAdmission().resolved(config)
    assert (resolved.aging_cost_per_turn, resolved.group_waiting_prefixes) == (1, False)
    explicit = CacheAwareAdmission(0, True).resolved(config)
    assert (explicit.aging_cost_per_turn, explicit.group_waiting_prefixes) == (0, True)
    with pytest.raises(ValueError):
        CacheAwareAdmission(-1)
    with pytest.raises(TypeError):
        CacheAwareAdmission(None, 1)


def test_cache_aware_with_zero_aging_gives_no_aging_credit():
    cold = CacheAwareCandidate(0, 0, prompt_tokens=[1], enqueued_turn=0, order=0)
    hot = CacheAwareCandidate(1, 0, affinity(5), prompt_tokens=[2], enqueued_turn=1000, order=1)
    assert CacheAwareAdmission(0, False).order([cold, hot], 1000) == [1, 0]
    assert CacheAwareAdmission(10, False).order([cold, hot], 1000) == [0, 1]


def admit_one_of_three(impl, policy):
    """max_active 1; a (prio 1), b (prio 3, hot), c (prio 2): return who is admitted first."""
    s = make_scheduler(impl, admission=policy, max_active_sequences=1)
    s.submit(Sequence("a", [1, 2], 1, None, 1))
    s.submit(Sequence("b", [3, 4], 1, None, 3).with_cache_affinity(affinity(100)))
    s.submit(Sequence("c", [5, 6], 1, None, 2))
    order = []
    for _ in range(3):
        plan = s.plan_iteration()
        order.append(row_ids(plan)[0])
        complete(s, plan, [pred(0, 1)])
    return order, s


def test_fcfs_admission_follows_enqueue_order(impl):
    order, _ = admit_one_of_three(impl, FcfsAdmission())
    assert order == ["a", "b", "c"]


def test_priority_admission_follows_priority(impl):
    order, _ = admit_one_of_three(impl, PriorityAdmission())
    assert order == ["b", "c", "a"]


def test_default_admission_is_cache_aware(impl):
    order, _ = admit_one_of_three(impl, None)
    assert order == ["b", "c", "a"]
    s = make_scheduler(impl, max_active_sequences=1)
    s.submit(Sequence("cold", [1, 2], 1, None, 1))
    s.submit(Sequence("hot", [3, 4], 1, None, 1).with_cache_affinity(affinity(100)))
    assert row_ids(s.plan_iteration()) == ["hot"]


def test_user_admission_policy_plans(impl):
    policy = ReverseFcfs()
    order, s = admit_one_of_three(impl, policy)
    assert order == ["c", "b", "a"]
    # Consulted only when the queue changed (once, after the submits).
    assert policy.calls == 1


def test_fcfs_preempted_sequence_gets_a_fresh_order(impl):
    s = make_scheduler(
        impl, admission=FcfsAdmission(), max_active_sequences=1, memory_components=[MemoryComponent("kv", 100, 0, 1, 0)]
    )
    s.submit(seq("a", 2, 4))
    s.submit(seq("b", 2, 4))
    assert row_ids(s.plan_iteration()) == ["a"]
    assert s.preempt_for_component_pressure([101]) == ["a"]
    s.preempt_for_component_pressure([0])
    assert s.snapshot().waiting_ids == ["a", "b"]  # preempted work goes to the front ...
    s.plan_iteration()
    assert s.snapshot().active_ids == ["b"]  # ... but its enqueue order is now the newest
    assert s.sequence("a").enqueue_order == 2


class BrokenOrder(AdmissionPolicy):
    def order(self, candidates, current_turn):
        return [0, 0][: len(candidates)]


def test_a_user_policy_returning_a_non_permutation_changes_nothing(impl):
    s = make_scheduler(impl, admission=BrokenOrder())
    s.submit(seq("a", 2, 4))
    s.submit(seq("b", 3, 4))
    before = (s.snapshot(), s.metrics())
    with pytest.raises(ValueError):
        s.plan_iteration()
    assert (s.snapshot(), s.metrics()) == before


def preempt_two_of_three(impl, policy):
    s = make_scheduler(impl, preemption=policy, memory_components=[MemoryComponent("kv", 1000, 0, 1, 0)])
    s.submit(Sequence("long", list(range(40)), 4, None, 1))
    s.submit(Sequence("short", [100, 101], 4, None, 2))
    s.submit(Sequence("mid", [200] * 10, 4, None, 1))
    plan = s.plan_iteration()
    assert sorted(row_ids(plan)) == ["long", "mid", "short"]
    # Reservations: long 44, short 6, mid 14 (64 in all). Ask to free more than one victim's worth.
    return s.preempt_for_component_pressure([1000 + 10])


def test_lowest_priority_newest_victims(impl):
    assert preempt_two_of_three(impl, LowestPriorityNewest()) == ["mid"]
    assert preempt_two_of_three(impl, None) == ["mid"]


def test_fewest_computed_tokens_victims(impl):
    assert preempt_two_of_three(impl, FewestComputedTokens()) == ["short", "mid"]


def test_user_preemption_policy(impl):
    assert preempt_two_of_three(impl, LargestPrompt()) == ["long"]


def test_builtin_victim_selection_reference():
    cands = [
        VictimCandidate("a", priority=1, admitted_at=1, computed_tokens=5, generated_tokens=0),
        VictimCandidate("b", priority=1, admitted_at=3, computed_tokens=9, generated_tokens=2),
        VictimCandidate("c", priority=0, admitted_at=2, computed_tokens=9, generated_tokens=0),
        VictimCandidate("d", priority=0, admitted_at=4, computed_tokens=9, generated_tokens=0),
    ]
    assert LowestPriorityNewest().select_victim(cands) == 3
    assert FewestComputedTokens().select_victim(cands) == 0
    assert FewestComputedTokens().select_victim(cands[1:]) == 2
    assert LowestPriorityNewest().select_victim([]) is None


class BadVictim(PreemptionPolicy):
    def select_victim(self, candidates):
        return len(candidates)


def test_a_user_preemption_policy_returning_garbage_changes_nothing(impl):
    s = make_scheduler(impl, preemption=BadVictim(), memory_components=[MemoryComponent("kv", 100, 0, 1, 0)])
    s.submit(seq("a", 2, 4))
    s.plan_iteration()
    before = (s.snapshot(), s.metrics())
    with pytest.raises(ValueError):
        s.preempt_for_component_pressure([500])
    assert (s.snapshot(), s.metrics()) == before


def test_policy_type_checks(impl):
    with pytest.raises(TypeError):
        make_scheduler(impl, admission=FewestComputedTokens())
    with pytest.raises(TypeError):
        make_scheduler(impl, preemption=FcfsAdmission())
