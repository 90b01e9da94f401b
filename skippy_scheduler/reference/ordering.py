"""Reference cache-aware ordering of waiting requests (behaviour.md §3).

Owns the pure-Python form of the §3.3 order: priority, then the cache score (saved cost minus
restore cost, plus aging credit), then the nearest TTFT deadline (§3.3a), then the
waiting-prefix grouping of §3.2. It is the only
implementation besides the native ranking kernel (`skippy_scheduler._rank`, the one the public
`skippy_scheduler.order_cache_aware_candidates` calls); `reference_order` takes the same
arguments and returns the same order, the tests check the two against each other, and the
reference scheduler ranks its queue with it through `CacheAwareAdmission`.

The prefix grouping walks the waiting prompts as an implicit radix tree with an explicit stack
and skips runs of shared tokens in one step, so neither time nor stack depth follows prompt
length per token.
"""
from __future__ import annotations

from typing import Sequence as _Seq

from .._validate import U64_MAX, check_bool, check_uint, sat, sat_sub
from ..cache_policy import CacheAwareCandidate, ttft_deadline_key

# Ages inside one band of this many turns tie on the grouping score.
PREFIX_GROUPING_SCORE_BAND_TURNS = 4


def _scores(candidate: CacheAwareCandidate, current_turn: int, aging: int) -> tuple[int, int]:
    saved = candidate.affinity.estimated_saved_cost()
    age = sat_sub(current_turn, candidate.enqueued_turn)
    effective = sat(saved + sat(age * aging))
    bands = sat(age + PREFIX_GROUPING_SCORE_BAND_TURNS - 1) // PREFIX_GROUPING_SCORE_BAND_TURNS
    band_value = sat(max(aging, 1) * PREFIX_GROUPING_SCORE_BAND_TURNS)
    grouping = sat(saved + sat(bands * band_value))
    return effective, grouping


def _prefix_group_ranks(prompts: list[_Seq[int]], orders: list[int]) -> list[int]:
    """Rank of each position in the waiting-prefix DFS (§3.2).

    Identical prompts always stay together until they end at the same node, so they form a
    contiguous run; every member of the run gets the rank of its first member, which makes them
    compare equal as §3.3 step 3 requires.
    """
    ranks = [0] * len(prompts)
    next_rank = 0
    # Work items: (True, positions, depth) visits a node; (False, positions, 0) ranks a run of
    # identical prompts that end at a node.
    stack: list[tuple[bool, list[int], int]] = [(True, list(range(len(prompts))), 0)]
    while stack:
        is_visit, positions, depth = stack.pop()
        if not is_visit:
            for position in positions:
                ranks[position] = next_rank
            next_rank += len(positions)
            continue
        if len(positions) <= 1:
            for position in positions:
                ranks[position] = next_rank
                next_rank += 1
            continue
        limit = min(len(prompts[p]) for p in positions)
        first = prompts[positions[0]]
        others = [prompts[p] for p in positions[1:]]
        while depth < limit:
            token = first[depth]
            if any(other[depth] != token for other in others):
                break
            depth += 1
        buckets: dict[int, list[int]] = {}
        terminal: list[int] = []
        for position in positions:
            prompt = prompts[position]
            if len(prompt) > depth:
                buckets.setdefault(prompt[depth], []).append(position)
            else:
                terminal.append(position)
        ordered = sorted(
            buckets.items(),
            key=lambda item: (-len(item[1]), min(orders[p] for p in item[1]), item[0]),
        )
        terminal.sort(key=lambda p: orders[p])
        # Prompts ending here are all identical and come after every extension of them.
        stack.append((False, terminal, 0))
        for _token, bucket in reversed(ordered):
            stack.append((True, bucket, depth + 1))
    return ranks


def reference_order(
    candidates: _Seq[CacheAwareCandidate],
    current_turn: int,
    aging_cost_per_turn: int,
    group_waiting_prefixes: bool,
) -> list[int]:
    """Candidate `index` values, best first (§3.3)."""
    current_turn = check_uint("current_turn", current_turn, U64_MAX)
    aging = check_uint("aging_cost_per_turn", aging_cost_per_turn, U64_MAX)
    grouping = check_bool("group_waiting_prefixes", group_waiting_prefixes)
    candidates = list(candidates)
    for candidate in candidates:
        if not isinstance(candidate, CacheAwareCandidate):
            raise TypeError(f"candidates must be CacheAwareCandidate values, got {type(candidate).__name__}")
    scores = [_scores(c, current_turn, aging) for c in candidates]
    deadlines = [ttft_deadline_key(c.ttft_deadline) for c in candidates]
    if grouping:
        ranks = _prefix_group_ranks([c.prompt_tokens for c in candidates], [c.order for c in candidates])

        def key(i: int) -> tuple[int, ...]:
            c = candidates[i]
            return (-c.priority, -scores[i][1], deadlines[i], ranks[i], -scores[i][0], c.order)
    else:

        def key(i: int) -> tuple[int, ...]:
            c = candidates[i]
            return (-c.priority, -scores[i][0], deadlines[i], c.order)

    return [candidates[i].index for i in sorted(range(len(candidates)), key=key)]
