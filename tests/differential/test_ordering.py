"""The native ranking kernel agrees with the reference ordering of §3."""
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from skippy_scheduler.cache_policy import (
    CacheAffinity,
    CacheAwareCandidate,
    StageCacheAffinity,
    order_cache_aware_candidates,
)
from skippy_scheduler._rank import (
    MODE_CACHE_AWARE, MODE_FCFS, MODE_PRIORITY, PackedCandidates, RankSet, RankSlots,
)
from skippy_scheduler.reference import reference_order

U64_MAX = (1 << 64) - 1
u64 = st.one_of(
    st.integers(0, 8), st.integers(0, U64_MAX), st.integers(U64_MAX - 8, U64_MAX),
    st.sampled_from([1 << 62, (1 << 62) - 1, 1 << 63]),
)
small_u64 = st.one_of(st.integers(0, 20), st.integers(U64_MAX - 3, U64_MAX))
stage = st.builds(StageCacheAffinity, stage_index=st.integers(0, 3), matched_tokens=u64,
                  prefill_cost_per_token=u64, restore_cost=u64, cache_epoch=st.integers(0, 3))
affinities = st.one_of(st.just(CacheAffinity()),
                       st.lists(stage, max_size=3).map(lambda s: CacheAffinity(tuple(s))))
alphabet = st.sampled_from([0, 1, 2, 3, -1, 2**31 - 1, -(2**31)])


@st.composite
def prompt_sets(draw):
    bases = draw(st.lists(st.lists(alphabet, max_size=6), min_size=1, max_size=4))
    deep = draw(st.integers(0, 300))
    if deep:
        bases.append([7] * deep)  # a long shared run that must be skipped in blocks
    prompts = []
    for _ in range(draw(st.integers(0, 14))):
        kind = draw(st.sampled_from(["fresh", "copy", "prefix", "extend"]))
        if prompts and kind == "copy":
            prompts.append(list(draw(st.sampled_from(prompts))))
        elif prompts and kind == "prefix":
            src = draw(st.sampled_from(prompts))
            prompts.append(src[: draw(st.integers(0, len(src)))])
        elif prompts and kind == "extend":
            prompts.append(draw(st.sampled_from(prompts)) + draw(st.lists(alphabet, max_size=3)))
        else:
            prompts.append(draw(st.sampled_from(bases)) + draw(st.lists(alphabet, max_size=4)))
    return prompts


# TTFT deadlines (seconds): a few shared values so that they tie, and extremes of the double
deadlines = st.one_of(
    st.none(), st.sampled_from([1.0, 1.0, 2.5, 1e-6, 1e-300, 1e300, 5e-324]),
    st.floats(min_value=1e-9, max_value=1e12, allow_nan=False, allow_infinity=False),
)


@st.composite
def queues(draw):
    prompts = draw(prompt_sets())
    distinct_orders = draw(st.booleans())
    with_deadlines = draw(st.booleans())
    cands = []
    for i, prompt in enumerate(prompts):
        cands.append(CacheAwareCandidate(
            index=draw(st.integers(0, 1000)) if draw(st.booleans()) else i,
            priority=draw(st.one_of(st.integers(0, 2), small_u64)),
            affinity=draw(affinities),
            prompt_tokens=prompt,
            enqueued_turn=draw(small_u64),
            order=i * 3 if distinct_orders else draw(st.integers(0, 4)),
            ttft_deadline=draw(deadlines) if with_deadlines else None,
        ))
    turn = draw(small_u64)
    aging = draw(st.one_of(st.sampled_from([0, 1, 2, 10, 4096]), u64))
    return cands, turn, aging, draw(st.booleans())


