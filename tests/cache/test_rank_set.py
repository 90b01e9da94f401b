"""The persistent ranked set gives the one-shot kernel's order after any add/remove sequence."""
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from skippy_scheduler import _rank
from skippy_scheduler.cache_policy import CacheAffinity, CacheAwareCandidate, StageCacheAffinity

U64_MAX = (1 << 64) - 1
alphabet = st.sampled_from([0, 1, 2, 3, -5, 2**31 - 1])
small = st.one_of(st.integers(0, 6), st.integers(U64_MAX - 2, U64_MAX))


@st.composite
def operations(draw):
    bases = [[], [7] * draw(st.integers(1, 200))] + draw(
        st.lists(st.lists(alphabet, max_size=5), min_size=1, max_size=3))
    ops = []
    for _ in range(draw(st.integers(1, 40))):
        kind = draw(st.sampled_from(["add", "add", "add", "remove", "update"]))
        if kind == "add":
            prompt = draw(st.sampled_from(bases)) + draw(st.lists(alphabet, max_size=4))
            if draw(st.booleans()):
                bases.append(prompt)
            ops.append(("add", draw(st.integers(0, 2)), draw(small), draw(small),
                        draw(st.integers(0, 30)), prompt))
        else:
            ops.append((kind, draw(st.integers(0, 10**6)), draw(st.integers(0, 2)), draw(small),
                        draw(small)))
    return ops, draw(small), draw(st.sampled_from([0, 1, 4096, U64_MAX])), draw(st.booleans())


def one_shot(live, turn, aging, grouping, mode):
    cands = [CacheAwareCandidate(h, pr, CacheAffinity((StageCacheAffinity(0, 1, sv, 0, 0),)),
                                 toks, tu, od) for h, (pr, sv, tu, od, toks) in live.items()]
    return _rank.PackedCandidates(cands).order(turn, aging, grouping, mode)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(operations())
def test_set_matches_one_shot_ranking(case):
    ops, turn, aging, grouping = case
    rs = _rank.RankSet()
    live = {}  # handle -> fields, in add order (dicts keep insertion order)
    for op in ops:
        if op[0] == "add":
            _, pr, sv, tu, od, toks = op
            h = rs.add(pr, sv, tu, od, toks)
            assert h not in live
            live[h] = (pr, sv, tu, od, toks)
        elif live:
            h = list(live)[op[1] % len(live)]
            if op[0] == "remove":
                rs.remove(h)
                del live[h]
            else:
                _, _, pr, sv, tu = op
                rs.update(h, pr, sv, tu)
                live[h] = (pr, sv, tu) + live[h][3:]  # keeps its place in add order
        assert len(rs) == len(live)
        for mode in (0, 1, 2):
            assert rs.order(turn, aging, grouping, mode) == one_shot(live, turn, aging, grouping, mode)


def test_bad_handles_and_modes():
    rs = _rank.RankSet()
    h = rs.add(0, 0, 0, 0, [1, 2])
    with pytest.raises(KeyError):
        rs.remove(h + 1)
    with pytest.raises(ValueError):
        rs.order(0, 1, True, 7)
    with pytest.raises(ValueError):
        rs.add(0, 0, 0, 0, [2**31])
    assert len(rs) == 1 and rs.order(0, 1, True) == [h]
    rs.remove(h)
    assert len(rs) == 0 and rs.order(0, 1, True) == []


def test_long_shared_prefix_and_reuse_of_handles():
    rs = _rank.RankSet()
    a = rs.add(0, 0, 0, 0, [1] * 100_000 + [2])
    b = rs.add(0, 0, 0, 1, [1] * 100_000 + [3])
    assert rs.order(0, 10, True) == [a, b]
    rs.remove(a)
    c = rs.add(0, 0, 0, 2, [1] * 100_000 + [3, 4])
    d = rs.add(0, 0, 0, 3, [9])
    # the [1]*100000+[3] subtree holds two prompts: it goes first, the prefix prompt after
    assert rs.order(0, 10, True) == [c, b, d]
