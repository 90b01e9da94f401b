"""A bounded prefix cache: which token prefixes are resident, which are pinned, what is evicted.

`PrefixStore` is the Python face of the native store (csrc/sk_prefix.c, behaviour.md §8c). It
decides residency; a backend is told what became resident and what was evicted (the lab's
`VirtualBackend` holds nothing; the llama.cpp host copies KV into the entry's holder sequence on
`inserted` and removes it on `evicted`). A scheduler reads restores from it natively once it is
attached (`Scheduler.attach_prefix_store`, §2.12).

The model:

* An **entry** is a token segment that follows its parent entry (or starts the prompt): its key
  is the parent's key plus the segment, and it costs `len(segment)` tokens of capacity. Shared
  prefixes are therefore stored and counted once, as in a paged KV cache with prefix sharing.
* **Capacity** is a number of tokens (the sum of the resident segments) and, optionally, a
  number of holder slots (resident entries; each entry then holds one holder id from
  `[first_holder_id, first_holder_id + holder_slots)`). Neither is ever exceeded: an insert
  that cannot be made room for is refused.
* **Pins** are reference counts. A pinned entry is never evicted, and neither is any entry with
  a resident child (the child's key includes the parent's tokens), so pinning the deepest entry
  a request uses protects its whole prefix.
* **Eviction** removes the least recently used entry among those that are unpinned and have no
  resident children, until the new entry fits. Recency: `insert` and `touch` stamp the entry
  and all its ancestors with the store's clock; `match` and `find` are reads and stamp nothing
  (so ranking a long queue does not heat the cache).
* The **epoch** changes with every insert and eviction, never with a read.

`skippy_scheduler.reference.PrefixStoreTwin` is the reference implementation; the two agree on
every sequence of calls (tests/lab/test_prefix_store.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

import numpy as np

from ._core import NativePrefixStore
from ._sequence import PrefixRestore
from .cache_policy import CacheAffinity, StageCacheAffinity

__all__ = ["PrefixStore", "StoreBackend", "StoreEntry", "StoreMatch", "VirtualBackend",
           "store_affinity"]

# page_id of the PrefixRestore a scheduler with an attached store reports
STORE_PAGE = "prefix-store"


def store_affinity(matched: int, prefill_cost_per_token: int, restore_cost_per_token: int,
                   epoch: int) -> tuple[Optional[PrefixRestore], CacheAffinity]:
    """The prefix restore and cache affinity a sequence carries when an attached store matches
    `matched` of its prompt tokens (§2.12): nothing on a miss."""
    if matched <= 0:
        return None, CacheAffinity()
    stage = StageCacheAffinity(0, matched, prefill_cost_per_token,
                               min(matched * restore_cost_per_token, (1 << 64) - 1), epoch)
    return PrefixRestore(STORE_PAGE, matched), CacheAffinity.from_stage(stage)


class SegmentEntry:
    """What every store entry says of its segment: its full key and where its own part starts
    (the native entry and the twin's share these views)."""

    __slots__ = ()
    key: np.ndarray
    start: int
    length: int

    @property
    def tokens(self) -> int:
        """Capacity this entry takes: the tokens of its own segment."""
        return self.length - self.start

    @property
    def segment(self) -> np.ndarray:
        """The tokens this entry adds after its parent."""
        return self.key[self.start:]


class StoreEntry(SegmentEntry):
    """One resident segment. Read-only for callers; `value` is theirs to use."""

    __slots__ = ("_native", "id", "parent", "key", "start", "length", "serial", "holder",
                 "alive", "value")

    def __init__(self, native: NativePrefixStore, entry_id: int, parent: Optional["StoreEntry"],
                 key: np.ndarray, serial: int, holder: Optional[int], value: Any) -> None:
        self._native = native
        self.id = entry_id
        self.parent = parent
        self.key = key  # the full int32 key; read-only (possibly a view of the caller's array)
        self.start: int = parent.length if parent is not None else 0
        self.length: int = len(key)
        self.serial = serial
        self.holder = holder
        self.alive = True
        self.value = value

    def _info(self) -> tuple[int, ...]:
        info = self._native.entry(self.id) if self.alive else None
        return info if info is not None else (-1, -1, 0, 0, 0, 0, 0, 0, 0)

    @property
    def pins(self) -> int:
        return int(self._info()[4])

    @property
    def children(self) -> int:
        """Resident child entries."""
        return int(self._info()[5])

    @property
    def last_used(self) -> int:
        return int(self._info()[6])

    def __repr__(self) -> str:
        state = "resident" if self.alive else "evicted"
        return (f"StoreEntry(length={self.length}, tokens={self.tokens}, holder={self.holder}, "
                f"pins={self.pins}, children={self.children}, {state}, value={self.value!r})")


@dataclass(frozen=True)
class StoreMatch:
    """A lookup: `matched_tokens` of the query are resident; pinning `entry` keeps them so."""

    matched_tokens: int = 0
    entry: Optional[Any] = None


class StoreBackend(Protocol):
    """What holds the KV of resident entries; told after the store has decided."""

    def inserted(self, entry: Any) -> None:
        """`entry` became resident."""

    def evicted(self, entry: Any) -> None:
        """`entry` was evicted (its parent, if any, is still resident)."""


class VirtualBackend:
    """A backend that holds nothing (the lab's model); optional callbacks observe the events."""

    def __init__(self, on_insert: Optional[Callable[[Any], None]] = None,
                 on_evict: Optional[Callable[[Any], None]] = None) -> None:
        self.on_insert = on_insert
        self.on_evict = on_evict

    def inserted(self, entry: Any) -> None:
        if self.on_insert is not None:
            self.on_insert(entry)

    def evicted(self, entry: Any) -> None:
        if self.on_evict is not None:
            self.on_evict(entry)


def _tokens(key: Any) -> np.ndarray:
    """`key` as a one-dimensional int32 array (not copied when it already is one)."""
    arr = np.asarray(key)
    if arr.ndim != 1:
        raise ValueError("a key must be a one-dimensional sequence of tokens")
    if arr.dtype != np.int32:
        if len(arr) and not np.issubdtype(arr.dtype, np.integer):
            raise TypeError(f"tokens must be integers, got {arr.dtype}")
        if len(arr) and (arr.min() < 0 or arr.max() > np.iinfo(np.int32).max):
            raise ValueError("tokens must be in [0, 2**31 - 1]")
        arr = arr.astype(np.int32)
    return np.ascontiguousarray(arr)


def _check_limit(name: str, value: Optional[int]) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ValueError(f"{name} must be None or an integer >= 0, got {value!r}")


class PrefixStore:
    """Resident token prefixes under a capacity in tokens and in holder slots (module docs).

    capacity_tokens: tokens the resident segments may hold in total (None = unbounded).
    holder_slots: resident entries at most (None = unbounded, and entries hold no holder id).
    backend: told about every insert and eviction (default: a `VirtualBackend`).
    first_holder_id: the first holder id handed out (a llama.cpp host passes its first reserved
        sequence id).
    """

    def __init__(self, capacity_tokens: Optional[int] = None, holder_slots: Optional[int] = None,
                 backend: Optional[StoreBackend] = None, namespace: str = "prefix",
                 first_holder_id: int = 0) -> None:
        _check_limit("capacity_tokens", capacity_tokens)
        _check_limit("holder_slots", holder_slots)
        if isinstance(first_holder_id, bool) or not isinstance(first_holder_id, int) \
                or first_holder_id < 0:
            raise ValueError(f"first_holder_id must be an integer >= 0, got {first_holder_id!r}")
        self.capacity_tokens = capacity_tokens
        self.holder_slots = holder_slots
        self.first_holder_id = first_holder_id
        self.backend: StoreBackend = backend if backend is not None else VirtualBackend()
        self.namespace = namespace
        self._native = NativePrefixStore(capacity_tokens, holder_slots, first_holder_id)
        self._objects: dict[int, StoreEntry] = {}
        # The twin scheduler this store serves (a weak reference, set by its attach); the
        # native scheduler keeps that in the C core.
        self.owner: Optional[Callable[[], Any]] = None

    @property
    def native_store(self) -> NativePrefixStore:
        """The C store behind this one (what a native scheduler attaches)."""
        return self._native

    # -- counters -----------------------------------------------------------------------------

    @property
    def used_tokens(self) -> int:
        return int(self._native.stats()[0])

    @property
    def entries(self) -> int:
        return int(self._native.stats()[1])

    @property
    def inserts(self) -> int:
        return int(self._native.stats()[2])

    @property
    def evictions(self) -> int:
        return int(self._native.stats()[3])

    @property
    def evicted_tokens(self) -> int:
        return int(self._native.stats()[4])

    @property
    def refused_inserts(self) -> int:
        """Inserts that could not be made room for."""
        return int(self._native.stats()[5])

    @property
    def epoch(self) -> int:
        """Changes with every insert and eviction (never with a read)."""
        return int(self._native.stats()[6])

    @property
    def free_tokens(self) -> Optional[int]:
        return None if self.capacity_tokens is None else self.capacity_tokens - self.used_tokens

    @property
    def native(self) -> int:
        """Address of the underlying `skippy_prefix_store *` (for native hosts)."""
        return int(self._native.native)

    # -- reads --------------------------------------------------------------------------------

    def match(self, tokens: Any) -> StoreMatch:
        """Longest resident prefix of `tokens` (no recency change)."""
        key = _tokens(tokens)
        entry, matched = self._native.match(key)
        if entry < 0:
            return StoreMatch()
        return StoreMatch(int(matched), self._objects[entry])

    def find(self, key: Any) -> Optional[StoreEntry]:
        """The resident entry whose key is exactly `key`, or None (no recency change)."""
        entry = self._native.find(_tokens(key))
        return None if entry < 0 else self._objects[entry]

    @staticmethod
    def key_of(entry: StoreEntry) -> np.ndarray:
        """The full token key of `entry` (read-only)."""
        return entry.key

    def _own(self, entry: StoreEntry, what: str = "entry") -> None:
        """Refuse an entry of another store (its id would name one of this store's)."""
        if getattr(entry, "_native", None) is not self._native:
            raise ValueError(f"the {what} is not an entry of this PrefixStore")

    def evictable(self, entry: StoreEntry) -> bool:
        self._own(entry)
        return entry.alive and entry.pins == 0 and entry.children == 0

    def resident(self) -> list[StoreEntry]:
        """Every resident entry, oldest insert first."""
        return sorted(self._objects.values(), key=lambda e: e.serial)

    def lru_order(self) -> list[StoreEntry]:
        """Evictable entries, next victim first (for inspection and tests)."""
        return [self._objects[i] for i in self._native.lru_order()]

    # -- writes -------------------------------------------------------------------------------

    def insert(self, key: Any, parent: Optional[StoreEntry] = None,
               value: Any = None) -> Optional[StoreEntry]:
        """Make `key` resident as a segment after `parent` (whose key must be `key`'s prefix;
        None = the segment starts the prompt). Evicts what it must; returns the new entry, the
        existing one if `key` is already resident (touched), or None when no room can be made
        (nothing changes then)."""
        key = _tokens(key)
        if parent is not None:
            self._own(parent, "parent")
        if parent is not None and not parent.alive:
            raise ValueError("the parent entry is not resident")
        try:
            entry_id = self._native.insert(key, -1 if parent is None else parent.id)
        except ValueError:
            raise  # refused before anything changed: the evictions listed are an earlier insert's
        except BaseException:
            self._drain_evictions()  # out of memory part way: what it evicted so far
            raise
        self._drain_evictions()
        if entry_id < 0:
            return None
        existing = self._objects.get(entry_id)
        if existing is not None:
            return existing
        if key.flags.writeable:
            # The entry keeps its key; a read-only array (or a view of one) cannot change under
            # it and is kept as it is, anything else is copied.
            key = key.copy()
            key.setflags(write=False)
        info = self._native.entry(entry_id)
        assert info is not None  # (just inserted)
        entry = StoreEntry(self._native, entry_id, parent, key, int(info[7]),
                           None if info[1] < 0 else int(info[1]), value)
        self._objects[entry_id] = entry
        self.backend.inserted(entry)
        return entry

    def touch(self, entry: StoreEntry) -> None:
        """`entry` and its prefix are used now (most recently used)."""
        self._own(entry)
        if not entry.alive:
            raise ValueError("cannot touch an evicted entry")
        self._native.touch(entry.id)

    def pin(self, entry: StoreEntry) -> None:
        self._own(entry)
        if not entry.alive:
            raise ValueError("cannot pin an evicted entry")
        self._native.pin(entry.id)

    def unpin(self, entry: StoreEntry) -> None:
        self._own(entry)
        if not entry.alive or entry.pins <= 0:
            raise ValueError("entry is not pinned")
        self._native.unpin(entry.id)

    def evict_one(self) -> Optional[StoreEntry]:
        """Evict the least recently used evictable entry; None when nothing is evictable."""
        victim = self._native.evict_one()
        gone = self._drain_evictions()
        return gone[0] if victim >= 0 and gone else None

    def evict(self, entry: StoreEntry) -> bool:
        """Evict exactly `entry` (a holder superseded by a new key, hosts/llama/holders.py);
        False, and nothing changes, when it is not evictable (evicted already, pinned, or with
        a resident child). The native store evicts only its least recently used entry, so every
        other evictable entry is pinned for the length of the call: pins change no recency and
        no epoch, and the eviction counts and journals as any other."""
        if not self.evictable(entry):
            return False
        others = [e for e in self.lru_order() if e is not entry]
        for other in others:
            self._native.pin(other.id)
        try:
            gone = self.evict_one()
        finally:
            for other in others:
                self._native.unpin(other.id)
        if gone is not entry:  # (it was the only evictable entry)
            raise RuntimeError(f"evicting entry {entry.id} evicted "
                               f"{'nothing' if gone is None else gone.id}")
        return True

    def entry_by_id(self, entry_id: int) -> Optional[StoreEntry]:
        """The resident entry with this native id (as `Scheduler.sequence` reports it)."""
        return self._objects.get(entry_id)

    def _drain_evictions(self) -> list[StoreEntry]:
        gone = []
        for entry_id, _holder, _handle, _start, _length in self._native.evicted():
            entry = self._objects.pop(entry_id)
            entry.alive = False
            gone.append(entry)
        for entry in gone:
            self.backend.evicted(entry)
        return gone