@settings(max_examples=800, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(queues())
def test_native_matches_the_reference(q):
    cands, turn, aging, grouping = q
    assert order_cache_aware_candidates(cands, turn, aging, grouping) == reference_order(
        cands, turn, aging, grouping)


@pytest.mark.parametrize("seed", range(6))
def test_large_queues_match_the_reference(seed):
    # big enough for the radix passes (not only the small-sort path) at every level
    rng = random.Random(seed)
    heads = [[rng.randrange(-3, 300) for _ in range(rng.randrange(0, 90))] for _ in range(5)]
    cands = []
    for i in range(rng.choice([40, 300, 1200])):
        prompt = rng.choice(heads) + [rng.randrange(0, 70000) for _ in range(rng.randrange(0, 4))]
        cands.append(CacheAwareCandidate(
            index=i, priority=rng.choice([0, 0, 0, 1, 2**40, U64_MAX]),
            affinity=CacheAffinity.from_stage(StageCacheAffinity(0, rng.randrange(3),
                                                                 rng.choice([0, 7, 2**62]), 0, 0)),
            prompt_tokens=prompt, enqueued_turn=rng.randrange(0, 40),
            order=rng.randrange(0, 5000),
            ttft_deadline=rng.choice([None, None, 0.25, 0.5, rng.uniform(0.1, 9.0)])
            if seed % 2 else None))
    for aging in (1, 3, 4096):
        for grouping in (True, False):
            assert order_cache_aware_candidates(cands, 40, aging, grouping) == \
                reference_order(cands, 40, aging, grouping)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(queues(), st.sampled_from([MODE_CACHE_AWARE, MODE_FCFS, MODE_PRIORITY]))
def test_ranked_set_and_slots_match_the_one_shot_kernel(q, mode):
    """The persistent set (the scheduler's grouped ranking) and the slot array read the
    deadline like the one-shot kernel does, in every mode."""
    cands, turn, aging, grouping = q
    want = PackedCandidates(cands).positions(turn, aging, grouping, mode)
    rank_set, slots = RankSet(), RankSlots()
    handles = []
    for c in cands:
        args = (c.priority, c.affinity.estimated_saved_cost(), c.enqueued_turn, c.order,
                c.prompt_tokens)
        handles.append(rank_set.add(*args, ttft_deadline=c.ttft_deadline))
        slots.append(*args, ttft_deadline=c.ttft_deadline)
    assert [handles.index(h) for h in rank_set.order(turn, aging, grouping, mode)] == want
    assert slots.order(turn, aging, grouping, mode) == want
    # departures keep the set's own count of deadlines right (it skips the key at zero)
    kept = [i for i in range(len(cands)) if i % 3 != 1]
    for i in range(len(cands)):
        if i % 3 == 1:
            rank_set.remove(handles[i])
    want = [kept[p] for p in
            PackedCandidates([cands[i] for i in kept]).positions(turn, aging, grouping, mode)]
    assert [handles.index(h) for h in rank_set.order(turn, aging, grouping, mode)] == want


@pytest.mark.parametrize("grouping", [True, False])
def test_the_nearer_deadline_is_admitted_first_within_a_level_and_score(grouping):
    # equal priority, equal (zero) score: the deadline decides before the prefix group and
    # the enqueue order; no deadline ranks last; priority and score still come first
    cands = [
        CacheAwareCandidate(index=0, prompt_tokens=(1, 2, 3), order=0),
        CacheAwareCandidate(index=1, prompt_tokens=(1, 2, 4), order=1, ttft_deadline=9.0),
        CacheAwareCandidate(index=2, prompt_tokens=(5,), order=2, ttft_deadline=3.0),
        CacheAwareCandidate(index=3, prompt_tokens=(1, 2, 3), order=3),
    ]
    for rank in (order_cache_aware_candidates, reference_order):
        assert rank(cands, 0, 1, grouping) == ([2, 1, 0, 3] if grouping else [2, 1, 0, 3])
    hot = CacheAffinity.from_stage(StageCacheAffinity(0, 10, 1, 0, 0))
    more = cands + [
        CacheAwareCandidate(index=4, prompt_tokens=(7,), order=4, affinity=hot),
        CacheAwareCandidate(index=5, prompt_tokens=(8,), order=5, priority=1),
    ]
    for rank in (order_cache_aware_candidates, reference_order):
        assert rank(more, 0, 1, grouping) == [5, 4, 2, 1, 0, 3]


def test_without_deadlines_the_order_is_unchanged():
    # the DFS groups [1,2,*] ahead of [5]: a deadline on [5] alone moves it to the front
    cands = [CacheAwareCandidate(index=i, prompt_tokens=p, order=i)
             for i, p in enumerate([(5,), (1, 2, 3), (1, 2, 4)])]
    assert order_cache_aware_candidates(cands, 0, 1, True) == [1, 2, 0]
    cands[0] = CacheAwareCandidate(index=0, prompt_tokens=(5,), order=0, ttft_deadline=1.0)
    assert order_cache_aware_candidates(cands, 0, 1, True) == [0, 1, 2]


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), "1", True])
def test_a_bad_deadline_is_rejected(bad):
    cands = [CacheAwareCandidate(index=0, ttft_deadline=bad)]
    for rank in (order_cache_aware_candidates, reference_order):
        with pytest.raises((TypeError, ValueError), match="ttft_deadline"):
            rank(cands, 0, 1, True)
