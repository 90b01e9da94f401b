"""The lab host's two prefix cache models (docs/lab.md), each a `PrefixModel` of lab/host.py.

* `FamilyPrefixCache` (the workload suite): one `UnifiedRadixCache`, namespace "stage-0". When
  the first request of a family produces its first token, the family prefix becomes resident
  (never evicted). At submit a request's prompt is peeked (no recency change); a hit becomes a
  prefix restore of the matched tokens plus a one-stage affinity (saved cost = matched x
  prefill_token_us), frozen at submit as in a scheduler without a prefix store (§3.5).
* `BlockPrefixCache` (the trace replay): a bounded `PrefixStore` of 512-token blocks attached to
  the scheduler, which reads each request's restore from it at submit, refreshes the waiting
  requests under changed blocks before every admission selection and pins an admitted
  request's restore while it runs (behaviour.md §2.12). A block becomes resident when the
  prefill that covers it completes (block by block, so a long prompt is cacheable before its
  prefill ends); the last, partial block when the whole prompt has been fed. While a request
  runs it pins the deepest resident block of its prompt, which keeps its whole prefix resident;
  unpinned blocks are evicted least recently used when room is needed; a block that cannot be
  made room for is not cached (and neither are the request's later blocks). At admission the
  model touches the restored blocks.
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

from ..cache_policy import CacheAffinity, StageCacheAffinity
from ..prefix_store import PrefixStore, VirtualBackend
from ..radix import UnifiedRadixCache
from ..types import IterationPhase, PrefixRestore, PrefixRestoreKind, Sequence
from .host import Live
from .traces import BLOCK_TOKENS, blocks_for
from .workload import Workload

NAMESPACE = "stage-0"
_PHASE_PREFILL = IterationPhase.PREFILL.value


class FamilyPrefixCache:
    """The suite's family prefix cache (module docstring)."""

    def __init__(self, workload: Workload, prefill_cost: int) -> None:
        self.workload = workload
        self.family_of = workload.family.tolist()
        self.index_of = {workload.request_id(r): r for r in range(workload.n)}
        self.cache = UnifiedRadixCache()
        self.materialized = np.zeros(max(len(workload.family_prefix), 1), dtype=bool)
        self.has_restore = np.zeros(workload.n, dtype=bool)  # by request index
        self.hits = 0
        self.prefill_cost = prefill_cost

    def prepare(self, live: Live, seq: Sequence) -> Sequence:
        r = self.index_of[seq.id]
        f = self.family_of[r]
        if f < 0 or not self.materialized[f]:
            return seq
        prompt = seq.prompt_tokens
        match = self.cache.peek_resident(NAMESPACE, prompt)
        if match is None or match.matched_tokens <= 0:
            return seq
        matched = min(match.matched_tokens, len(prompt))
        self.has_restore[r] = True
        self.hits += 1
        seq = seq.with_prefix_restore(PrefixRestore(f"family-{f}", matched,
                                                    PrefixRestoreKind.RESIDENT_KV))
        return seq.with_cache_affinity(CacheAffinity.from_stage(StageCacheAffinity(
            stage_index=0, matched_tokens=matched, prefill_cost_per_token=self.prefill_cost,
            restore_cost=0, cache_epoch=self.cache.epoch())))

    def start(self, live: Live) -> None:
        return None

    def prefill(self, rows: list[tuple[Live, int]], plan: Any, phases: bytes) -> None:
        # A first token means the prompt is in KV: its family prefix becomes resident.
        ids = plan.sequence_ids
        w = self.workload
        for i in plan.sample_rows.tolist():
            if phases[i] == _PHASE_PREFILL:
                f = self.family_of[self.index_of[ids[i]]]
                if f >= 0 and not self.materialized[f]:
                    self.materialized[f] = True
                    self.cache.insert_resident(NAMESPACE, w.family_prompt_prefix(f),
                                               int(w.family_prefix[f]), f"family-{f}")

    def release(self, live: Live) -> None:
        return None

    def preempted(self, live: Live) -> None:
        return None


class BlockPrefixCache:
    """The replay's bounded block prefix cache (module docstring)."""

    def __init__(self, scheduler: Any, capacity_tokens: Optional[int], prefill_cost: int) -> None:
        self.store = PrefixStore(capacity_tokens, backend=VirtualBackend())
        scheduler.attach_prefix_store(self.store, prefill_cost_per_token=prefill_cost)
        self.uncached_blocks = 0

    def prepare(self, live: Live, seq: Sequence) -> Sequence:
        request = live.request
        assert request is not None
        live.prompt = request.prompt_array()
        return seq

    def start(self, live: Live) -> None:
        """The restore the scheduler chose (it pins it), touched; the request's progress points
        at the restore's last full block."""
        live.done = 0
        live.progress = None
        if not live.restore:
            return
        store = self.store
        hit = store.match(live.prompt)
        if hit.entry is None or hit.matched_tokens < live.restore:
            raise RuntimeError(f"{live.id} was admitted with a restore of {live.restore} tokens "
                               "that is not resident")
        store.touch(hit.entry)
        done = blocks_for(live.n) if live.restore >= live.n else live.restore // BLOCK_TOKENS
        progress = store.find(live.prompt[:min(done * BLOCK_TOKENS, live.n)]) if done else None
        if done and progress is None:
            live.broken = True  # the restore is not block-aligned: cache nothing more of it
            done = 0
        live.done = done
        live.progress = progress
        if progress is not None:
            store.pin(progress)

    def prefill(self, rows: list[tuple[Live, int]], plan: Any, phases: bytes) -> None:
        offsets = plan.row_offsets
        positions = plan.positions
        for live, i in rows:
            self._advance(live, int(positions[offsets[i + 1] - 1]) + 1)

    def _advance(self, live: Live, fed_end: int) -> None:
        """Make the blocks of `live`'s prompt that are now fully computed resident."""
        if live.broken:
            return
        store = self.store
        n = live.n
        full = blocks_for(n) if fed_end >= n else fed_end // BLOCK_TOKENS
        prompt = live.prompt
        while live.done < full:
            k = live.done
            key = prompt[:min((k + 1) * BLOCK_TOKENS, n)]
            entry = store.find(key)
            if entry is None:
                entry = store.insert(key, parent=live.progress)
                if entry is None:
                    live.broken = True
                    self.uncached_blocks += full - k
                    return
            else:
                store.touch(entry)
            store.pin(entry)
            if live.progress is not None:
                store.unpin(live.progress)
            live.progress = entry
            live.done = k + 1

    def preempted(self, live: Live) -> None:
        return None  # the victim's prompt blocks stay resident; the rest of its KV goes

    def release(self, live: Live) -> None:
        if live.progress is not None:
            self.store.unpin(live.progress)
        live.progress = None
        live.done = 0
