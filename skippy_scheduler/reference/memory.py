"""The reference scheduler's memory figures (behaviour.md §2.10).

Owns `MemoryLedger`: one used-bytes figure per configured component, as admissions reserve
and releases return them (or as a measured value replaces them, §2.8).
"""
from __future__ import annotations

from .._validate import sat, sat_sub
from ..types import MemoryComponent, Sequence


class MemoryLedger:
    """Bytes reserved per memory component, in config order."""

    def __init__(self, components: list[MemoryComponent]) -> None:
        self.components = list(components)
        self.used = [0] * len(self.components)

    def reservation(self, s: Sequence) -> list[int]:
        """What admitting `s` reserves in each component."""
        return [c.reservation_bytes(s.admission_tokens) for c in self.components]

    def fits(self, reservation: list[int]) -> bool:
        return all(sat(used + r) <= c.available_bytes()
                   for used, r, c in zip(self.used, reservation, self.components))

    def reserve(self, reservation: list[int]) -> None:
        self.used = [sat(u + r) for u, r in zip(self.used, reservation)]

    def release(self, s: Sequence) -> None:
        self.used = self.without(self.used, s)

    def without(self, used: list[int], s: Sequence) -> list[int]:
        """`used` after giving back what `s` holds."""
        return [sat_sub(u, r) for u, r in zip(used, self.reservation(s))]

    def over_budget(self, used: list[int]) -> bool:
        return any(u > c.available_bytes() for u, c in zip(used, self.components))

    def pairs(self) -> list[tuple[str, int]]:
        """(name, used bytes) per component."""
        return [(c.name, u) for c, u in zip(self.components, self.used)]

    def available_pairs(self) -> list[tuple[str, int]]:
        """(name, capacity - resident bytes) per component."""
        return [(c.name, c.available_bytes()) for c in self.components]
