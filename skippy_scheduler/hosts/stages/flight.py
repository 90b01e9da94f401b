"""A plan in the stage chain, as the driver remembers it until its answer (host.py).

`Flight` keeps what undoing the plan needs: its rows' lanes (and each lane's owner generation
when sent, so that a lane released and reused since is left alone), where each row started,
which rows were new or took a lane, the lanes its release table freed and the positions each
lane held before. `FlightHandle` is what `StageHost.execute_async` returns to the engine.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:  # pragma: no cover
    from .host import StageHost


def check_int(name: str, value: object, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {value!r}")
    return value


def plan_arrays(plan: Any, n_batch: int,
                n_vocab: int) -> tuple[npt.NDArray[Any], npt.NDArray[Any], npt.NDArray[Any]]:
    """The plan's row offsets, tokens and positions, checked against the stages' limits."""
    offsets = np.asarray(plan.row_offsets, dtype=np.int64)
    n = int(offsets[-1])
    tokens = np.asarray(plan.tokens)[:n]
    positions = np.asarray(plan.positions)[:n]
    if n > n_batch:
        raise ValueError(f"a plan of {n} tokens does not fit the stages' batch of "
                         f"{n_batch} (keep max_tokens_per_iteration <= n_batch)")
    if len(tokens) != n or len(positions) != n:
        raise ValueError(f"the plan's rows end at {n} but it has {len(tokens)} tokens and "
                         f"{len(positions)} positions")
    if n and (int(tokens.min()) < 0 or int(tokens.max()) >= n_vocab):
        raise ValueError(f"plan tokens must be in [0, {n_vocab}) for this model (a deferred "
                         "input left unresolved?)")
    return offsets, tokens, positions


class Flight:
    """One plan sent down the chain and not yet answered (see the module docstring)."""

    __slots__ = ("plan", "step", "ids", "lanes", "lane_set", "gens", "starts", "new", "fresh",
                 "released", "prev_pos", "sample_rows", "state", "count", "error")

    def __init__(self, plan: Any, step: int, ids: list[str], lanes: npt.NDArray[np.int32],
                 gens: list[int], starts: list[int], new: list[int], fresh: list[int],
                 released: list[int], prev_pos: list[int],
                 sample_rows: npt.NDArray[np.int64]) -> None:
        self.plan = plan
        self.step = step
        self.ids = ids
        self.lanes = lanes
        self.lane_set = set(lanes.tolist())
        self.gens = gens
        self.starts = starts
        self.new = new
        self.fresh = fresh
        self.released = released
        self.prev_pos = prev_pos
        self.sample_rows = sample_rows
        self.state = "sent"  # then "done" (count outputs) or "failed" (error)
        self.count = 0
        self.error: Optional[BaseException] = None

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
