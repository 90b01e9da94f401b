"""Resident prefixes: finished sequences' KV kept in holder sequence ids for later requests.

With prefix reuse the context has `count` more sequence ids above the lanes, the *holders*.
`PrefixHolders` owns a `PrefixStore` whose holder ids are those (the engine attaches the store
to the scheduler, which then reads restores from it natively) and is the store's backend: the
store decides what is resident, this object moves the cells.

* `keep(lane, n)`: a sequence lets go of its lane; its first n positions are offered to the
  store as the prefix they stand for. When the store takes them, the new entry's holder gets
  the cells (`inserted`, with the source lane passed along as the entry's value).
* `keep_prompt(lane, n)`: the same for a lane that goes on running (a leader's computed prompt
  that waiting requests are held for, behaviour.md §2.3a).
* `restore(lane, holder, start)`: a new row starts at `start` from a holder's entry; the lane
  gets the holder's first `start` positions, so only the suffix is prefilled.
* `evicted`: the holder's cells are dropped.

**Replacement** (streams of their own, `replace_share` set): a released key that shares at
least `replace_share` of an unpinned resident holder's key (of several, the one it shares the
most tokens with: in practice the holder it restored from) supersedes that holder instead of
taking another one, as llama-server reuses a slot: the holder's entry is evicted and the new
key inserted in one `keep`. With
`match` tokens shared and the holder's key of `L` tokens, the holder's last `L - match`
positions are lost (none when its key is a prefix of the new one); a rule on the share of the
holder's key bounds that loss. Watchers hear the insert before the evictions of the same `keep`,
so blocks both keys hold are never withdrawn and announced again (docs/hosts.md).

Two layouts: by default every lane and holder has a KV stream of its own and a copy moves a
whole stream (trimmed to the prefix afterwards); with `shared_cells` (kv_unified) all share one
cache and a copy shares cells without moving them, but then every token's attention spans the
cells of all sequences. Positions never move (a restored prefix keeps its positions).

Other parts of a server (an event publisher) watch inserts and evictions through `watch`.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np
import numpy.typing as npt

from ...prefix_store import PrefixStore, StoreEntry
from .lanes import KvCells

# A shared part shorter than this is not worth a holder sequence of its own.
_MIN_SPLIT_TOKENS = 16

# A key sharing at least this share of a holder's key replaces it by default (llama-server's
# default --slot-prompt-similarity is the same half).
DEFAULT_REPLACE_SHARE = 0.5

Watcher = Callable[[str, StoreEntry], None]


def check_replace_share(share: Optional[float]) -> Optional[float]:
    """`share` when it is None (replacement off) or a number in (0, 1]; ValueError otherwise."""
    if share is None:
        return None
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1:
        raise ValueError(f"prefix_replace_share must be None or a number in (0, 1], got "
                         f"{share!r}")
    return float(share)


class PrefixHolders:
    """The holder sequence ids, the store that decides their contents, each lane's tokens."""

    def __init__(self, capacity_tokens: int, count: int, first_id: int, lanes: int, n_ctx: int,
                 cells: KvCells, shared_cells: bool,
                 replace_share: Optional[float] = DEFAULT_REPLACE_SHARE) -> None:
        self.count = count
        self.shared_cells = shared_cells
        self.replace_share = check_replace_share(replace_share)
        self.kept = 0  # prefixes made resident
        self.replaced = 0  # of those, how many superseded a holder they shared most of
        self.prompt_keeps = 0  # keeps of running lanes' prompts (keep_prompt)
        # Watcher calls of the `keep` under way (None: none is), told once it is done.
        self._pending: Optional[list[tuple[str, StoreEntry]]] = None
        self._cells = cells
        self._entry: dict[int, StoreEntry] = {}
        self._watchers: list[Watcher] = []
        # The tokens each lane's cells stand for (the key a release offers).
        self._tokens: npt.NDArray[np.int32] = np.zeros((lanes, n_ctx), dtype=np.int32)
        self.store = PrefixStore(capacity_tokens, count, backend=self, first_holder_id=first_id)

    def watch(self, watcher: Watcher) -> None:
        """Call `watcher("inserted" | "evicted", entry)` after every change of residency."""
        self._watchers.append(watcher)

    # -- a lane's tokens ----------------------------------------------------------------------

    def wrote(self, lanes: npt.NDArray[Any], positions: npt.NDArray[Any],
              tokens: npt.NDArray[Any]) -> None:
        """Entry i of a decoded batch put `tokens[i]` at `positions[i]` of `lanes[i]`."""
        self._tokens[lanes, positions] = tokens

    def lane_tokens(self, lane: int, n: int) -> npt.NDArray[np.int32]:
        """The tokens the lane's first `n` positions stand for."""
        return self._tokens[lane, :n]

    def length(self, holder: int) -> int:
        """Positions the holder's resident entry holds (0: none)."""
        entry = self._entry.get(holder)
        return 0 if entry is None or not entry.alive else entry.length

    # -- the verbs ----------------------------------------------------------------------------

    def keep(self, lane: int, n: int) -> bool:
        """Offer the lane's first `n` positions to the store as the prefix they stand for;
        whether they are resident now (taken, or there already)."""
        self._pending = []
        try:
            return self._keep(lane, n)
        finally:
            pending, self._pending = self._pending, None
            # Inserts first: a block the new key shares with an evicted one stays announced.
            pending.sort(key=lambda change: change[0] != "inserted")
            for kind, entry in pending:
                self._tell(kind, entry)

    def keep_prompt(self, lane: int, n: int) -> bool:
        """`keep` for a lane that goes on running: its first `n` positions (a computed prompt
        a waiting request is held for) become resident now instead of at its release; whether
        they are (`prompt_keeps` counts those)."""
        resident = self.keep(lane, n)
        if resident:
            self.prompt_keeps += 1
        return resident

    def _keep(self, lane: int, n: int) -> bool:
        store = self.store
        key = self._tokens[lane, :n].copy()
        hit = store.match(key)
        if hit.matched_tokens == n:
            if hit.entry is not None:
                store.touch(hit.entry)  # all of it is resident already
            return True
        matched = hit.matched_tokens
        parent = None
        replacing = self._supersedes(key)
        if replacing is not None:
            store.evict(replacing)
        elif self.shared_cells:
            # The parent is the deepest resident entry whose whole key is a prefix of this one:
            # its cells are shared, so the store counts them once. (With a stream per holder
            # every entry holds its whole key and is counted so, with no parent.)
            parent = hit.entry
            while parent is not None and parent.length > matched:
                parent = parent.parent
            if matched >= _MIN_SPLIT_TOKENS and (parent is None or parent.length < matched):
                # The shared part becomes an entry of its own (a branch point), so the store
                # counts the cells it shares with the other key once, as the KV cache holds them.
                split = store.insert(key[:matched], parent, value=lane)
                if split is not None:
                    parent = split
        if store.insert(key, parent, value=lane) is None:
            return False  # refused: no holder free of pins, or no room
        self.kept += 1
        if replacing is not None:
            self.replaced += 1
        return True

    def _supersedes(self, key: npt.NDArray[np.int32]) -> Optional[StoreEntry]:
        """The holder `key` replaces: of the evictable entries sharing at least `replace_share`
        of their key with it, the one sharing the most tokens (the least recently used on a
        tie); None."""
        share = self.replace_share
        store = self.store
        if share is None or self.shared_cells:
            return None
        cap = store.capacity_tokens
        if cap is not None and len(key) > cap:
            return None  # the new key would be refused: keep the old one
        best, best_shared = None, 0
        evictable = store.lru_order()  # unpinned, no resident child
        for entry in evictable:
            shared = _common_prefix(key, entry.key)
            if shared > best_shared and shared >= share * entry.length:
                best, best_shared = entry, shared
        # Only where the new key's insert will be taken: evicting first and then being
        # refused (the rest pinned, no room) would lose the old prefix for nothing. With a
        # stream per holder no entry has a parent, so every evictable entry can make room.
        if best is not None and cap is not None and \
                cap - store.used_tokens + sum(e.length for e in evictable) < len(key):
            return None
        return best

    def restore(self, lane: int, holder: int, start: int) -> npt.NDArray[np.int32]:
        """Give `lane` the holder's first `start` positions; returns the tokens they stand for.
        ValueError when the holder does not hold that many."""
        entry = self._entry.get(holder)
        if entry is None or not entry.alive or entry.length < start:
            raise ValueError(f"restore from holder {holder}: it holds "
                             f"{0 if entry is None else entry.length} positions, the row needs "
                             f"{start}")
        if self.shared_cells:
            self._cells.copy(holder, lane, 0, start)
        else:
            self._cells.copy(holder, lane)
            self._cells.remove(lane, start, -1)
        self._tokens[lane, :start] = entry.key[:start]
        return self._tokens[lane, :start]

    # -- the store's backend ------------------------------------------------------------------

    def inserted(self, entry: Any) -> None:
        # The new entry's holder gets its cells from the lane that offered them (the entry's
        # value). Shared cells: its parent's cells for the parent's positions (the store counts
        # those once, under the parent, so they must be the same cells even when the lane
        # computed its own copy), the lane's for the rest.
        holder, lane = entry.holder, entry.value
        cells = self._cells
        cells.remove(holder)
        if not self.shared_cells:
            # Streams of their own: the holder gets a copy of the lane's stream (llama.cpp copies
            # whole streams only; the data moves at the next decode), trimmed to the key.
            cells.copy(lane, holder)
            cells.remove(holder, entry.length, -1)
        else:
            start = 0
            if entry.parent is not None:
                start = entry.parent.length
                cells.copy(entry.parent.holder, holder, 0, start)
            cells.copy(lane, holder, start, entry.length)
        self._entry[holder] = entry
        self._changed("inserted", entry)

    def evicted(self, entry: Any) -> None:
        self._entry.pop(entry.holder, None)
        self._cells.remove(entry.holder)
        self._changed("evicted", entry)

    def _changed(self, kind: str, entry: StoreEntry) -> None:
        if self._pending is not None:
            self._pending.append((kind, entry))
        else:
            self._tell(kind, entry)

    def _tell(self, kind: str, entry: StoreEntry) -> None:
        for watcher in self._watchers:
            watcher(kind, entry)


def _common_prefix(a: npt.NDArray[np.int32], b: npt.NDArray[np.int32]) -> int:
    """Leading tokens `a` and `b` share."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n
