"""Resident prefixes on stages: every stage keeps the same holder sequence ids (docs/stages.md).

With prefix reuse every stage context has `count` more sequence ids above the lanes, the
*holders*. The driver owns one `PrefixStore` for all stages (their capacities are the same) and
is its backend: the store decides what is resident, this module turns each decision into memory
operations that every stage runs in the same order (`RemoteCells`), before the next plan. One
KV cache per stage (unified) lets a holder share a lane's cells instead of copying them, so an
entry's holder gets its parent's cells for the parent's positions and the lane's for the rest;
the store counts shared cells once, under the parent.

A new row with a restore names its holder in the plan frame; each stage copies the holder's
first positions into the lane itself, so the driver only records what the lane now stands for.
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np
import numpy.typing as npt

from ..prefix_store import PrefixStore, StoreEntry
from .runner import OP_COPY, OP_REMOVE

# A shared part shorter than this is not worth a holder sequence of its own.
MIN_SPLIT_TOKENS = 16


class RemoteCells:
    """Memory operations queued for every stage, taken by the driver before the next plan."""

    def __init__(self) -> None:
        self.ops: list[list[int]] = []

    def remove(self, seq: int, start: int = -1) -> None:
        """Drop `seq`'s positions from `start` on (-1: all of them)."""
        self.ops.append([OP_REMOVE, seq, start, -1, 0])

    def copy(self, src: int, dst: int, start: int, end: int) -> None:
        """Give `dst` `src`'s cells at positions [start, end)."""
        self.ops.append([OP_COPY, src, dst, start, end])

    def take(self) -> list[list[int]]:
        ops, self.ops = self.ops, []
        return ops


class StageHolders:
    """The store of resident prefixes, each lane's tokens, and the store's backend."""

    def __init__(self, capacity_tokens: int, count: int, first_id: int, lanes: int,
                 n_ctx: int, cells: RemoteCells) -> None:
        self.count = count
        self.kept = 0
        self._cells = cells
        self._tokens: npt.NDArray[np.int32] = np.zeros((lanes, n_ctx), dtype=np.int32)
        self._entry: dict[int, StoreEntry] = {}
        self.store = PrefixStore(capacity_tokens, count, backend=self, first_holder_id=first_id)

    def wrote(self, lanes: npt.NDArray[np.int32], positions: npt.NDArray[np.int32],
              tokens: npt.NDArray[np.int32]) -> None:
        """Entry i of a plan put `tokens[i]` at `positions[i]` of `lanes[i]`."""
        self._tokens[lanes, positions] = tokens

    def length(self, holder: int) -> int:
        """Positions the holder's resident entry holds (0: none)."""
        entry = self._entry.get(holder)
        return 0 if entry is None or not entry.alive else entry.length

    def restored(self, lane: int, holder: int, start: int) -> None:
        """The stages gave `lane` the holder's first `start` positions (a new row's restore)."""
        entry = self._entry[holder]
        self._tokens[lane, :start] = entry.key[:start]
        self.store.touch(entry)

    def keep(self, lane: int, n: int) -> None:
        """Offer the lane's first `n` positions to the store as the prefix they stand for."""
        store = self.store
        key = self._tokens[lane, :n].copy()
        hit = store.match(key)
        if hit.matched_tokens == n and hit.entry is not None:
            store.touch(hit.entry)  # all of it is resident already
            return
        # The parent is the deepest resident entry whose whole key is a prefix of this one.
        parent: Optional[StoreEntry] = hit.entry
        while parent is not None and parent.length > hit.matched_tokens:
            parent = parent.parent
        if hit.matched_tokens >= MIN_SPLIT_TOKENS and (
                parent is None or parent.length < hit.matched_tokens):
            # The shared part becomes a branch point, so its cells are counted once.
            parent = store.insert(key[:hit.matched_tokens], parent, value=lane) or parent
        if store.insert(key, parent, value=lane) is not None:
            self.kept += 1

    # -- the store's backend ------------------------------------------------------------------
    def inserted(self, entry: Any) -> None:
        holder, lane = entry.holder, entry.value
        self._cells.remove(holder)
        start = 0
        if entry.parent is not None:
            start = entry.parent.length
            self._cells.copy(entry.parent.holder, holder, 0, start)
        self._cells.copy(lane, holder, start, entry.length)
        self._entry[holder] = entry

    def evicted(self, entry: Any) -> None:
        self._entry.pop(entry.holder, None)
        self._cells.remove(entry.holder)
