"""A scheduler with an attached prefix store re-reads, before each admission selection, the
waiting sequences whose restore may have changed (docs/behaviour.md §2.12). Checked here from
the outside under random inserts, evictions, submits and completions:

* after every plan each waiting sequence carries the restore the store backs its prompt with
  now (not the one it had when it was submitted or last read);
* the stale refresh counter rises by exactly the sequences whose restore changed since they
  were last read;
* each admitted sequence pins the entry the store backs its restore with at admission.

Prompts come from a three-token alphabet and mostly open with the same token, so resident keys
nest, branch at every depth and share their first tokens, and most evictions leave a shorter
resident prefix behind (the prompts under the evicted key are then backed by that prefix).
"""
from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest

from skippy_scheduler import Scheduler, SchedulerConfig, Sequence
from skippy_scheduler import bench as B
from skippy_scheduler.prefix_store import PrefixStore, VirtualBackend


def _prompt(rng: random.Random) -> list[int]:
    head = [1] if rng.random() < 0.8 else [rng.choice((2, 3))]
    return head + [rng.choice((1, 2, 3)) for _ in range(rng.randint(2, 9))]


class _Run:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.evicted_with_parent = 0  # evictions that leave the evicted key's parent resident
        self.store = PrefixStore(capacity_tokens=24,
                                 backend=VirtualBackend(on_evict=self._on_evict))
        self.s = Scheduler(SchedulerConfig(max_active_sequences=3, max_waiting_sequences=64,
                                           max_tokens_per_iteration=256))
        self.s.attach_prefix_store(self.store)
        self.prompts: dict[str, list[int]] = {}
        self.seen: dict[str, int] = {}  # restore tokens at the sequence's last read
        self.pinned: Counter = Counter()  # entry id -> active sequences admitted with it
        self.pin_of: dict[str, int] = {}
        self.serial = 0

    def _on_evict(self, entry) -> None:
        if entry.parent is not None and entry.parent.alive:
            self.evicted_with_parent += 1

    def matched(self, sid: str) -> int:
        return self.store.match(np.asarray(self.prompts[sid], dtype=np.int32)).matched_tokens

    def submit(self) -> None:
        sid = f"q{self.serial}"
        self.serial += 1
        self.prompts[sid] = _prompt(self.rng)
        self.s.submit(Sequence(sid, self.prompts[sid], self.rng.randint(1, 3)))
        self.seen[sid] = self.matched(sid)

    def change_store(self) -> None:
        if self.rng.random() < 0.25:
            self.store.evict_one()
            return
        key = _prompt(self.rng)[:self.rng.randint(1, 8)]
        parent = None
        for cut in range(len(key) - 1, 0, -1):
            parent = self.store.find(key[:cut])
            if parent is not None:
                break
        self.store.insert(key, parent=parent)

    def plan(self) -> None:
        s = self.s
        waiting = list(s.snapshot().waiting_ids)
        stale = sum(self.seen[i] != self.matched(i) for i in waiting)
        entries = {i: self.store.match(np.asarray(self.prompts[i], dtype=np.int32)).entry
                   for i in waiting}
        before = s.metrics().stale_refreshes
        plan = s.plan_iteration()
        assert s.metrics().stale_refreshes - before == stale
        snap = s.snapshot()
        for i in snap.waiting_ids:
            restore = s.sequence(i).prefix_restore
            got = restore.token_count if restore is not None else 0
            assert got == self.matched(i), (i, self.prompts[i])
            self.seen[i] = got
        for i in set(snap.active_ids) & set(waiting):  # admitted by this plan
            if entries[i] is not None:
                self.pinned[entries[i].id] += 1
                self.pin_of[i] = entries[i].id
        assert {e.id: e.pins for e in self.store.resident() if e.pins} == +self.pinned
        B.write_outputs(plan)
        s.complete_iteration(plan)
        for r in s.retired():
            if r.id in self.pin_of:
                self.pinned[self.pin_of.pop(r.id)] -= 1


@pytest.mark.parametrize("seed", range(6))
def test_waiting_restores_follow_the_store(seed):
    run = _Run(seed)
    for _ in range(12):
        run.submit()
    for _ in range(120):
        for _ in range(run.rng.randint(0, 3)):
            run.change_store()
        for _ in range(run.rng.randint(0, 2)):
            run.submit()
        run.plan()
    assert run.s.metrics().stale_refreshes > 0
    assert run.evicted_with_parent > 0
