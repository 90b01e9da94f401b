"""PrefixStore: lookups, capacity in tokens and holder slots, pins, LRU eviction of unpinned
leaves, backend notifications; checked against an independent model under random operations."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from skippy_scheduler.prefix_store import PrefixStore, VirtualBackend


def toks(*values):
    return np.asarray(values, dtype=np.int32)


def chain(store, prompt, sizes, parent=None):
    """Insert consecutive segments of `prompt` of the given sizes; return the entries."""
    out, end = [], parent.length if parent is not None else 0
    for size in sizes:
        end += size
        parent = store.insert(prompt[:end], parent=parent)
        out.append(parent)
    return out


def test_match_find_and_shared_prefixes_counted_once():
    store = PrefixStore(capacity_tokens=100)
    p = np.arange(10, dtype=np.int32)
    a, b = chain(store, p, [4, 3])
    assert (a.length, a.tokens, b.length, b.tokens) == (4, 4, 7, 3)
    q = p.copy()
    q[5] = 99
    c = store.insert(q[:8], parent=a)  # shares a's 4 tokens, adds 4 of its own
    assert c.tokens == 4 and store.used_tokens == 11 and store.entries == 3
    assert a.children == 2 and b.children == 0
    m = store.match(p)
    assert m.matched_tokens == 7 and m.entry is b
    m = store.match(q[:6])
    assert m.matched_tokens == 6 and m.entry is c  # a longer entry backs the slice
    assert store.match(toks(50, 51)).matched_tokens == 0 and store.match(toks()).entry is None
    assert store.find(p[:4]) is a and store.find(p[:5]) is None
    assert store.insert(p[:7], parent=a) is b  # already resident: the same entry
    assert np.array_equal(store.key_of(c), q[:8]) and np.array_equal(c.segment, q[4:8])


def test_lookups_do_not_change_recency():
    store = PrefixStore(capacity_tokens=4)
    old = store.insert(toks(1, 2))
    store.insert(toks(3, 4))
    for _ in range(3):
        store.match(toks(1, 2, 9))
        store.find(toks(1, 2))
    store.insert(toks(5, 6))
    assert not old.alive  # still the least recently used: reads did not heat it


def test_eviction_is_lru_among_unpinned_leaves():
    evicted = []
    store = PrefixStore(capacity_tokens=6, backend=VirtualBackend(on_evict=evicted.append))
    a, b, c = (store.insert(toks(k, k)) for k in (1, 2, 3))  # 2 tokens each: full
    store.touch(a)  # recency now b < c < a
    store.pin(c)
    d = store.insert(toks(4, 4))
    assert evicted == [b]
    e = store.insert(toks(5, 5))
    assert evicted == [b, a]  # c is pinned, so a (older than d) goes
    assert store.insert(toks(6, 6)) is not None and evicted == [b, a, d]
    assert [x.alive for x in (c, e)] == [True, True]
    store.pin(e)
    before = (store.used_tokens, store.entries)
    # Only pinned entries and the newest remain; a 6-token entry cannot be made room for.
    assert store.insert(toks(7, 7, 7, 7, 7, 7)) is None
    assert store.refused_inserts == 1 and (store.used_tokens, store.entries) == before
    assert store.used_tokens <= store.capacity_tokens
    store.unpin(c)
    assert store.lru_order()[0] is c


def test_parents_outlive_their_children_and_keep_their_own_recency():
    store = PrefixStore(capacity_tokens=8)
    p = np.arange(20, dtype=np.int32)
    root, mid, leaf = chain(store, p, [2, 2, 2])
    other = store.insert(toks(90, 91))  # total 8 tokens: full
    store.touch(other)  # the chain is older than `other` now
    assert store.lru_order() == [leaf, other]  # interior entries are not candidates
    store.insert(toks(80, 81))
    assert not leaf.alive and mid.alive and mid.children == 0
    store.insert(toks(70, 71))
    assert not mid.alive  # the parent was next: its last use was with its child
    assert root.alive and store.used_tokens == 8


def test_one_insert_can_evict_a_whole_chain_leaf_first():
    order = []
    store = PrefixStore(capacity_tokens=6, backend=VirtualBackend(on_evict=order.append))
    p = np.arange(6, dtype=np.int32)
    root, mid, leaf = chain(store, p, [2, 2, 2])
    big = store.insert(toks(50, 51, 52, 53, 54, 55))
    assert big is not None and order == [leaf, mid, root] and store.used_tokens == 6


def test_a_pinned_leaf_protects_its_whole_prefix():
    store = PrefixStore(capacity_tokens=6)
    p = np.arange(6, dtype=np.int32)
    root, leaf = chain(store, p, [2, 2])
    store.pin(leaf)
    x = store.insert(toks(40, 41))
    assert store.insert(toks(50, 51)) is not None and not x.alive
    assert store.insert(toks(60, 61, 62, 63)) is None and root.alive and leaf.alive


def test_holder_slots_bound_the_number_of_entries():
    store = PrefixStore(holder_slots=2)
    a = store.insert(toks(1))
    store.insert(toks(2))
    store.insert(toks(3, 3, 3))
    assert not a.alive and store.entries == 2 and store.evictions == 1
    assert PrefixStore(holder_slots=0).insert(toks(1)) is None
    assert PrefixStore(capacity_tokens=2).insert(toks(1, 2, 3)) is None


def test_the_parent_of_a_new_entry_is_never_its_victim():
    store = PrefixStore(capacity_tokens=4)
    p = np.arange(8, dtype=np.int32)
    (root,) = chain(store, p, [2])
    other = store.insert(toks(30, 31))
    store.touch(other)
    child = store.insert(p[:4], parent=root)  # the LRU entry is `root`, but it is the parent
    assert child is not None and root.alive and not other.alive


def test_backend_hears_every_insert_and_eviction_in_order():
    events = []
    backend = VirtualBackend(on_insert=lambda e: events.append(("in", e.value)),
                             on_evict=lambda e: events.append(("out", e.value)))
    store = PrefixStore(capacity_tokens=2, backend=backend)
    store.insert(toks(1), value="a")
    store.insert(toks(2), value="b")
    store.insert(toks(3), value="c")
    assert events == [("in", "a"), ("in", "b"), ("out", "a"), ("in", "c")]


def test_keys_are_kept_without_copying_only_when_read_only():
    store = PrefixStore()
    writable = np.arange(4, dtype=np.int32)
    e = store.insert(writable)
    writable[0] = 77
    assert e.key[0] == 0 and not e.key.flags.writeable
    frozen = np.arange(10, 14, dtype=np.int32)
    frozen.setflags(write=False)
    f = store.insert(frozen)
    assert f.key is frozen


def test_argument_errors():
    store = PrefixStore()
    a = store.insert(toks(1, 2))
    with pytest.raises(ValueError, match="does not extend"):
        store.insert(toks(1, 2), parent=a)
    with pytest.raises(ValueError, match="not pinned"):
        store.unpin(a)
    with pytest.raises(ValueError):
        PrefixStore(capacity_tokens=-1)
    with pytest.raises(ValueError):
        store.insert(toks(1, 2, 3)[None, :])
    other = PrefixStore(capacity_tokens=1)
    gone = other.insert(toks(5))
    other.insert(toks(6))
    with pytest.raises(ValueError, match="not resident"):
        other.insert(toks(5, 6), parent=gone)
    with pytest.raises(ValueError):
        other.pin(gone)


# -- random operations against an independent model --------------------------------------------


class Model:
    """What the store should do, written directly from the rules: entries are tuples of tokens;
    recency is a counter stamped on an entry and its prefixes; the victim is the unpinned entry
    without resident extensions with the smallest (stamp, insertion number)."""

    def __init__(self, capacity, slots):
        self.capacity, self.slots = capacity, slots
        self.entries = {}  # key -> [parent key, tokens, stamp, serial, pins]
        self.clock = self.serial = 0
        self.evicted = []

    def children(self, key):
        return sum(1 for v in self.entries.values() if v[0] == key)

    def used(self):
        return sum(v[1] for v in self.entries.values())

    def touch(self, key):
        self.clock += 1
        while key is not None:
            self.entries[key][2] = self.clock
            key = self.entries[key][0]

    def fits(self, need):
        return self.used() + need <= self.capacity and len(self.entries) + 1 <= self.slots

    def insert(self, key, parent):
        if key in self.entries:
            self.touch(key)
            return True
        need = len(key) - (len(parent) if parent is not None else 0)
        if need > self.capacity:
            return False
        victims = []
        protected = parent
        entries = {k: list(v) for k, v in self.entries.items()}
        while not (sum(v[1] for v in entries.values()) + need <= self.capacity
                   and len(entries) + 1 <= self.slots):
            cands = [(v[2], v[3], k) for k, v in entries.items()
                     if v[4] == 0 and k != protected
                     and not any(w[0] == k for w in entries.values())]
            if not cands:
                return False
            _, _, victim = min(cands)
            victims.append(victim)
            del entries[victim]
        for victim in victims:
            del self.entries[victim]
            self.evicted.append(victim)
        self.serial += 1
        self.entries[key] = [parent, need, 0, self.serial, 0]
        self.touch(key)
        return True


def _key(parent, family, pick):
    """The key an insert op makes: the same (parent, pick) always gives the same key, and
    different picks differ at the new segment's first token."""
    if parent is None:
        return np.full(1 + pick % 3, family * 1000 + pick, dtype=np.int32)
    segment = np.full(1 + pick % 4, family * 1000 + 100 + 10 * (parent.length % 80) + pick,
                      dtype=np.int32)
    return np.concatenate([parent.key, segment])


