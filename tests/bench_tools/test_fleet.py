"""bench/fleet.py's load and table (the measurement itself is run by hand: docs/fleet.md)."""
from __future__ import annotations

import argparse

import fleet
from skippy_bench.fleet_trace import ReplicaEvents, analyse, stickiness, store_model


def _args(**kw):
    base = dict(groups=3, prefix_tokens=9, suffix_tokens=4, requests=30, seed=1)
    base.update(kw)
    return argparse.Namespace(**base)


def test_requests_are_a_groups_prefix_then_words_of_their_own():
    prompts = fleet.make_prompts(_args())
    assert len(prompts) == 30
    words = [p.split() for p in prompts]
    assert all(len(w) == 8 + 4 for w in words)  # BOS is the prefix's first token
    prefixes = {tuple(w[:8]) for w in words}
    assert 1 < len(prefixes) <= 3
    assert fleet.make_prompts(_args()) == prompts  # seeded
    assert fleet.make_prompts(_args(seed=2)) != prompts


def test_the_table_has_a_row_per_policy():
    row = dict(policy="kv_aware", prefix_hit_rate=0.5, prefilled_tokens=100.0,
               ttft_p50_s=0.01, ttft_p99_s=0.02, output_tokens_per_s=30.0,
               per_replica_requests=[3.0, 5.0])
    table = fleet.markdown([row, dict(row, policy="round_robin")]).splitlines()
    assert len(table) == 4 and table[0].startswith("| policy |")
    assert table[2] == "| kv_aware | 0.500 | 100 | 0.010 | 0.020 | 30.0 | 3 / 5 |"


def test_prompt_groups_number_the_prefixes_in_order_of_appearance():
    args = _args()
    prompts = fleet.make_prompts(args)
    groups = fleet.prompt_groups(args, prompts)
    assert groups[0] == 0 and set(groups) == set(range(max(groups) + 1))
    for p, q, g, h in zip(prompts, prompts[1:], groups, groups[1:]):
        assert (p.split()[:8] == q.split()[:8]) == (g == h)


def test_the_trace_rebuilds_residency_and_stickiness_from_events():
    rep = ReplicaEvents([(1.0, [{"type": "BlockStored", "block_hashes": [1, 2]}]),
                         (2.0, [{"type": "BlockRemoved", "block_hashes": [2]}]),
                         (3.0, [{"type": "AllBlocksCleared"},
                                {"type": "BlockStored", "block_hashes": [5]}])])
    assert rep.resident_at(0.5) == {}
    assert rep.resident_at(1.5) == {1: 1.0, 2: 1.0}
    assert rep.resident_at(2.5) == {1: 1.0}
    assert rep.resident_at(9.0) == {5: 3.0}
    assert rep.stored() == {1, 2, 5}
    # group 0: replicas 0, 0, 1; group 1: replica 1 twice; one request not placed
    assert stickiness([0, 0, 1, 1, 1, None], [0, 0, 0, 1, 1, 1]) == 4 / 5


def test_the_store_model_counts_hits_of_the_last_holders():
    # one replica, two holders: a b a (hit; now two holders of a, b out) c (one a out) b (miss,
    # the other a out) a (miss): the repeated group filled both holders
    groups = [0, 1, 0, 2, 1, 0]
    assert store_model(groups, 2, lambda i, g: 0) == 1 / 6
    # two replicas by group: every repeat hits
    assert store_model(groups, 2, lambda i, g: g % 2) == 3 / 6


def test_the_trace_table_has_a_row_per_policy():
    trace = {"group_stickiness": 0.75, "prefix_at_send": {
        "on_served": 5, "only_elsewhere": 2, "only_elsewhere_fresh": 1, "nowhere": 3,
        "nowhere_but_running": 2, "nowhere_but_running_elsewhere": 1},
        "groups_resident_mean": [2.5, 3.0], "holders_per_replica": 4,
        "modelled_hit_share": {"round_robin": 0.25, "partition": 0.5}}
    table = fleet.trace_markdown([dict(policy="kv_aware", trace=trace)]).splitlines()
    assert len(table) == 3
    assert table[2] == "| kv_aware | 0.75 | 5 / 2 (1) / 3 (2, 1) | 2.5 / 3.0 of 4 | 0.250 / 0.500 |"


def test_the_trace_places_requests_by_their_own_blocks():
    from skippy_scheduler.serve.kv_events import chain, wire_hash

    block = 2
    prefix = [1, 9, 9, 9]  # two blocks shared by the group
    a, b, c = prefix + [5, 6], prefix + [7, 8], prefix + [3, 4]

    def stored(key, at):
        return (at, [{"type": "BlockStored",
                      "block_hashes": [wire_hash(h) for h in chain(key, block, "0")]}])

    class Recorder:
        # replica 0 ran a (ended at 2) then c; replica 1 ran b, sent at 1.5 while a ran
        replicas = [ReplicaEvents([stored(a, 2.0), stored(c, 5.0)]),
                    ReplicaEvents([stored(b, 4.0)])]

    out = analyse(Recorder(), [a, b, c], [0, 0, 0], [1.0, 1.5, 3.0], 4, block, 4,
                  ended=[2.0, 4.0, 5.0])
    assert out["requests_by_replica"] == [2, 1]
    w = out["prefix_at_send"]
    assert (w["on_served"], w["nowhere"], w["nowhere_but_running"],
            w["nowhere_but_running_elsewhere"]) == (1, 2, 1, 1)
    assert out["group_stickiness"] == 2 / 3
