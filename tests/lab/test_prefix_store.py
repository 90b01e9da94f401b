"""PrefixStore (native) and PrefixStoreTwin (reference): lookups, capacity in tokens and holder
slots, pins, LRU eviction of unpinned leaves, holder ids, epochs, refused inserts, bad input,
backend notifications; both checked against an independent model under random operations
(behaviour.md §8c; tests/differential/test_prefix_store.py checks them against each other)."""
from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from skippy_scheduler.prefix_store import PrefixStore, VirtualBackend
from skippy_scheduler.reference import PrefixStoreTwin
from lab_support import kt, picture, random_key

# Every unit test runs on both stores; `Store` is the class under test.
both = pytest.mark.parametrize("Store", [PrefixStore, PrefixStoreTwin], ids=["native", "twin"])


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


@both
def test_match_find_and_shared_prefixes_counted_once(Store):
    store = Store(capacity_tokens=100)
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


@both
def test_lookups_do_not_change_recency(Store):
    store = Store(capacity_tokens=4)
    old = store.insert(toks(1, 2))
    store.insert(toks(3, 4))
    for _ in range(3):
        store.match(toks(1, 2, 9))
        store.find(toks(1, 2))
    store.insert(toks(5, 6))
    assert not old.alive  # still the least recently used: reads did not heat it


@both
def test_eviction_is_lru_among_unpinned_leaves(Store):
    evicted = []
    store = Store(capacity_tokens=6, backend=VirtualBackend(on_evict=evicted.append))
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


@both
def test_parents_outlive_their_children_and_keep_their_own_recency(Store):
    store = Store(capacity_tokens=8)
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


@both
def test_one_insert_can_evict_a_whole_chain_leaf_first(Store):
    order = []
    store = Store(capacity_tokens=6, backend=VirtualBackend(on_evict=order.append))
    p = np.arange(6, dtype=np.int32)
    root, mid, leaf = chain(store, p, [2, 2, 2])
    big = store.insert(toks(50, 51, 52, 53, 54, 55))
    assert big is not None and order == [leaf, mid, root] and store.used_tokens == 6


@both
def test_a_pinned_leaf_protects_its_whole_prefix(Store):
    store = Store(capacity_tokens=6)
    p = np.arange(6, dtype=np.int32)
    root, leaf = chain(store, p, [2, 2])
    store.pin(leaf)
    x = store.insert(toks(40, 41))
    assert store.insert(toks(50, 51)) is not None and not x.alive
    assert store.insert(toks(60, 61, 62, 63)) is None and root.alive and leaf.alive


@both
def test_holder_slots_bound_the_number_of_entries(Store):
    store = Store(holder_slots=2)
    a = store.insert(toks(1))
    store.insert(toks(2))
    store.insert(toks(3, 3, 3))
    assert not a.alive and store.entries == 2 and store.evictions == 1
    assert Store(holder_slots=0).insert(toks(1)) is None
    assert Store(capacity_tokens=2).insert(toks(1, 2, 3)) is None


@both
def test_the_parent_of_a_new_entry_is_never_its_victim(Store):
    store = Store(capacity_tokens=4)
    p = np.arange(8, dtype=np.int32)
    (root,) = chain(store, p, [2])
    other = store.insert(toks(30, 31))
    store.touch(other)
    child = store.insert(p[:4], parent=root)  # the LRU entry is `root`, but it is the parent
    assert child is not None and root.alive and not other.alive


@both
def test_backend_hears_every_insert_and_eviction_in_order(Store):
    events = []
    backend = VirtualBackend(on_insert=lambda e: events.append(("in", e.value)),
                             on_evict=lambda e: events.append(("out", e.value)))
    store = Store(capacity_tokens=2, backend=backend)
    store.insert(toks(1), value="a")
    store.insert(toks(2), value="b")
    store.insert(toks(3), value="c")
    assert events == [("in", "a"), ("in", "b"), ("out", "a"), ("in", "c")]


