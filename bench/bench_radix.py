"""Peek latency of UnifiedRadixCache: a 4 096-token prompt against 1 000 cached entries.

Run: python bench/bench_radix.py [--entries 1000] [--prompt 4096] [--repeat 5000]
Reports median and p99 per call (µs) for the native cache with a list prompt and with a
numpy int32 prompt (no conversion), a compact pure-Python compressed trie doing the same
backing-prefix walk, and the flat pure-Python twin (the brute-force oracle of the tests).
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from skippy_scheduler import UnifiedRadixCache
from skippy_scheduler.reference.radix import RadixTwin, _lcp


class PyTrie:
    """Minimal pure-Python compressed trie: resident insert and backing-prefix peek only."""

    def __init__(self):
        self.root = [(), None, {}, 0]  # edge, value, children by first token, residents below

    def insert_resident(self, namespace, tokens, nbytes, value):
        key, node, path = tuple(tokens), self.root, [self.root]
        i = 0
        while i < len(key):
            child = node[2].get(key[i])
            if child is None:
                leaf = [key[i:], None, {}, 0]
                node[2][key[i]] = leaf
                node, i = leaf, len(key)
                break
            edge = child[0]
            common = _lcp(edge, key[i:i + len(edge)])
            if common < len(edge):
                split = [edge[:common], None, {edge[common]: child}, child[3]]
                child[0] = edge[common:]
                node[2][key[i]] = split
                child = split
            node, i = child, i + common
            path.append(node)
        if node[1] is None:
            for n in path + [node]:
                n[3] += 1
        node[1] = value

    def peek_resident(self, namespace, tokens):
        query, node, i = tuple(tokens), self.root, 0
        while i < len(query):
            child = node[2].get(query[i])
            if child is None or child[3] == 0:
                break
            edge = child[0]
            if query[i:i + len(edge)] == edge:
                node, i = child, i + len(edge)
                continue
            common = _lcp(edge, query[i:i + len(edge)])
            node, i = child, i + common
            break
        while node[1] is None and i:
            node = next(c for _, c in sorted(node[2].items()) if c[3])
        return (i, node[1]) if i else None


def build(cache, entries: int, rng) -> list[list[int]]:
    """Entries share one of 8 system prefixes (1 024 tokens) plus a private continuation."""
    prefixes = [rng.integers(0, 32_000, 1024).tolist() for _ in range(8)]
    keys = []
    for i in range(entries):
        tail = rng.integers(0, 32_000, int(rng.integers(64, 3072))).tolist()
        key = prefixes[i % 8] + tail
        cache.insert_resident("stage-0", key, len(key), f"entry-{i}")
        keys.append(key)
    return keys


def timed(fn, arg, repeat: int) -> tuple[float, float]:
    samples = []
    clock = time.perf_counter_ns
    for _ in range(repeat):
        t0 = clock()
        fn("stage-0", arg)
        samples.append(clock() - t0)
    samples.sort()
    return statistics.median(samples) / 1e3, samples[int(len(samples) * 0.99)] / 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, allow_abbrev=False)
    ap.add_argument("--entries", type=int, default=1000)
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=5000)
    ap.add_argument("--twin-repeat", type=int, default=30)
    args = ap.parse_args()

    rng = np.random.default_rng(0)
    cache = UnifiedRadixCache()
    keys = build(cache, args.entries, rng)
    target = max(keys, key=len)
    shared = min(3072, len(target), args.prompt)
    hot = target[:shared] + rng.integers(40_000, 50_000, args.prompt - shared).tolist()
    cold = rng.integers(40_000, 50_000, args.prompt).tolist()
    hot_np = np.asarray(hot, dtype=np.int32)
    hit = cache.peek_resident("stage-0", hot)
    assert hit is not None and hit.matched_tokens == shared, hit
    stats = cache.stats()
    print(f"cache: {stats.resident_entries} entries, {stats.nodes} nodes, "
          f"{stats.token_edges} edge tokens; prompt {args.prompt} tokens, hit {shared}")

    rows = [
        ("native peek, list prompt (hit)", cache.peek_resident, hot, args.repeat),
        ("native peek, int32 array (hit)", cache.peek_resident, hot_np, args.repeat),
        ("native peek, list prompt (miss)", cache.peek_resident, cold, args.repeat),
    ]
    twin = RadixTwin()
    build(twin, args.entries, np.random.default_rng(0))
    assert twin.peek_resident("stage-0", hot).matched_tokens == shared
    rows.append(("pure-Python twin peek, list (hit)", twin.peek_resident, hot,
                 args.twin_repeat))
    trie = PyTrie()
    build(trie, args.entries, np.random.default_rng(0))
    assert trie.peek_resident("stage-0", hot)[0] == shared
    rows.append(("pure-Python trie peek, list (hit)", trie.peek_resident, hot, args.repeat))

    results = {}
    print(f"{'case':40s} {'median_us':>10s} {'p99_us':>10s}")
    for name, fn, arg, repeat in rows:
        for _ in range(min(repeat, 100)):
            fn("stage-0", arg)
        results[name] = timed(fn, arg, repeat)
        print(f"{name:40s} {results[name][0]:10.2f} {results[name][1]:10.2f}")
    native = results["native peek, list prompt (hit)"][0]
    twin_us = results["pure-Python twin peek, list (hit)"][0]
    native_np = results["native peek, int32 array (hit)"][0]
    trie_us = results["pure-Python trie peek, list (hit)"][0]
    print(f"pure-Python trie / native: {trie_us / native:.1f}x (list prompt), "
          f"{trie_us / native_np:.1f}x (int32 prompt)")
    print(f"flat twin / native: {twin_us / native:.0f}x (list prompt), "
          f"{twin_us / native_np:.0f}x (int32 prompt)")


if __name__ == "__main__":
    main()
