"""The native prefix store and its pure-Python twin agree step by step on random operation
sequences (inserts under a parent or not, touches, pins, evictions, matches, finds, and uses of
evicted entries, which must raise on both)."""
from __future__ import annotations

import random

import pytest

from lab_support import kt, picture, random_key
from skippy_scheduler.prefix_store import PrefixStore, VirtualBackend
from skippy_scheduler.reference import PrefixStoreTwin


def _differential(seed, steps):
    rng = random.Random(seed)
    capacity = rng.choice([None, 5, 8, 12, 20])
    slots = rng.choice([None, 2, 3, 5, 8])
    first = rng.choice([0, 9])
    logs = ([], [])
    stores = [impl(capacity, slots, first_holder_id=first,
                   backend=VirtualBackend(on_evict=lambda e, log=log: log.append(kt(e))))
              for impl, log in zip((PrefixStore, PrefixStoreTwin), logs)]
    pairs = []  # (native entry, twin entry) of every insert, resident or not
    counts = dict.fromkeys(["entry", "refused", "raised", "evicted"], 0)
    for step in range(steps):
        op = rng.choices(["root", "child", "touch", "pin", "unpin", "evict", "match", "find"],
                         weights=[28, 28, 10, 6, 12, 5, 7, 4])[0]
        live = [p for p in pairs if p[0].alive]
        # mostly resident entries; now and then an evicted one (every use of it must raise)
        pair = (rng.choice(live) if live and rng.random() < 0.85
                else rng.choice(pairs) if pairs else (None, None))
        if op == "root":
            key = random_key(rng)
            calls = [lambda s, _: s.insert(key)] * 2
        elif op == "child":
            parent = pair[0]
            prefix = parent.key.tolist() if parent is not None else ()
            key = random_key(rng, prefix)
            if rng.random() < 0.1:
                key = key[:rng.randrange(len(key))]  # too short, or not under the parent
            elif rng.random() < 0.1 and len(key) > 1:
                key[rng.randrange(len(key) - 1)] ^= 1
            calls = [lambda s, p: s.insert(key, parent=p)] * 2
        elif op in ("touch", "pin", "unpin"):
            if pair[0] is None:
                continue
            calls = [lambda s, e, op=op: getattr(s, op)(e)] * 2
        elif op == "evict":
            calls = [lambda s, _: s.evict_one()] * 2
        elif op == "match":
            probe = random_key(rng, low=0, high=6)
            calls = [lambda s, _: (lambda m: (m.matched_tokens, kt(m.entry)))(s.match(probe))] * 2
        else:
            probe = random_key(rng, low=0, high=5)
            calls = [lambda s, _: s.find(probe)] * 2
        results = []
        for side, (store, call) in enumerate(zip(stores, calls)):
            try:
                got = call(store, pair[side])
                if op in ("root", "child", "evict", "find"):
                    got = (kt(got), getattr(got, "holder", None))
                results.append(("ok", got))
            except (ValueError, TypeError) as exc:
                results.append(("raised", type(exc)))
        assert results[0] == results[1], (seed, step, op, results)
        if op in ("root", "child") and results[0][0] == "ok":
            if results[0][1][0] is None:
                counts["refused"] += 1
            else:
                counts["entry"] += 1
                pairs.append((stores[0].find(key), stores[1].find(key)))
        counts["raised"] += results[0][0] == "raised"
        assert logs[0] == logs[1], (seed, step)
        assert picture(stores[0]) == picture(stores[1]), (seed, step, op)
    counts["evicted"] = len(logs[0])
    return counts


@pytest.mark.parametrize("seed", range(8))
def test_native_and_twin_agree_step_by_step(seed):
    counts = _differential(seed, 400)
    # the sequence exercised what it is meant to
    assert counts["entry"] > 30 and counts["raised"] > 0
    assert counts["evicted"] > 0 or counts["refused"] > 0


@pytest.mark.parametrize("impl", [PrefixStore, PrefixStoreTwin], ids=["native", "twin"])
def test_an_entry_of_another_store_is_refused(impl):
    """An entry's id would name one of the other store's entries: every call taking an entry
    refuses it, and neither store changes."""
    a, b = impl(16, None), impl(16, None)
    ea = a.insert([1, 2, 3])
    eb = b.insert([4, 5, 6])
    assert ea is not None and eb is not None
    for call in (lambda: b.pin(ea), lambda: b.unpin(ea), lambda: b.touch(ea),
                 lambda: b.evictable(ea), lambda: b.insert([1, 2, 3, 4], ea)):
        with pytest.raises(ValueError, match="not an entry of this PrefixStore"):
            call()
    assert eb.pins == 0 and ea.pins == 0 and b.evictable(eb) and a.evictable(ea)
    assert [e.tokens for e in b.resident()] == [eb.tokens]
