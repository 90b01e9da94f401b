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
from typing import Any, Optional, Sequence

from ...types import MemoryComponent
from ..._validate import check_int
from .channel import StageFailure, StageTimeout

__all__ = ["StageUsage", "UsageVerbs", "check_stage_cells"]


def check_stage_cells(n_ctx: int, stage_n_ctx: Optional[Sequence[int]],
                      stages: int) -> list[int]:
    """The cells of each stage's context: `stage_n_ctx` (one per stage; serve and run give a
    stage that keeps fewer prefixes only the cells its own capacity needs), else `n_ctx` for
    every stage. ValueError otherwise."""
    cells = [n_ctx] * stages if stage_n_ctx is None else list(stage_n_ctx)
    if len(cells) != stages:
        raise ValueError(f"{len(cells)} context sizes for {stages} stages")
    return [check_int("stage_n_ctx", c, 1) for c in cells]


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
    """`memory_components` and `stage_usage` for `StageHost` (its stages' cells and bytes per
    position, as their `ready` answers said, its channel and lane count)."""

    n_seq_max: int
    broken: Any
    stage_cells: list[int]
    stage_kv_bytes: list[int]
    stage_prefix_cache_tokens: list[int]

    @property
    def memory_components(self) -> list[MemoryComponent]:
        """One KV memory component per stage (its cells times the bytes a position takes in
        its layers; the cells the prefix holders may keep are resident), for the scheduler's
        `memory_components`: admission then keeps every admitted sequence's prompt and
        `max_tokens` within every stage's KV cache (docs/stages.md "KV memory per stage")."""
        return [MemoryComponent(f"kv-stage-{k}", capacity_bytes=cells * per_token,
                                resident_bytes=min(cells, kept) * per_token,
                                bytes_per_token=per_token, bytes_per_sequence=0)
                for k, (cells, per_token, kept) in enumerate(zip(
                    self.stage_cells, self.stage_kv_bytes, self.stage_prefix_cache_tokens))]

    def stage_usage(self, timeout_s: Optional[float] = None) -> list[StageUsage]:
        """Every live stage's measured KV use (after the plans sent so far have run and the
        lanes released since were freed: `sync`). `timeout_s`: how long each stage may take to
        answer (None: the chain's default); one that does not breaks the chain."""
        self.sync(timeout_s)  # type: ignore[attr-defined]
        self._broadcast(b"usage", {})  # type: ignore[attr-defined]
        try:
            replies = self._collect(b"usage", "asking for KV use",  # type: ignore[attr-defined]
                                    timeout_s)
        except StageTimeout as exc:  # a stage stopped answering: the chain cannot run
            self._break_chain(str(exc))  # type: ignore[attr-defined]
            raise
        out = []
        for r in replies:
            try:
                seqs = {int(k): (int(v[0]), int(v[1])) for k, v in r["seqs"].items()}
                per_token = int(r["kv_bytes_per_token"])
            except (AttributeError, IndexError, KeyError, TypeError, ValueError) as exc:
                raise StageFailure(f"stage {r['index']} sent a malformed usage answer: "
                                   f"{exc!r}") from None
            lanes = [v for k, v in seqs.items() if k < self.n_seq_max]
            holders = [v for k, v in seqs.items() if k >= self.n_seq_max]
            out.append(StageUsage(
                index=int(r["index"]), kv_bytes_per_token=per_token,
                lane_cells=sum(c for c, _ in lanes), lane_bytes=sum(b for _, b in lanes),
                holder_cells=sum(c for c, _ in holders),
                holder_bytes=sum(b for _, b in holders), seqs=seqs))
        return out
