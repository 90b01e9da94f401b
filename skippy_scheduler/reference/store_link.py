"""The reference scheduler's tie to an attached prefix store (behaviour.md §2.12).

Owns `StoreLink`: which store a `TwinScheduler` reads restores from, the costs it scores
matches with, the store epoch its waiting affinities reflect, the entry each waiting sequence
was last read against and the entry each active one holds pinned. A store serves one scheduler
at a time: the link records the scheduler as the store's `owner` (held weakly, so a scheduler
that is gone releases its store as a freed one does).
"""
from __future__ import annotations

import weakref
from typing import Any, Iterable, Optional

from .._validate import sat_sub
from ..prefix_store import store_affinity
from ..types import Sequence


def _release_pins(store: Any, pinned: dict[str, Any]) -> None:
    for entry in pinned.values():
        if getattr(entry, "alive", False):
            store.unpin(entry)
    pinned.clear()


class StoreLink:
    """A scheduler's attached store (or none) and the entries its sequences use."""

    def __init__(self) -> None:
        self.store: Optional[Any] = None
        self._costs = (1, 0)
        self._epoch = 0
        self._read_entry: dict[str, Any] = {}  # waiting: the entry of its last read
        self._pinned: dict[str, Any] = {}  # active: the entry pinned at admission
        self._finalizer: Optional[weakref.finalize] = None  # type: ignore[type-arg]

    def attach(self, scheduler: object, store: Optional[Any], prefill: int,
               restore: int) -> None:
        """Serve `scheduler` from `store` (None: detach); ValueError if it serves another."""
        owner = store.owner if store is not None else None
        if owner is not None and owner() is not None and owner() is not scheduler:
            raise ValueError("the prefix store serves another scheduler")
        native = getattr(store, "native_store", None)
        if native is not None and native.attached:  # a native scheduler's (kept in its core)
            raise ValueError("the prefix store serves another scheduler")
        if self.store is not None and self.store is not store:
            self.store.owner = None
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        if store is not None:
            store.owner = weakref.ref(scheduler)
            # A scheduler dropped while sequences are active gives their pins back (the store
            # may serve the next one). The finalizer holds the pin table, not the scheduler.
            self._finalizer = weakref.finalize(scheduler, _release_pins, store, self._pinned)
        self.store = store
        self._costs = (prefill, restore)
        self._epoch = store.epoch if store is not None else 0

    def read(self, s: Sequence, keep_epoch: bool = False) -> bool:
        """Reads `s`'s restore and cursor from the store; True when its restore or saved cost
        changed (with `keep_epoch`, an unchanged affinity keeps the epoch it was read at)."""
        store = self.store
        assert store is not None
        # The replay, not only the prompt: a preempted sequence restores the generated tokens
        # its KV held too (behaviour.md §2.12).
        hit = store.match(s.recompute_tokens() if s.generated_tokens else s.prompt_tokens)
        before = (s.prefix_restore.token_count if s.prefix_restore is not None else 0,
                  s.cache_affinity.estimated_saved_cost())
        restore, affinity = store_affinity(hit.matched_tokens, *self._costs, store.epoch)
        changed = (hit.matched_tokens, affinity.estimated_saved_cost()) != before
        if changed or not keep_epoch:
            s.prefix_restore, s.cache_affinity = restore, affinity
        self._read_entry[s.id] = hit.entry if hit.matched_tokens else None
        replay_len = s.recompute_token_count()
        cursor = min(hit.matched_tokens, replay_len)
        if not s.generated_tokens:
            cursor = min(cursor, sat_sub(replay_len, 1))
        s.prefill_cursor = cursor
        return changed

    def refresh(self, waiting: Iterable[Sequence]) -> int:
        """Before selection: every waiting sequence re-read if the store changed since its last
        reads; the number whose restore or saved cost changed (stale refreshes)."""
        store = self.store
        if store is None or store.epoch == self._epoch:
            return 0
        changed = sum(1 for s in waiting if self.read(s, keep_epoch=True))
        self._epoch = store.epoch
        return changed

    def pin(self, s: Sequence) -> None:
        """`s` is admitted: the entry it was last read against stays pinned while it is active."""
        entry = self._read_entry.pop(s.id, None)
        if entry is not None:
            assert self.store is not None
            self.store.pin(entry)
            self._pinned[s.id] = entry

    def unpin(self, s: Sequence) -> None:
        entry = self._pinned.pop(s.id, None)
        if entry is not None:
            assert self.store is not None
            self.store.unpin(entry)

    def forget(self, sequence_id: str) -> None:
        """A waiting sequence left (cancelled): its last read is void."""
        self._read_entry.pop(sequence_id, None)

    def holder(self, s: Sequence) -> Optional[int]:
        """The holder of the entry `s` was admitted with, which every row of it names."""
        entry = self._pinned.get(s.id)
        holder: Optional[int] = None if entry is None else entry.holder
        return holder
