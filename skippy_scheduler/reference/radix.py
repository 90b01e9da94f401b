"""Reference radix cache: `RadixTwin`, a flat dict of keys with brute-force matching.

Owns the pure-Python form of the unified token radix cache (behaviour.md §8). It states §8
directly (no tree), which makes it the oracle the native `UnifiedRadixCache` is tested against
and the baseline its benchmark compares with; it has the same method names and returns the same
`RadixMatch` / `RadixEntry` values (`stats()` gives a dict of the `RadixStats` fields). Topology
stats are derived from the key set: a compressed trie's nodes are its keys plus its branch
points, and its edge tokens are its distinct non-empty prefixes.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

from .._radix import RadixEntry, RadixMatch
from .._validate import U64_MAX

RESIDENT, RECURRENT = 0, 1
EMPTY_KEY_MESSAGE = "radix cache key must contain at least one token"


_Key = tuple[int, ...]


def _lcp(a: _Key, b: _Key) -> int:
    """Common prefix length by bisection over slice equality (C-speed comparisons)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class _Slot:
    __slots__ = ("value", "bytes", "last_used", "refs")

    def __init__(self, value: Any, nbytes: int, last_used: int) -> None:
        self.value, self.bytes, self.last_used, self.refs = value, nbytes, last_used, 0


