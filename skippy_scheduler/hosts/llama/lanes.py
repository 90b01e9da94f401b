"""The context's KV cells and the lanes that hold running sequences.

A *lane* is a llama.cpp sequence id below the lane count; each running scheduler sequence holds
one while it runs. Lanes are handed out lowest first, so batches use consecutive ids (llama.cpp
splits a non-unified batch into fewer micro-batches then). Positions never move: a lane's cells
are [0, `end(lane)`), and a replay from an earlier position cuts the tail first. `Lanes` is the
hosts' lane table (hosts/kit.py) over the context's cells.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import llama_cpp as _ll

from ... import _llama_calls
from ...sampling import SamplingParams
from ..kit import LaneTable, function_address, pointer_address


@dataclass(frozen=True)
class Start:
    """How a sequence without a lane starts: its sampling, the holder its prefix comes from."""

    params: SamplingParams | None
    holder: int | None


class KvCells:
    """The three cell verbs the host uses on the context's memory (any sequence id)."""

    def __init__(self, ctx: Any) -> None:
        self._mem: Any = _ll.llama_get_memory(ctx)
        # The verbs are called from C without giving the GIL up (each walks the sequence's
        # cells on the host, no device work; a ctypes call would give the GIL up and wait to
        # take it back), through ctypes where llama.cpp's functions cannot be found (0).
        self._mem_address = pointer_address(self._mem)
        self._remove_fn = function_address("llama_memory_seq_rm")
        self._copy_fn = function_address("llama_memory_seq_cp")
        # Copies asked of llama.cpp (prefix keeps and restores, forks); with a KV stream per
        # sequence each one moves a whole stream at the next decode (host_state reports it).
        self.copies = 0

    def close(self) -> None:
        """The context is freed: removals and copies become no-ops (a store may still
        evict)."""
        self._mem = None

    def remove(self, seq: int, start: int = -1, end: int = -1) -> None:
        """Drop `seq`'s cells at positions [start, end) (-1: open end)."""
        if self._mem is None:
            return
        if self._remove_fn:
            _llama_calls.remove_range(self._remove_fn, self._mem_address, seq, start, end)
        else:
            _ll.llama_memory_seq_rm(self._mem, seq, start, end)

    def copy(self, src: int, dst: int, start: int = -1, end: int = -1) -> None:
        """Give `dst` `src`'s cells at positions [start, end) (-1: open end; with a KV stream per
        sequence llama.cpp copies whole streams only)."""
        if self._mem is None:
            return
        if self._copy_fn:
            _llama_calls.copy_range(self._copy_fn, self._mem_address, src, dst, start, end)
        else:
            _ll.llama_memory_seq_cp(self._mem, src, dst, start, end)
        self.copies += 1

    def highest(self, seq: int) -> int:
        """The highest position `seq` holds, -1 for none."""
        return int(_ll.llama_memory_seq_pos_max(self._mem, seq))

    def positions_held(self, count: int) -> dict[int, int]:
        """Highest position held per sequence id below `count`, for those holding any (leak
        checks)."""
        out = {}
        for seq in range(count):
            pos = self.highest(seq)
            if pos >= 0:
                out[seq] = pos
        return out


Lanes = LaneTable  # over `KvCells`: a lane's cells go when it is taken, cut or given back