@settings(max_examples=80, deadline=None)
@given(st.integers(4, 24), st.integers(2, 12),
       st.lists(st.tuples(st.sampled_from(["insert", "insert", "touch", "pin", "unpin"]),
                          st.integers(0, 3), st.integers(0, 9)),
                min_size=1, max_size=60))
def test_store_matches_the_model(capacity, slots, ops):
    evicted = []
    store = PrefixStore(capacity, slots, backend=VirtualBackend(
        on_evict=lambda e: evicted.append(tuple(e.key.tolist()))))
    model = Model(capacity, slots)
    for op, family, pick in ops:
        live = store.resident()
        if op == "insert":
            mine = [e for e in live if e.key[0] // 1000 == family]
            parent = mine[pick % len(mine)] if mine and pick % 3 else None
            key = _key(parent, family, pick)
            pkey = tuple(parent.key.tolist()) if parent is not None else None
            got = store.insert(key, parent=parent)
            assert (got is not None) == model.insert(tuple(key.tolist()), pkey)
        elif live:
            e = live[pick % len(live)]
            k = tuple(e.key.tolist())
            if op == "touch":
                store.touch(e)
                model.touch(k)
            elif op == "pin":
                store.pin(e)
                model.entries[k][4] += 1
            elif e.pins:
                store.unpin(e)
                model.entries[k][4] -= 1
        assert evicted == model.evicted
        assert store.used_tokens == model.used() <= capacity
        assert store.entries == len(model.entries) <= slots
        assert {tuple(e.key.tolist()): e.pins for e in store.resident()} == \
            {k: v[4] for k, v in model.entries.items()}
