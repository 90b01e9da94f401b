"""bench/fleet.py's load and table (the measurement itself is run by hand: docs/fleet.md)."""
from __future__ import annotations

import argparse

from fleet_support import fleet_bench


def _args(**kw):
    base = dict(groups=3, prefix_tokens=9, suffix_tokens=4, requests=30, seed=1)
    base.update(kw)
    return argparse.Namespace(**base)


def test_requests_are_a_groups_prefix_then_words_of_their_own():
    prompts = fleet_bench.make_prompts(_args())
    assert len(prompts) == 30
    words = [p.split() for p in prompts]
    assert all(len(w) == 8 + 4 for w in words)  # BOS is the prefix's first token
    prefixes = {tuple(w[:8]) for w in words}
    assert 1 < len(prefixes) <= 3
    assert fleet_bench.make_prompts(_args()) == prompts  # seeded
    assert fleet_bench.make_prompts(_args(seed=2)) != prompts


def test_the_table_has_a_row_per_policy():
    row = dict(policy="kv_aware", prefix_hit_rate=0.5, prefilled_tokens=100.0,
               ttft_p50_s=0.01, ttft_p99_s=0.02, output_tokens_per_s=30.0,
               per_replica_requests=[3.0, 5.0])
    table = fleet_bench.markdown([row, dict(row, policy="round_robin")]).splitlines()
    assert len(table) == 4 and table[0].startswith("| policy |")
    assert table[2] == "| kv_aware | 0.500 | 100 | 0.010 | 0.020 | 30.0 | 3 / 5 |"
