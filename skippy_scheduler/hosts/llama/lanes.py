"""The context's KV cells and the lanes that hold running sequences.

A *lane* is a llama.cpp sequence id below the lane count; each running scheduler sequence holds
one while it runs. Lanes are handed out lowest first, so batches use consecutive ids (llama.cpp
splits a non-unified batch into fewer micro-batches then). Positions never move: a lane's cells
are [0, `end(lane)`), and a replay from an earlier position cuts the tail first.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Any

import llama_cpp as _ll

from ...sampling import SamplingParams


@dataclass(frozen=True)
class Start:
    """How a sequence without a lane starts: its sampling, the holder its prefix comes from."""

    params: SamplingParams | None
    holder: int | None


class KvCells:
    """The three cell verbs the host uses on the context's memory (any sequence id)."""

    def __init__(self, ctx: Any) -> None:
        self._mem: Any = _ll.llama_get_memory(ctx)
        # Copies asked of llama.cpp (prefix keeps and restores, forks); with a KV stream per
        # sequence each one moves a whole stream at the next decode (host_state reports it).
        self.copies = 0

    def close(self) -> None:
        """The context is freed: removals become no-ops (a store may still evict)."""
        self._mem = None

    def remove(self, seq: int, start: int = -1, end: int = -1) -> None:
        """Drop `seq`'s cells at positions [start, end) (-1: open end)."""
        if self._mem is not None:
            _ll.llama_memory_seq_rm(self._mem, seq, start, end)

    def copy(self, src: int, dst: int, start: int = -1, end: int = -1) -> None:
        """Give `dst` `src`'s cells at positions [start, end) (-1: open end; with a KV stream per
        sequence llama.cpp copies whole streams only)."""
        _ll.llama_memory_seq_cp(self._mem, src, dst, start, end)
        self.copies += 1

    def highest(self, seq: int) -> int:
        """The highest position `seq` holds, -1 for none."""
        return int(_ll.llama_memory_seq_pos_max(self._mem, seq))


class Lanes:
    """Which sequence holds which lane and how many positions each lane holds."""

    def __init__(self, count: int, cells: KvCells) -> None:
        self.count = count
        self._cells = cells
        self._free: list[int] = list(range(count))
        self._lane: dict[str, int] = {}
        self._end = [0] * count

    @property
    def active(self) -> list[str]:
        return list(self._lane)

    @property
    def free(self) -> int:
        return len(self._free)

    def lane_of(self, sequence_id: str) -> int | None:
        return self._lane.get(sequence_id)

    def holds(self, sequence_id: str) -> bool:
        return sequence_id in self._lane

    def end(self, lane: int) -> int:
        """Positions [0, end) of `lane` are in its cells."""
        return self._end[lane]

    def advance(self, lane: int, end: int) -> None:
        self._end[lane] = end

    def take(self, sequence_id: str) -> int:
        """The lowest free lane, empty, now held by `sequence_id`."""
        lane = heapq.heappop(self._free)
        self._lane[sequence_id] = lane
        self._cells.remove(lane)
        self._end[lane] = 0
        return lane

    def cut(self, lane: int, start: int) -> None:
        """Drop the lane's positions >= start (a replay rewrites them)."""
        self._cells.remove(lane, start, -1)
        self._end[lane] = start

    def give_back(self, sequence_id: str, lane: int) -> None:
        """`sequence_id` lets go of `lane`: its cells are dropped and the lane is free."""
        del self._lane[sequence_id]
        self._cells.remove(lane)
        self._end[lane] = 0
        heapq.heappush(self._free, lane)

    def positions_held(self) -> dict[int, int]:
        """Highest position llama.cpp holds per lane, for the lanes holding any (leak checks)."""
        out = {}
        for lane in range(self.count):
            pos = self._cells.highest(lane)
            if pos >= 0:
                out[lane] = pos
        return out
