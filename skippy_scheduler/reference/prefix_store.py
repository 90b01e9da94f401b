"""The reference prefix store (`PrefixStoreTwin`): behaviour.md §8c restated in Python.

The native store (`skippy_scheduler.PrefixStore`, csrc/sk_prefix.c) must make the same
decisions on every sequence of calls: the same entries, the same victims in the same order, the
same holder ids, the same epoch. Lookups go through `RadixTwin`, the brute-force radix.

The model:

* An **entry** is a token segment that follows its parent entry (or starts the prompt): its key
  is the parent's key plus the segment, and it costs `len(segment)` tokens of capacity. Shared
  prefixes are therefore stored and counted once, as in a paged KV cache with prefix sharing.
* **Capacity** is a number of tokens (the sum of the resident segments) and, optionally, a
  number of holder slots (resident entries). Neither is ever exceeded: an insert that cannot be
  made room for is refused.
* **Pins** are reference counts. A pinned entry is never evicted, and neither is any entry with
  a resident child (the child's key includes the parent's tokens), so pinning the deepest entry
  a request uses protects its whole prefix.
* **Eviction** removes the least recently used entry among those that are unpinned and have no
  resident children, until the new entry fits. Recency: `insert` and `touch` stamp the entry
  and all its ancestors with the store's clock; `match` and `find` are reads and stamp nothing
  (so ranking a long queue does not heat the cache).
"""
from __future__ import annotations

import heapq
from typing import Any, Callable, Optional

import numpy as np

from ..prefix_store import SegmentEntry, StoreBackend, StoreMatch, VirtualBackend, _tokens
from .radix import RadixTwin

__all__ = ["PrefixStoreTwin", "TwinEntry"]

_HOLDER_LIMIT = (1 << 32) - 2  # the largest holder id + 1 the native store can hand out


class TwinEntry(SegmentEntry):
    """One resident segment. Read-only for callers; `value` is theirs to use."""

    __slots__ = ("parent", "key", "start", "length", "children", "pins", "last_used", "serial",
                 "alive", "value", "holder", "owner")

    def __init__(self, parent: Optional["TwinEntry"], key: np.ndarray, serial: int,
                 value: Any) -> None:
        self.parent = parent
        self.key = key  # the full int32 key; read-only (possibly a view of the caller's array)
        self.start: int = parent.length if parent is not None else 0
        self.length: int = len(key)
        self.children = 0  # resident child entries
        self.pins = 0
        self.last_used = 0
        self.serial = serial
        self.alive = True
        self.value = value
        self.holder: Optional[int] = None
        self.owner: Optional[object] = None  # the store that made it

    def __repr__(self) -> str:
        state = "resident" if self.alive else "evicted"
        return (f"TwinEntry(length={self.length}, tokens={self.tokens}, pins={self.pins}, "
                f"children={self.children}, last_used={self.last_used}, {state}, "
                f"value={self.value!r})")


