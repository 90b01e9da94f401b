"""Rows that need no decode of their own: the twins of one prompt (a request's `n` choices).

Sequences that start in the same plan from the same point (position 0, or the same restored
prefix) with the same tokens hold the same KV after their rows run. The first of them decodes;
the others are *followers*: their entries are left out of the batch, their cells are a copy of
the leader's (llama.cpp's `seq_cp`), and their sampling rows sample from the leader's logits
with their own chains (their own seeds). A follower stays one while each of its rows is the
same as its leader's in the same plan (the prompt's later chunks, and decode rows as long as
both sampled the same tokens); the first row that differs, or a plan with one of them only,
ends the pairing for good, and from then on each decodes its own rows.

So a request with n choices of one prompt prefills the prompt once when its choices are
admitted together (the scheduler still budgets each choice's rows: it knows no model);
`shared_tokens` counts the entries a copy replaced.
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

from ..kit import IntArray
from .lanes import KvCells



class Forks:
    """Which lane follows which, and the copies that keep them equal."""

    def __init__(self, cells: KvCells, shared_cells: bool) -> None:
        self._cells = cells
        self._shared_cells = shared_cells
        self._leader: dict[int, int] = {}  # follower lane -> leader lane
        self.shared_tokens = 0  # entries a copy replaced instead of a decode

    def forget(self, lane: int) -> None:
        """`lane`'s cells change other than by a shared row (released, cut back)."""
        if self._leader:
            self._leader = {f: m for f, m in self._leader.items() if lane not in (f, m)}

    @property
    def following(self) -> bool:
        """Whether some lane follows another's decode (its next rows may share the leader's)."""
        return bool(self._leader)

    def leaders(self, row_lanes: IntArray, offsets: IntArray, tokens: IntArray,
                starts: list[int], new_keys: dict[int, Any]) -> Optional[IntArray]:
        """Per row, the row whose decode stands for it (itself when it decodes); None when
        every row decodes. `new_keys`: row -> what a new sequence must share with another to
        follow it (where it starts from, ...), for the plan's new rows."""
        if not self._leader and len(new_keys) < 2:
            return None
        lanes = row_lanes.tolist()
        row_of_lane = {lane: r for r, lane in enumerate(lanes)}
        lead = np.arange(len(lanes), dtype=np.int64)
        shared = False

        def same(r: int, q: int) -> bool:
            a, b = int(offsets[r]), int(offsets[r + 1])
            c, d = int(offsets[q]), int(offsets[q + 1])
            return starts[r] == starts[q] and b - a == d - c and bool(
                np.array_equal(tokens[a:b], tokens[c:d]))

        for follower, leader in list(self._leader.items()):
            r, q = row_of_lane.get(follower), row_of_lane.get(leader)
            if r is not None and q is not None and q not in new_keys and same(r, q):
                lead[r] = q
                shared = True
            else:
                del self._leader[follower]
        if len(new_keys) > 1:
            groups: dict[tuple[Any, int, bytes], int] = {}
            for r, holder in new_keys.items():
                a, b = int(offsets[r]), int(offsets[r + 1])
                key = (holder, starts[r], tokens[a:b].tobytes())
                q = groups.setdefault(key, r)
                if q != r:
                    lead[r] = q
                    self._leader[lanes[r]] = lanes[q]
                    shared = True
        return lead if shared else None

    def copy(self, row_lanes: IntArray, lead: IntArray, starts: list[int],
             ends: list[int]) -> None:
        """After the decode: every follower row's cells from its leader's."""
        lanes = row_lanes.tolist()
        for r, q in enumerate(lead.tolist()):
            if q == r:
                continue
            src, dst = lanes[q], lanes[r]
            if self._shared_cells:
                self._cells.copy(src, dst, starts[r], ends[r])
            else:
                # A KV stream per lane: llama.cpp copies whole streams (at the next decode);
                # the leader's stream holds exactly the follower's positions.
                self._cells.copy(src, dst)
            self.shared_tokens += ends[r] - starts[r]
