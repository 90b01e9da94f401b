# Types of the compiled ranking module (_rank.pyx, behaviour.md §3).
from collections.abc import Iterable, Sequence
from typing import Any, Final, Protocol, TypeAlias

import numpy as np
import numpy.typing as npt
from typing_extensions import disjoint_base

from .cache_policy import CacheAffinity

MODE_CACHE_AWARE: Final = 0
MODE_FCFS: Final = 1
MODE_PRIORITY: Final = 2

# A prompt: ints in the int32 range, as a sequence or an integer array (int32 arrays are
# copied in one block, anything else item by item).
_Tokens: TypeAlias = Sequence[int] | npt.NDArray[np.integer[Any]]

class _Candidate(Protocol):
    # What packing reads from a candidate; `CacheAwareCandidate` has exactly this shape.
    @property
    def index(self) -> int: ...
    @property
    def priority(self) -> int: ...
    @property
    def affinity(self) -> CacheAffinity: ...
    @property
    def prompt_tokens(self) -> _Tokens: ...
    @property
    def enqueued_turn(self) -> int: ...
    @property
    def order(self) -> int: ...

@disjoint_base
class PackedCandidates:
    def __init__(self, candidates: Iterable[_Candidate]) -> None: ...
    def __len__(self) -> int: ...
    def order(
        self,
        current_turn: int,
        aging_cost_per_turn: int,
        group_waiting_prefixes: bool,
        mode: int = 0,
    ) -> list[int]: ...
    def positions(
        self,
        current_turn: int,
        aging_cost_per_turn: int,
        group_waiting_prefixes: bool,
        mode: int = 0,
    ) -> list[int]: ...
    def rank_only(
        self,
        current_turn: int,
        aging_cost_per_turn: int,
        group_waiting_prefixes: bool,
        mode: int = 0,
    ) -> None: ...

def order_candidates(
    candidates: Iterable[_Candidate],
    current_turn: int,
    aging_cost_per_turn: int,
    group_waiting_prefixes: bool,
    mode: int = 0,
) -> list[int]: ...

@disjoint_base
class RankSlots:
    def __init__(self) -> None: ...
    def __len__(self) -> int: ...
    def append(
        self, priority: int, saved_cost: int, enqueued_turn: int, order: int, prompt_tokens: _Tokens,
        ttft_deadline: float | None = None,
    ) -> None: ...
    def set_saved_cost(self, i: int, saved_cost: int) -> None: ...
    def pop(self) -> None: ...
    def reverse_to(self, positions: list[int]) -> None: ...
    def order(
        self,
        current_turn: int,
        aging_cost_per_turn: int,
        group_waiting_prefixes: bool,
        mode: int = 0,
    ) -> list[int]: ...

@disjoint_base
class RankSet:
    def __init__(self) -> None: ...
    def __len__(self) -> int: ...
    def add(
        self, priority: int, saved_cost: int, enqueued_turn: int, order: int, prompt_tokens: _Tokens,
        ttft_deadline: float | None = None,
    ) -> int: ...
    def remove(self, handle: int) -> None: ...
    def update(self, handle: int, priority: int, saved_cost: int, enqueued_turn: int) -> None: ...
    def order(
        self,
        current_turn: int,
        aging_cost_per_turn: int,
        group_waiting_prefixes: bool,
        mode: int = 0,
    ) -> list[int]: ...
    def rank_only(
        self,
        current_turn: int,
        aging_cost_per_turn: int,
        group_waiting_prefixes: bool,
        mode: int = 0,
    ) -> None: ...
