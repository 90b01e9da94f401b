"""The twin scheduler's iteration plan: the same surface as the native plan, in numpy."""
from __future__ import annotations

import numpy as np

from ._checks import check_uint
from .types import IterationPhase, IterationWork


class TwinOutputs:
    """Sampled-output block: entry k says row `request_indexes[k]` sampled `predicted_tokens[k]`."""

    __slots__ = ("request_indexes", "predicted_tokens", "_count")

    def __init__(self, capacity: int) -> None:
        self.request_indexes = np.zeros(capacity, dtype=np.uint64)
        self.predicted_tokens = np.zeros(capacity, dtype=np.int32)
        self._count = 0

    @property
    def capacity(self) -> int:
        return len(self.request_indexes)

    @property
    def count(self) -> int:
        return self._count

    @count.setter
    def count(self, value: int) -> None:
        self._count = check_uint("outputs.count", value)


class TwinPlan:
    """Rows of one iteration plus flat numpy views of them (row index = work index)."""

    def __init__(self, work: list[IterationWork], token_count: int, admitted: int) -> None:
        self.work = work
        self.token_count = token_count
        self.admitted = admitted
        self.preempted = 0
        rows = len(work)
        lengths = np.fromiter((len(w.tokens) for w in work), dtype=np.intp, count=rows)
        self.row_offsets = np.zeros(rows + 1, dtype=np.intp)
        np.cumsum(lengths, out=self.row_offsets[1:])
        self.tokens = np.fromiter((t for w in work for t in w.tokens), dtype=np.int32, count=token_count)
        self.positions = np.fromiter((p for w in work for p in w.positions), dtype=np.int32, count=token_count)
        self.sample_last = np.fromiter((w.sample_last for w in work), dtype=np.bool_, count=rows)
        self.phases = np.fromiter((w.phase.value for w in work), dtype=np.uint8, count=rows)
        self.sample_rows = np.flatnonzero(self.sample_last).astype(np.intp)
        self.outputs = TwinOutputs(rows)

    def __len__(self) -> int:
        return len(self.work)

    def __iter__(self):
        return iter(self.work)

    def __getitem__(self, index: int) -> IterationWork:
        return self.work[index]

    def decode_rows(self) -> int:
        return sum(1 for w in self.work if w.phase is IterationPhase.Decode)

    def __repr__(self) -> str:
        rows = ", ".join(f"{w.sequence_id}:{w.phase.name}x{len(w.tokens)}" for w in self.work)
        return f"TwinPlan(token_count={self.token_count}, admitted={self.admitted}, rows=[{rows}])"