@both
def test_keys_are_kept_without_copying_only_when_read_only(Store):
    store = Store()
    writable = np.arange(4, dtype=np.int32)
    e = store.insert(writable)
    writable[0] = 77
    assert e.key[0] == 0 and not e.key.flags.writeable
    frozen = np.arange(10, 14, dtype=np.int32)
    frozen.setflags(write=False)
    f = store.insert(frozen)
    assert f.key is frozen


@both
def test_argument_errors(Store):
    store = Store()
    a = store.insert(toks(1, 2))
    with pytest.raises(ValueError, match="does not extend"):
        store.insert(toks(1, 2), parent=a)
    with pytest.raises(ValueError, match="not pinned"):
        store.unpin(a)
    with pytest.raises(ValueError):
        Store(capacity_tokens=-1)
    with pytest.raises(ValueError):
        store.insert(toks(1, 2, 3)[None, :])
    other = Store(capacity_tokens=1)
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


@both
@settings(max_examples=80, deadline=None)
@given(st.integers(4, 24), st.integers(2, 12),
       st.lists(st.tuples(st.sampled_from(["insert", "insert", "touch", "pin", "unpin"]),
                          st.integers(0, 3), st.integers(0, 9)),
                min_size=1, max_size=60))
def test_store_matches_the_model(Store, capacity, slots, ops):
    evicted = []
    store = Store(capacity, slots, backend=VirtualBackend(
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


# -- properties every store keeps ----------------------------------------------------------------


@both
def test_lru_order_is_least_recently_used_first_and_evict_one_follows_it(Store):
    store = Store()
    a, b, c, d = (store.insert(toks(k)) for k in (1, 2, 3, 4))
    assert store.lru_order() == [a, b, c, d]  # insert order when nothing was touched
    store.touch(b)
    store.touch(a)
    assert store.lru_order() == [c, d, b, a]
    assert store.insert(toks(3)) is c  # inserting a resident key touches it
    assert store.lru_order() == [d, b, a, c]
    store.pin(b)
    assert store.lru_order() == [d, a, c]  # pinned: not a candidate
    e = store.insert(toks(4, 5), parent=d)
    assert store.lru_order() == [a, c, e]  # d has a resident child now
    # d was stamped with e, so once e is gone d is the next victim
    assert [store.evict_one() for _ in range(4)] == [a, c, e, d]
    assert store.evict_one() is None and store.lru_order() == [] and b.alive
    store.unpin(b)
    assert store.lru_order() == [b] and store.evict_one() is b and store.entries == 0


@both
def test_a_pinned_entry_is_never_evicted(Store):
    rng = random.Random(11)
    store = Store(capacity_tokens=12, holder_slots=5)
    root = store.insert(toks(7, 7))
    pinned = store.insert(toks(7, 7, 8), parent=root)
    store.pin(pinned)
    refused = 0
    for _ in range(300):
        refused += store.insert(random_key(rng)) is None
        if rng.random() < 0.2:
            victim = store.evict_one()
            assert victim is not pinned and victim is not root
        # the pinned leaf keeps its whole prefix resident
        assert pinned.alive and root.alive and pinned.pins == 1
    assert store.evictions > 50
    while store.evict_one() is not None:
        pass
    assert store.resident() == [root, pinned] and store.lru_order() == []
    store.unpin(pinned)
    assert store.evict_one() is pinned and store.evict_one() is root


@both
@pytest.mark.parametrize("capacity,slots", [(10, None), (None, 4), (9, 3), (3, 1)])
def test_capacity_in_tokens_and_holder_slots_is_never_exceeded(Store, capacity, slots):
    rng = random.Random(f"{capacity}-{slots}")
    store = Store(capacity_tokens=capacity, holder_slots=slots)
    pinned = []
    refused = 0
    for _ in range(400):
        live = store.resident()
        parent = rng.choice(live) if live and rng.random() < 0.5 else None
        prefix = parent.key.tolist() if parent is not None else ()
        refused += store.insert(random_key(rng, prefix), parent=parent) is None
        live = store.resident()
        if live and rng.random() < 0.15 and len(pinned) < 2:
            pinned.append(rng.choice(live))
            store.pin(pinned[-1])
        elif pinned and rng.random() < 0.2:
            store.unpin(pinned.pop(rng.randrange(len(pinned))))
        live = store.resident()
        assert store.used_tokens == sum(e.tokens for e in live)
        assert store.entries == len(live)
        assert capacity is None or store.used_tokens <= capacity
        assert slots is None or store.entries <= slots
        assert all(e.alive for e in pinned)
    assert store.evictions > 20
    assert refused == store.refused_inserts


@both
def test_holder_ids_stay_in_their_range_and_are_reused_after_eviction(Store):
    evicted = []
    store = Store(holder_slots=3, first_holder_id=40,
                  backend=VirtualBackend(on_evict=evicted.append))
    a, b, c = (store.insert(toks(k)) for k in (1, 2, 3))
    assert [a.holder, b.holder, c.holder] == [40, 41, 42]  # the lowest free one first
    d = store.insert(toks(4))  # evicts a, the least recently used: d takes its holder
    assert not a.alive and d.holder == 40
    assert store.evict_one() is b
    assert store.insert(toks(5)).holder == 41
    rng = random.Random(3)
    for _ in range(300):
        before = len(evicted)
        if rng.random() < 0.2:
            store.evict_one()
            continue
        live = store.resident()
        parent = rng.choice(live) if live and rng.random() < 0.4 else None
        prefix = parent.key.tolist() if parent is not None else ()
        entry = store.insert(random_key(rng, prefix), parent=parent)
        freed = {e.holder for e in evicted[before:]}
        if entry is not None and freed:
            assert entry.holder in freed  # a freed holder is handed out again first
        holders = [e.holder for e in store.resident()]
        assert len(set(holders)) == len(holders)
        assert all(40 <= h < 43 for h in holders)
    assert len(evicted) > 50
    assert Store().insert(toks(1)).holder is None  # unbounded slots hand out no holder ids


@both
def test_a_refused_insert_changes_nothing(Store):
    def build():
        evicted = []
        store = Store(capacity_tokens=8, holder_slots=4,
                      backend=VirtualBackend(on_evict=lambda e: evicted.append(kt(e))))
        root = store.insert(toks(1, 1))
        leaf = store.insert(toks(1, 1, 2, 2), parent=root)
        store.insert(toks(3, 3))
        store.pin(leaf)
        store.touch(root)
        return store, evicted

    store, evicted = build()
    untouched, untouched_evicted = build()
    before = picture(store)
    # 2 tokens are free and only the 2 of (3, 3) can be freed: 5 do not fit. Choosing victims
    # took (3, 3) off the candidates before giving up; it must be a candidate again.
    assert store.insert(toks(5, 5, 5, 5, 5)) is None
    after = picture(store)
    assert after["stats"][5] == before["stats"][5] + 1
    assert after["stats"][:5] + after["stats"][6:] == before["stats"][:5] + before["stats"][6:]
    assert (after["resident"], after["lru"]) == (before["resident"], before["lru"])
    assert evicted == []
    # The parent of the new entry is not a victim either, even when that means a refusal.
    root = store.find(toks(1, 1))
    assert store.insert(toks(1, 1, 4, 4, 4, 4, 4), parent=root) is None
    assert picture(store)["resident"] == before["resident"]
    # From here on the store behaves as one that never saw the refused inserts.
    for key in ((6, 6), (7,), (8, 8, 8), (9, 9, 9, 9)):
        assert kt(store.insert(toks(*key))) == kt(untouched.insert(toks(*key)))
        mine, theirs = picture(store), picture(untouched)
        assert mine["stats"][5] == theirs["stats"][5] + 2
        assert (mine["resident"], mine["lru"]) == (theirs["resident"], theirs["lru"])
    assert evicted == untouched_evicted and evicted
    # A refusal for want of a holder slot.
    slots = Store(holder_slots=2)
    for k in (1, 2):
        slots.pin(slots.insert(toks(k)))
    before = picture(slots)
    assert slots.insert(toks(3)) is None and slots.refused_inserts == 1
    assert picture(slots)["resident"] == before["resident"]


@both
def test_the_epoch_moves_with_inserts_and_evictions_only(Store):
    store = Store(capacity_tokens=6)
    epoch = store.epoch
    a = store.insert(toks(1, 1))
    b = store.insert(toks(1, 1, 2), parent=a)
    c = store.insert(toks(3, 3))
    assert store.epoch == epoch + 3
    epoch = store.epoch
    # reads, recency and pins
    store.match(toks(1, 1, 2, 9))
    store.match(toks(9))
    store.find(toks(3, 3))
    store.find(toks(9))
    store.touch(a)
    store.pin(c)
    store.unpin(c)
    store.lru_order()
    store.resident()
    assert store.insert(toks(1, 1)) is a  # already resident: touched, nothing changes
    assert store.epoch == epoch
    # an insert that evicts moves it once per change
    evictions = store.evictions
    assert store.insert(toks(4, 4, 4)) is not None
    assert store.evictions - evictions == 2 and store.epoch == epoch + 3
    epoch = store.epoch
    assert store.evict_one() is not None and store.epoch == epoch + 1
    epoch = store.epoch
    for entry in store.resident():
        store.pin(entry)
    assert store.evict_one() is None and store.insert(toks(5, 5, 5, 5)) is None
    (d,) = store.resident()
    with pytest.raises(ValueError):
        store.insert(toks(9, 9, 9, 9), parent=d)
    assert store.epoch == epoch


@both
def test_bad_input_raises_before_any_change(Store):
    store = Store(capacity_tokens=10, holder_slots=4)
    root = store.insert(toks(1, 2))
    leaf = store.insert(toks(1, 2, 3), parent=root)
    store.insert(toks(5))
    assert store.evict_one() is leaf
    store.pin(root)
    other = store.find(toks(5))
    before = picture(store)
    bad = [
        (ValueError, lambda: store.insert(toks(1, 2, 3, 4), parent=leaf)),  # evicted parent
        (ValueError, lambda: store.insert(toks(9, 9, 9), parent=root)),  # parent not a prefix
        (ValueError, lambda: store.insert(toks(1, 9, 9), parent=root)),
        (ValueError, lambda: store.insert(toks(1), parent=root)),  # does not extend it
        (ValueError, lambda: store.insert(toks(1, 2), parent=root)),
        (ValueError, lambda: store.insert(toks())),
        (ValueError, lambda: store.insert([])),
        (ValueError, lambda: store.insert(np.zeros((2, 2), dtype=np.int32))),
        (ValueError, lambda: store.insert(np.asarray([1, -2], dtype=np.int32))),
        (ValueError, lambda: store.insert(np.asarray([1, -2], dtype=np.int64))),
        (ValueError, lambda: store.insert([1 << 31])),
        (TypeError, lambda: store.insert([1.5, 2.0])),
        (ValueError, lambda: store.touch(leaf)),
        (ValueError, lambda: store.pin(leaf)),
        (ValueError, lambda: store.unpin(leaf)),
        (ValueError, lambda: store.unpin(other)),  # not pinned
    ]
    for error, call in bad:
        with pytest.raises(error):
            call()
        assert picture(store) == before, call
    for kwargs in ({"capacity_tokens": -1}, {"holder_slots": -1}, {"capacity_tokens": True},
                   {"holder_slots": 2.0}, {"capacity_tokens": "8"}, {"first_holder_id": -1},
                   {"first_holder_id": 1.0}):
        with pytest.raises(ValueError):
            Store(**kwargs)
