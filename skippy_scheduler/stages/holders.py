"""Resident prefixes on stages: every stage keeps the same holder sequence ids (docs/stages.md).

With prefix reuse every stage context has `count` more sequence ids above the lanes, the
*holders*. The driver keeps the llama host's `PrefixHolders` (one store for all stages, whose
capacities are the same) over `RemoteCells`: every cell operation the holders make becomes a
memory operation that every stage runs, in the same order, before the next plan. One KV cache
per stage (unified) lets a holder share a lane's cells instead of copying them.

A new row with a restore names its holder in the plan frame and every stage gives the lane the
holder's first positions itself, so the driver's own restore only records what the lane now
stands for (`restored`, with the cell copy held back).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

from ..hosts.llama.holders import PrefixHolders
from .runner import OP_COPY, OP_REMOVE

__all__ = ["PrefixHolders", "RemoteCells", "restored"]


class RemoteCells:
    """The cell verbs `PrefixHolders` uses, queued for every stage as memory operations."""

    def __init__(self) -> None:
        self.ops: list[list[int]] = []
        self._held_back = False

    def remove(self, seq: int, start: int = -1, end: int = -1) -> None:
        """Drop `seq`'s positions from `start` on (-1: all of them); only open ends occur."""
        if end != -1:
            raise ValueError("stages remove a sequence's positions up to its end only")
        if not self._held_back:
            self.ops.append([OP_REMOVE, seq, start, -1, 0])

    def copy(self, src: int, dst: int, start: int = -1, end: int = -1) -> None:
        """Give `dst` `src`'s cells at positions [start, end) (-1: open end)."""
        if not self._held_back:
            self.ops.append([OP_COPY, src, dst, start, end])

    def take(self) -> list[list[int]]:
        ops, self.ops = self.ops, []
        return ops

    @contextlib.contextmanager
    def held_back(self) -> Iterator[None]:
        """Operations made meanwhile are not queued (the stages did them already)."""
        self._held_back = True
        try:
            yield
        finally:
            self._held_back = False


def restored(holders: PrefixHolders, cells: RemoteCells, lane: int, holder: int,
             start: int) -> None:
    """The stages gave `lane` the holder's first `start` positions (a new row's restore)."""
    with cells.held_back():
        holders.restore(lane, holder, start)
