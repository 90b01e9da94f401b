"""KV memory each stage measures, beside what the scheduler budgets (docs/stages.md "KV memory
per stage").

`StageHost.stage_usage()` asks every live stage (a `usage` message, answered after the plans
sent before it) for the cells and bytes each of its sequences holds, as llama.cpp counts them
in that stage's cache, and sums them for the lanes and for the prefix holders. The scheduler's
per-stage memory components (`StageHost.memory_components`) predict the same figures from the
stage's layers (`bytes_per_token` per position); tests/stages/test_stage_caches.py checks the
two against each other.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["StageUsage", "UsageVerbs"]


@dataclass(frozen=True)
class StageUsage:
    """One stage's KV use, measured by llama.cpp: cells and bytes of its lanes and holders
    (a holder's cells shared with a lane or another holder count for each), and the bytes one
    position takes in its layers as the stage computed them from its model."""

    index: int
    kv_bytes_per_token: int
    lane_cells: int
    lane_bytes: int
    holder_cells: int
    holder_bytes: int
    seqs: dict[int, tuple[int, int]] = field(default_factory=dict)  # seq id -> cells, bytes


class UsageVerbs:
    """`stage_usage` for `StageHost` (its channel and lane count)."""

    n_seq_max: int
    broken: Any

    def stage_usage(self) -> list[StageUsage]:
        """Every live stage's measured KV use (after the plans sent so far have run)."""
        if self.broken is None:
            self._quiesce("waiting for the plans in flight")  # type: ignore[attr-defined]
        self._broadcast(b"usage", {})  # type: ignore[attr-defined]
        out = []
        for r in self._collect(b"usage", "asking for KV use"):  # type: ignore[attr-defined]
            seqs = {int(k): (int(v[0]), int(v[1])) for k, v in r["seqs"].items()}
            lanes = [v for k, v in seqs.items() if k < self.n_seq_max]
            holders = [v for k, v in seqs.items() if k >= self.n_seq_max]
            out.append(StageUsage(
                index=int(r["index"]), kv_bytes_per_token=int(r["kv_bytes_per_token"]),
                lane_cells=sum(c for c, _ in lanes), lane_bytes=sum(b for _, b in lanes),
                holder_cells=sum(c for c, _ in holders),
                holder_bytes=sum(b for _, b in holders), seqs=seqs))
        return out