class PrefixStoreTwin:
    """Resident token prefixes under a capacity in tokens and in holder slots (§8c).

    capacity_tokens: tokens the resident segments may hold in total (None = unbounded).
    holder_slots: resident entries at most (None = unbounded); each resident entry then holds
        one holder id from [first_holder_id, first_holder_id + holder_slots).
    backend: told about every insert and eviction (default: a `VirtualBackend`).
    """

    def __init__(self, capacity_tokens: Optional[int] = None, holder_slots: Optional[int] = None,
                 backend: Optional[StoreBackend] = None, namespace: str = "prefix",
                 first_holder_id: int = 0) -> None:
        for name, value in (("capacity_tokens", capacity_tokens), ("holder_slots", holder_slots)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 0):
                raise ValueError(f"{name} must be None or an integer >= 0, got {value!r}")
        if isinstance(first_holder_id, bool) or not isinstance(first_holder_id, int) \
                or first_holder_id < 0:
            raise ValueError(f"first_holder_id must be an integer >= 0, got {first_holder_id!r}")
        # Holder ids are 32-bit in the native ABI, with 2**32 - 1 meaning "none".
        if holder_slots is not None and first_holder_id + holder_slots > _HOLDER_LIMIT:
            raise ValueError("first_holder_id + holder_slots must stay below 2**32 - 1")
        self.capacity_tokens = capacity_tokens
        self.holder_slots = holder_slots
        self.backend: StoreBackend = backend if backend is not None else VirtualBackend()
        self.namespace = namespace
        self._radix = RadixTwin()
        self.first_holder_id = first_holder_id
        # free holder offsets as a stack: the lowest first, a freed one reused first
        self._holders = list(range(holder_slots - 1, -1, -1)) if holder_slots else []
        self.epoch = 0  # bumped by every insert and eviction
        self._clock = 0
        self._serial = 0
        self._heap: list[tuple[int, int, TwinEntry]] = []  # (last_used, serial, entry), lazy
        self.used_tokens = 0
        self.entries = 0
        self.inserts = 0
        self.evictions = 0
        self.evicted_tokens = 0
        self.refused_inserts = 0  # inserts that could not be made room for
        self.owner: Optional[Callable[[], Any]] = None  # weakref to the attached TwinScheduler

    # -- reads --------------------------------------------------------------------------------

    def match(self, tokens: Any) -> StoreMatch:
        """Longest resident prefix of `tokens` (no recency change)."""
        key = _tokens(tokens)
        if not len(key):
            return StoreMatch()
        hit = self._radix.peek_resident(self.namespace, key)
        if hit is None:
            return StoreMatch()
        return StoreMatch(min(hit.matched_tokens, len(key)), hit.value)

    def find(self, key: Any) -> Optional[TwinEntry]:
        """The resident entry whose key is exactly `key`, or None (no recency change)."""
        key = _tokens(key)
        if not len(key):
            return None
        entry: Optional[TwinEntry] = self._radix.resident_exact(self.namespace, key)
        return entry

    @staticmethod
    def key_of(entry: TwinEntry) -> np.ndarray:
        """The full token key of `entry` (read-only)."""
        return entry.key

    def _own(self, entry: TwinEntry, what: str = "entry") -> None:
        """Refuse an entry of another store (as the native store does)."""
        if getattr(entry, "owner", None) is not self:
            raise ValueError(f"the {what} is not an entry of this PrefixStore")

    def evictable(self, entry: TwinEntry) -> bool:
        self._own(entry)
        return entry.alive and entry.pins == 0 and entry.children == 0

    def resident(self) -> list[TwinEntry]:
        """Every resident entry, oldest insert first (for inspection and tests: it reads the
        whole index)."""
        return sorted((hit.value for hit in self._radix.resident_entries()),
                      key=lambda e: e.serial)

    def lru_order(self) -> list[TwinEntry]:
        """Evictable entries, next victim first (for inspection and tests)."""
        live = {id(e): e for _, _, e in self._heap if self.evictable(e)}
        return sorted(live.values(), key=lambda e: (e.last_used, e.serial))

    @property
    def free_tokens(self) -> Optional[int]:
        return None if self.capacity_tokens is None else self.capacity_tokens - self.used_tokens

    # -- writes -------------------------------------------------------------------------------

    def insert(self, key: Any, parent: Optional[TwinEntry] = None,
               value: Any = None) -> Optional[TwinEntry]:
        """Make `key` resident as a segment after `parent` (whose key must be `key`'s prefix;
        None = the segment starts the prompt). Evicts what it must; returns the new entry, the
        existing one if `key` is already resident (touched), or None when no room can be made
        (nothing changes then)."""
        key = _tokens(key)
        if len(key) and int(key.min()) < 0:
            # (an int32 array skips _tokens' range check; a key is never negative)
            raise ValueError("tokens must be in [0, 2**31 - 1]")
        start = 0
        if parent is not None:
            self._own(parent, "parent")
            if not parent.alive:
                raise ValueError("the parent entry is not resident")
            start = parent.length
        if len(key) <= start:
            raise ValueError(f"key of {len(key)} tokens does not extend its parent "
                             f"({start} tokens)")
        if parent is not None and not np.array_equal(key[:start], parent.key):
            raise ValueError("the parent's key is not a prefix of the key")
        existing: Optional[TwinEntry] = self._radix.resident_exact(self.namespace, key)
        if existing is not None:
            self.touch(existing)
            return existing
        need = len(key) - start
        if not self._make_room(need, parent):
            self.refused_inserts += 1
            return None
        if key.flags.writeable:
            # The entry keeps its key; a read-only array (or a view of one) cannot change under
            # it and is kept as it is, anything else is copied.
            key = key.copy()
            key.setflags(write=False)
        self._serial += 1
        entry = TwinEntry(parent, key, self._serial, value)
        entry.owner = self
        self._radix.insert_resident(self.namespace, key, need, entry)
        if parent is not None:
            parent.children += 1
        self.used_tokens += need
        self.entries += 1
        self.inserts += 1
        self.epoch += 1
        if self.holder_slots is not None:
            entry.holder = self.first_holder_id + self._holders.pop()
        self.touch(entry)
        self.backend.inserted(entry)
        return entry

    def touch(self, entry: TwinEntry) -> None:
        """`entry` and its prefix are used now (most recently used)."""
        self._own(entry)
        if not entry.alive:
            raise ValueError("cannot touch an evicted entry")
        self._clock += 1
        e: Optional[TwinEntry] = entry
        while e is not None:
            e.last_used = self._clock
            e = e.parent
        if self.evictable(entry):
            self._push(entry)

    def pin(self, entry: TwinEntry) -> None:
        self._own(entry)
        if not entry.alive:
            raise ValueError("cannot pin an evicted entry")
        entry.pins += 1

    def unpin(self, entry: TwinEntry) -> None:
        self._own(entry)
        if entry.pins <= 0:
            raise ValueError("entry is not pinned")
        entry.pins -= 1
        if self.evictable(entry):
            self._push(entry)

    def evict_one(self) -> Optional[TwinEntry]:
        """Evict the least recently used evictable entry; None when nothing is evictable."""
        victim = self._pop_victim()
        if victim is not None:
            self._evict(victim)
        return victim

    # -- internals ----------------------------------------------------------------------------

    def _push(self, entry: TwinEntry) -> None:
        heapq.heappush(self._heap, (entry.last_used, entry.serial, entry))
        if len(self._heap) > 4 * self.entries + 1024:
            # Lazy deletion leaves stale items behind; rebuild from the evictable entries.
            live = {id(e): e for _, _, e in self._heap if self.evictable(e)}
            self._heap = [(e.last_used, e.serial, e) for e in live.values()]
            heapq.heapify(self._heap)

    def _pop_victim(self) -> Optional[TwinEntry]:
        heap = self._heap
        while heap:
            last_used, _, entry = heap[0]
            if self.evictable(entry) and entry.last_used == last_used:
                heapq.heappop(heap)
                return entry
            heapq.heappop(heap)  # stale: pinned, grew children, touched again or evicted
        return None

    def _fits(self, need: int) -> bool:
        if self.capacity_tokens is not None and self.used_tokens + need > self.capacity_tokens:
            return False
        return self.holder_slots is None or self.entries + 1 <= self.holder_slots

    def _make_room(self, need: int, parent: Optional[TwinEntry]) -> bool:
        if self.capacity_tokens is not None and need > self.capacity_tokens:
            return False
        if self.holder_slots is not None and self.holder_slots < 1:
            return False
        if self._fits(need):
            return True
        # Choose every victim first and evict only if they make enough room, so a refused
        # insert changes nothing. A chosen victim's parent may become a candidate in turn; the
        # new entry's own parent never is.
        heap = self._heap
        popped: list[tuple[int, int, TwinEntry]] = []  # valid candidates taken off the heap
        victims: list[TwinEntry] = []
        chosen: set[int] = set()
        gone_children: dict[int, int] = {}
        free_tokens = 0
        while True:
            over_tokens = (self.capacity_tokens is not None
                           and self.used_tokens - free_tokens + need > self.capacity_tokens)
            over_slots = (self.holder_slots is not None
                          and self.entries - len(victims) + 1 > self.holder_slots)
            if not (over_tokens or over_slots):
                break
            victim = None
            while heap:
                item = heapq.heappop(heap)
                last_used, _, e = item
                if (not e.alive or e.pins or e.last_used != last_used or id(e) in chosen
                        or e.children - gone_children.get(id(e), 0)):
                    continue  # stale
                popped.append(item)
                if e is parent:
                    continue
                victim = e
                break
            if victim is None:
                for item in popped:
                    heapq.heappush(heap, item)
                return False
            victims.append(victim)
            chosen.add(id(victim))
            free_tokens += victim.tokens
            up = victim.parent
            if up is not None:
                left = up.children - gone_children.get(id(up), 0) - 1
                gone_children[id(up)] = up.children - left
                if left == 0 and up.pins == 0:
                    heapq.heappush(heap, (up.last_used, up.serial, up))
        for victim in victims:
            self._evict(victim)
        return True

    def _evict(self, entry: TwinEntry) -> None:
        removed = self._radix.remove_resident(self.namespace, entry.key)
        if removed is not entry:
            raise RuntimeError("prefix store and radix index disagree about an entry")
        entry.alive = False
        parent = entry.parent
        if parent is not None:
            parent.children -= 1
            if self.evictable(parent):
                self._push(parent)
        self.used_tokens -= entry.tokens
        self.entries -= 1
        self.evictions += 1
        self.epoch += 1
        if entry.holder is not None:
            self._holders.append(entry.holder - self.first_holder_id)
        self.evicted_tokens += entry.tokens
        self.backend.evicted(entry)
