"""Resident prefixes on stages: every stage keeps the same holder sequence ids (docs/stages.md).

With prefix reuse every stage context has `count` more sequence ids above the lanes, the
*holders*. The driver keeps the llama host's `PrefixHolders` (one store for all stages, when
their capacities are the same; `StageHolders` when each stage has its own) over `RemoteCells`: every cell operation the holders make becomes a
memory operation that every stage runs, in the same order, before the next plan. One KV cache
per stage (unified) lets a holder share a lane's cells instead of copying them.

A new row with a restore names its holder in the plan frame and every stage gives the lane the
holder's first positions itself, so the driver's own restore only records what the lane now
stands for (`restored`, with the cell copy held back). The last stage's sampler chains do not
see a restored prefix's tokens in any plan, so the driver sends them with the sampling
(`restored_prefixes`).
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional, Sequence

from ..llama.holders import PrefixHolders
from ...prefix_store import PrefixStore, StoreEntry, VirtualBackend
from .runner import OP_COPY, OP_REMOVE

__all__ = ["PrefixHolders", "RemoteCells", "StageHolders", "check_stage_capacities",
           "restored", "restored_prefixes"]


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


def restored_prefixes(holders: Optional[PrefixHolders], sampling: dict[int, Any],
                      restore: dict[int, int], lanes: Any,
                      starts: Sequence[int]) -> dict[str, list[int]]:
    """Lane -> the tokens of the restored prefix of every new row (by row: its sampling
    parameters, its holder; `lanes`: the plan's lane per row) that restores and keeps a
    penalty window. The last stage feeds
    them to the row's sampler chain before the row's own tokens, as the llama host does after
    a restore: no stage decodes them for this sequence, so the chain would not see them
    otherwise (docs/stages.md "Sampling"). Read after `restored` gave the lanes their
    prefixes."""
    out: dict[str, list[int]] = {}
    if holders is None:
        return out
    for r in restore:
        params = sampling.get(r)
        if params is None or starts[r] == 0 or not params.penalized:
            continue
        lane = int(lanes[r])
        out[str(lane)] = holders.lane_tokens(lane, int(starts[r])).tolist()
    return out


class StageCapacityError(ValueError):
    """Per-stage prefix cache capacities that do not fit the stages or the store."""


def check_stage_capacities(caps: Optional[Sequence[int]], prefix_cache_tokens: int,
                           stages: int) -> list[int]:
    """Each stage's prefix-holder capacity in tokens: `caps` (one per stage, each from 1 to
    `prefix_cache_tokens`, which sizes every stage context), or `prefix_cache_tokens` for
    every stage. ValueError otherwise."""
    if caps is None or len(caps) == 0:
        return [prefix_cache_tokens] * stages
    caps = list(caps)
    if not prefix_cache_tokens:
        raise StageCapacityError("per-stage prefix cache capacities need prefix_cache_tokens "
                                 "(the largest a stage may keep)")
    if len(caps) != stages:
        raise StageCapacityError(f"{len(caps)} per-stage prefix cache capacities for {stages} "
                                 "stages")
    for k, c in enumerate(caps):
        if isinstance(c, bool) or not isinstance(c, int) or not 1 <= c <= prefix_cache_tokens:
            raise StageCapacityError(f"stage {k}'s prefix cache capacity must be an int from 1 "
                                     f"to prefix_cache_tokens ({prefix_cache_tokens}), got "
                                     f"{c!r}")
    return caps


class StageHolders(PrefixHolders):
    """Prefix holders with a capacity per stage (docs/stages.md "Prefix holders on every
    stage").

    The store the scheduler reads (`store`, of `capacity_tokens`, at least every stage's)
    holds what *every* stage holds: each stage's own capacity is kept by a store of its own (`stage_stores[k]`, no
    backend) that mirrors every insert and touch of `store`. When a stage's store evicts an
    entry to stay within its capacity, or cannot take one at all, the entry is no longer
    restorable anywhere (a restore needs every stage's cells), so it is evicted from `store`
    too once the release that caused it is done: every stage drops its cells, and the store's
    epoch changes, so the scheduler's affinity for the prompts it matched is read afresh
    before the next selection. Entries a plan is about to restore are pinned in `store`, and
    so in every stage's store while it makes room."""

    def __init__(self, capacity_tokens: int, stage_capacities: Sequence[int], count: int,
                 first_id: int, lanes: int, n_ctx: int, cells: RemoteCells) -> None:
        super().__init__(capacity_tokens, count, first_id, lanes, n_ctx,
                         cells, shared_cells=True)  # type: ignore[arg-type]
        self.stage_capacities = list(stage_capacities)
        self.stage_stores = [
            PrefixStore(c, None, backend=VirtualBackend(on_evict=self._stage_evicted_by(k)),
                        namespace=f"stage-{k}") for k, c in enumerate(stage_capacities)]
        self.stage_evictions = [0] * len(stage_capacities)  # entries a stage alone let go
        self._mirror: list[dict[int, StoreEntry]] = [{} for _ in stage_capacities]
        self._doomed: list[StoreEntry] = []

    def _stage_evicted_by(self, k: int) -> Callable[[Any], None]:
        def evicted(shadow: Any) -> None:
            entry = shadow.value
            self._mirror[k].pop(entry.id, None)
            if entry.alive:  # this stage alone let it go: not restorable any more
                self.stage_evictions[k] += 1
                self._doomed.append(entry)
        return evicted

    def keep(self, lane: int, n: int) -> bool:
        resident = super().keep(lane, n)
        doomed, self._doomed = self._doomed, []
        # Longest first: a child goes before its parent (a parent with a resident child
        # cannot be evicted).
        for entry in sorted({e.id: e for e in doomed}.values(), key=lambda e: -e.length):
            if entry.alive and not self.store.evict(entry):
                raise RuntimeError(f"a stage dropped the prefix of holder {entry.holder} but "
                                   f"the store cannot evict it (pinned or with a child)")
        if doomed and resident:  # a stage may have let the new key itself go
            resident = self.store.match(self.lane_tokens(lane, n)).matched_tokens == n
        return resident

    def _keep(self, lane: int, n: int) -> bool:
        hit = self.store.match(self._tokens[lane, :n])
        if hit.matched_tokens == n and hit.entry is not None:
            for mirror, shadow in zip(self._mirror, self.stage_stores):
                if hit.entry.id in mirror:
                    shadow.touch(mirror[hit.entry.id])  # the same recency as `store`
        return super()._keep(lane, n)

    def inserted(self, entry: Any) -> None:
        super().inserted(entry)
        pinned = [e for e in self.store.resident() if e.pins > 0]
        for mirror, shadow in zip(self._mirror, self.stage_stores):
            parent = None
            if entry.parent is not None:
                parent = mirror.get(entry.parent.id)
                if parent is None:  # this stage does not hold the prefix it extends
                    self._doomed.append(entry)
                    continue
            held = [mirror[e.id] for e in pinned if e.id in mirror]
            for e in held:  # what a plan will restore is not this stage's to evict
                shadow.pin(e)
            try:
                got = shadow.insert(entry.key, parent, value=entry)
            finally:
                for e in held:
                    if e.alive:
                        shadow.unpin(e)
            if got is None:  # more than this stage's capacity
                self._doomed.append(entry)
            else:
                mirror[entry.id] = got

    def evicted(self, entry: Any) -> None:
        super().evicted(entry)
        for mirror, shadow in zip(self._mirror, self.stage_stores):
            mine = mirror.pop(entry.id, None)
            if mine is not None and mine.alive:
                shadow.evict(mine)

    def stage_used_tokens(self) -> list[int]:
        """Tokens each stage's holders keep by its own store."""
        return [s.used_tokens for s in self.stage_stores]
