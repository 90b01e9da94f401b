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


@st.composite
def queues(draw):
    prompts = draw(prompt_sets())
    distinct_orders = draw(st.booleans())
    cands = []
    for i, prompt in enumerate(prompts):
        cands.append(CacheAwareCandidate(
            index=draw(st.integers(0, 1000)) if draw(st.booleans()) else i,
            priority=draw(st.one_of(st.integers(0, 2), small_u64)),
            affinity=draw(affinities),
            prompt_tokens=prompt,
            enqueued_turn=draw(small_u64),
            order=i * 3 if distinct_orders else draw(st.integers(0, 4)),
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
            order=rng.randrange(0, 5000)))
    for aging in (1, 3, 4096):
        for grouping in (True, False):
            assert order_cache_aware_candidates(cands, 40, aging, grouping) == \
                reference_order(cands, 40, aging, grouping)
