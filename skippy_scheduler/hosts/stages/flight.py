"""A plan in the stage chain, as the driver remembers it until its answer (host.py).

`Flight` keeps what undoing the plan needs: its rows' lanes (and each lane's owner generation
when sent, so that a lane released and reused since is left alone), where each row started,
which rows were new (each took a lane), the lanes its release table freed and the positions
each lane held before. `FlightHandle` is what `StageHost.execute_async` returns to the engine.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:  # pragma: no cover
    from .host import StageHost


@dataclass(eq=False, slots=True)
class Flight:
    """One plan sent down the chain and not yet answered (see the module docstring)."""

    plan: Any
    step: int
    ids: list[str]
    lanes: npt.NDArray[np.int32]
    gens: list[int]  # each lane's generation when sent
    starts: list[int]
    new: list[int]  # the new rows (each took a lane)
    released: list[int]
    prev_pos: list[int]
    sample_rows: npt.NDArray[np.int64]
    lane_set: set[int] = field(init=False)
    state: str = "sent"  # then "done" (count outputs) or "failed" (error)
    count: int = 0
    error: Optional[BaseException] = None

    def __post_init__(self) -> None:
        self.lane_set = set(self.lanes.tolist())

    def finish(self, count: int) -> None:
        self.state = "done"
        self.count = count

    def fail(self, error: BaseException) -> None:
        self.state = "failed"
        self.error = error


class FlightHandle:
    """`result()`: wait for the plan's answer, fill its outputs, return their count (or raise
    what made it fail)."""

    __slots__ = ("_host", "_flight", "_plan")

    def __init__(self, host: "StageHost", flight: Optional[Flight], plan: Any) -> None:
        self._host = host
        self._flight = flight
        self._plan = plan

    def result(self) -> int:
        if self._flight is None:  # nothing was sent (an empty plan, or the chain is broken)
            self._plan.outputs.count = 0
            return 0
        return self._host._resolve(self._flight)