class RadixTwin:
    def __init__(self) -> None:
        self.clock = 0
        self.splits = 0
        self.evictions = [0, 0]
        # namespace -> key -> [resident, recurrent]
        self.ns: dict[str, dict[_Key, list[_Slot | None]]] = {}

    # -- helpers -------------------------------------------------------------------------
    def _tick(self) -> None:
        self.clock = min(self.clock + 1, U64_MAX)

    def _slot(self, namespace: str, key: _Key, kind: int) -> _Slot | None:
        slots = self.ns.get(namespace, {}).get(key)
        return slots[kind] if slots else None

    def _is_node(self, keys: Iterable[_Key], p: _Key) -> bool:
        if p in keys:
            return True
        nexts = {k[len(p)] for k in keys if len(k) > len(p) and k[: len(p)] == p}
        return len(nexts) >= 2

    def _insert(self, namespace: str, tokens: Iterable[int], nbytes: int, value: Any, kind: int,
                if_vacant: bool) -> Any:
        key = tuple(tokens)
        if not key:
            raise ValueError(EMPTY_KEY_MESSAGE)
        old = self._slot(namespace, key, kind)
        if old is not None and if_vacant:
            return value
        if old is not None and kind == RESIDENT and old.refs > 0:
            raise ValueError("cannot replace an active resident radix entry")
        keys = self.ns.setdefault(namespace, {})
        if key not in keys:
            depth = max((_lcp(key, k) for k in keys), default=0)
            if depth > 0 and not self._is_node(keys, key[:depth]):
                self.splits += 1
            keys[key] = [None, None]
        self._tick()
        keys[key][kind] = _Slot(value, nbytes, self.clock)
        return old.value if old is not None else None

    def _match(self, namespace: str, tokens: Iterable[int], kind: int,
               mode: str) -> RadixMatch | None:
        if mode != "peek":
            self._tick()
        query = tuple(tokens)
        keys = self.ns.get(namespace, {})
        if kind == RESIDENT:
            stored = [k for k, s in keys.items() if s[RESIDENT] is not None]
            matched = max((_lcp(query, k) for k in stored), default=0)
            if matched == 0:
                return None
            source = min(k for k in stored if k[:matched] == query[:matched])
        else:
            lengths = [len(k) for k, s in keys.items() if s[RECURRENT] is not None
                       and query[: len(k)] == k]
            if not lengths:
                return None
            matched = max(lengths)
            source = query[:matched]
        slot = keys[source][kind]
        assert slot is not None  # `source` was picked among the keys holding this kind
        if mode != "peek":
            slot.last_used = self.clock
        if mode == "acquire":
            slot.refs = min(slot.refs + 1, (1 << 32) - 1)
        return RadixMatch(matched, len(source), slot.bytes, slot.refs, slot.value, source)

    def _remove(self, namespace: str, tokens: Iterable[int], kind: int) -> Any:
        key = tuple(tokens)
        slot = self._slot(namespace, key, kind)
        if slot is None:
            return None
        slots = self.ns[namespace][key]
        slots[kind] = None
        if slots[1 - kind] is None:
            del self.ns[namespace][key]
            if not self.ns[namespace]:
                del self.ns[namespace]
        return slot.value

    def _entries(self, kind: int) -> list[tuple[str, _Key, _Slot]]:
        out = []
        for namespace in sorted(self.ns, key=lambda s: s.encode()):
            for key in sorted(self.ns[namespace]):
                slot = self.ns[namespace][key][kind]
                if slot is not None:
                    out.append((namespace, key, slot))
        return out

    def _lru(self, kind: int, evict: bool) -> RadixEntry | None:
        free = [(s.last_used, ns.encode(), k, ns, s) for ns, k, s in self._entries(kind)
                if s.refs == 0]
        if not free:
            return None
        _, _, key, namespace, slot = min(free, key=lambda t: t[:3])
        if evict:
            self._remove(namespace, key, kind)
            self.evictions[kind] += 1
        return RadixEntry(namespace, key, slot.bytes, slot.last_used, slot.value)

    def _release(self, namespace: str, tokens: Iterable[int], kind: int) -> bool:
        slot = self._slot(namespace, tuple(tokens), kind)
        if slot is None or slot.refs == 0:
            return False
        slot.refs -= 1
        self._tick()
        slot.last_used = self.clock
        return True

    def _exact(self, namespace: str, tokens: Iterable[int], kind: int) -> Any:
        self._tick()
        slot = self._slot(namespace, tuple(tokens), kind)
        if slot is None:
            return None
        slot.last_used = self.clock
        return slot.value

    def _where(self, kind: int, predicate: Callable[[RadixEntry], bool]) -> int:
        chosen = [RadixEntry(ns, k, s.bytes, s.last_used, s.value)
                  for ns, k, s in self._entries(kind)]
        chosen = [e for e in chosen if predicate(e)]
        return sum(self._remove(e.namespace, e.tokens, kind) is not None for e in chosen)

    # -- public surface (same names as UnifiedRadixCache) ---------------------------------
    def insert_resident(self, namespace: str, tokens: Iterable[int], logical_bytes: int,
                        value: Any) -> Any:
        return self._insert(namespace, tokens, logical_bytes, value, RESIDENT, False)

    def insert_resident_if_vacant(self, namespace: str, tokens: Iterable[int], logical_bytes: int,
                                  value: Any) -> Any:
        return self._insert(namespace, tokens, logical_bytes, value, RESIDENT, True)

    def insert_recurrent(self, namespace: str, tokens: Iterable[int], logical_bytes: int,
                         value: Any) -> Any:
        return self._insert(namespace, tokens, logical_bytes, value, RECURRENT, False)

    def peek_resident(self, namespace: str, tokens: Iterable[int]) -> RadixMatch | None:
        return self._match(namespace, tokens, RESIDENT, "peek")

    def peek_recurrent(self, namespace: str, tokens: Iterable[int]) -> RadixMatch | None:
        return self._match(namespace, tokens, RECURRENT, "peek")

    def lookup_resident(self, namespace: str, tokens: Iterable[int]) -> RadixMatch | None:
        return self._match(namespace, tokens, RESIDENT, "lookup")

    def lookup_recurrent(self, namespace: str, tokens: Iterable[int]) -> RadixMatch | None:
        return self._match(namespace, tokens, RECURRENT, "lookup")

    def acquire_resident(self, namespace: str, tokens: Iterable[int]) -> RadixMatch | None:
        return self._match(namespace, tokens, RESIDENT, "acquire")

    def acquire_recurrent(self, namespace: str, tokens: Iterable[int]) -> RadixMatch | None:
        return self._match(namespace, tokens, RECURRENT, "acquire")

    def release_resident(self, namespace: str, tokens: Iterable[int]) -> bool:
        return self._release(namespace, tokens, RESIDENT)

    def release_recurrent(self, namespace: str, tokens: Iterable[int]) -> bool:
        return self._release(namespace, tokens, RECURRENT)

    def resident_exact(self, namespace: str, tokens: Iterable[int]) -> Any:
        return self._exact(namespace, tokens, RESIDENT)

    def recurrent_exact(self, namespace: str, tokens: Iterable[int]) -> Any:
        return self._exact(namespace, tokens, RECURRENT)

    def remove_resident(self, namespace: str, tokens: Iterable[int]) -> Any:
        return self._remove(namespace, tokens, RESIDENT)

    def remove_recurrent(self, namespace: str, tokens: Iterable[int]) -> Any:
        return self._remove(namespace, tokens, RECURRENT)

    def remove_resident_where(self, predicate: Callable[[RadixEntry], bool]) -> int:
        return self._where(RESIDENT, predicate)

    def remove_recurrent_where(self, predicate: Callable[[RadixEntry], bool]) -> int:
        return self._where(RECURRENT, predicate)

    def lru_resident_candidate(self) -> RadixEntry | None:
        return self._lru(RESIDENT, False)

    def lru_recurrent_candidate(self) -> RadixEntry | None:
        return self._lru(RECURRENT, False)

    def evict_lru_resident(self) -> RadixEntry | None:
        return self._lru(RESIDENT, True)

    def evict_lru_recurrent(self) -> RadixEntry | None:
        return self._lru(RECURRENT, True)

    def resident_entries(self) -> list[RadixEntry]:
        return [RadixEntry(ns, k, s.bytes, s.last_used, s.value)
                for ns, k, s in self._entries(RESIDENT)]

    def recurrent_entries(self) -> list[RadixEntry]:
        return [RadixEntry(ns, k, s.bytes, s.last_used, s.value)
                for ns, k, s in self._entries(RECURRENT)]

    def epoch(self) -> int:
        return self.clock

    def stats(self) -> dict[str, int]:
        out = dict(namespaces=len(self.ns), nodes=0, token_edges=0, splits=self.splits,
                   resident_entries=0, resident_tokens=0, resident_logical_bytes=0,
                   resident_active_refs=0, recurrent_entries=0, recurrent_logical_bytes=0,
                   recurrent_active_refs=0, resident_evictions=self.evictions[RESIDENT],
                   recurrent_evictions=self.evictions[RECURRENT])
        for keys in self.ns.values():
            prefixes = {k[:i] for k in keys for i in range(1, len(k) + 1)}
            out["token_edges"] += len(prefixes)
            out["nodes"] += sum(1 for p in prefixes if self._is_node(keys, p))
            for key, (res, rec) in keys.items():
                if res is not None:
                    out["resident_entries"] += 1
                    out["resident_tokens"] += len(key)
                    out["resident_logical_bytes"] += res.bytes
                    out["resident_active_refs"] += res.refs
                if rec is not None:
                    out["recurrent_entries"] += 1
                    out["recurrent_logical_bytes"] += rec.bytes
                    out["recurrent_active_refs"] += rec.refs
        # Sums saturate at u64 like the native cache's (§1.0).
        return {name: min(value, U64_MAX) for name, value in out.items()}
