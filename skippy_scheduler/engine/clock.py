"""The engine's one notion of time, in microseconds since the run started.

* `WallClock`: elapsed real time; an iteration lasts as long as the host took; idle gaps are
  slept through (a submission from another thread wakes the sleep).
* `VirtualClock`: time moves only when the engine says so; an iteration lasts what the cost
  model charges for the plan (or, without a cost model, what the host measurably took); idle
  gaps jump to the next arrival. Two runs of the same inputs see identical times.
* `CpuClock`: the process's CPU time; an iteration lasts the CPU time spent running it, which
  load from other processes does not inflate; idle gaps jump to the next arrival.

Values stay whatever type the cost model yields (integer constants give integer times), so the
lab's traces print exact microseconds.
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Optional, Protocol, Union, runtime_checkable

from ..cost_model import StepCost, check_clock_cost


@runtime_checkable
class Clock(Protocol):
    def start(self) -> None:
        """Set time 0 (called when a run starts)."""

    def now(self) -> float:
        """Microseconds since `start`."""

    def charge(self, prompt_tokens: int, decode_rows: int, measured_us: float) -> float:
        """Account one iteration that the host took `measured_us` to run; returns its duration
        in µs (the time `now` has moved on by)."""

    def wait_until(self, t_us: float, wake: Optional[threading.Event] = None) -> None:
        """Let time pass until `t_us` (or until `wake` is set)."""


class WallClock:
    """Real elapsed time (`time.perf_counter`)."""

    def __init__(self) -> None:
        self._t0 = time.perf_counter()

    def start(self) -> None:
        self._t0 = time.perf_counter()

    def now(self) -> float:
        return (time.perf_counter() - self._t0) * 1e6

    def charge(self, prompt_tokens: int, decode_rows: int, measured_us: float) -> float:
        return measured_us

    def wait_until(self, t_us: float, wake: Optional[threading.Event] = None) -> None:
        delay = (t_us - self.now()) / 1e6
        if delay <= 0:
            return
        if wake is None:
            time.sleep(delay)
        else:
            wake.wait(delay)


class VirtualClock:
    """Deterministic time charged by `cost` (a `StepCost` of the lab's four terms: see
    `check_clock_cost`), starting at 0."""

    def __init__(self, cost: Optional[StepCost] = None) -> None:
        self.cost = None if cost is None else check_clock_cost("cost", cost)
        self._now: float = 0

    def start(self) -> None:
        self._now = 0

    def now(self) -> float:
        return self._now

    def charge(self, prompt_tokens: int, decode_rows: int, measured_us: float) -> float:
        if self.cost is None:
            duration = measured_us
        else:
            duration = self.cost.duration_us(prompt_tokens, decode_rows)
        self._now += duration
        return duration

    def wait_until(self, t_us: float, wake: Optional[threading.Event] = None) -> None:
        if t_us > self._now:
            self._now = t_us


class CpuClock:
    """CPU time of this process (`time.process_time_ns`), starting at 0.

    An iteration is charged the CPU time spent since the clock was last read: the engine reads
    `now()` just before it executes a plan and charges just after, so that is the plan's cost
    (the host's `measured_us`, elapsed time, is not used). A machine busy with other processes
    stretches elapsed time but not this one, which is why calibration can use it. Every thread
    of the process counts: with several compute threads an iteration is charged their sum,
    spinning included, which is more than it lasted. Waiting for an arrival uses no CPU, so
    `wait_until` skips to it as the virtual clock does.
    """

    def __init__(self) -> None:
        self.start()

    def start(self) -> None:
        self._t0 = self._mark = time.process_time_ns()
        self._skipped_us: float = 0

    def now(self) -> float:
        self._mark = time.process_time_ns()
        return (self._mark - self._t0) / 1e3 + self._skipped_us

    def charge(self, prompt_tokens: int, decode_rows: int, measured_us: float) -> float:
        return (time.process_time_ns() - self._mark) / 1e3

    def wait_until(self, t_us: float, wake: Optional[threading.Event] = None) -> None:
        now = self.now()
        if t_us > now:
            self._skipped_us += t_us - now


ClockArg = Union[Clock, str, None]

#: The clocks a name asks for: a fresh one each time.
NAMED_CLOCKS: dict[str, Callable[[], Clock]] = {
    "wall": WallClock, "virtual": VirtualClock, "cpu": CpuClock}
#: The names an engine takes (`Engine(clock=...)`).
ENGINE_CLOCKS = ("wall", "virtual")


def make_clock(clock: ClockArg, names: tuple[str, ...] = ENGINE_CLOCKS) -> Optional[Clock]:
    """The clock `clock` asks for: None (no clock), a `Clock` as it is, or a fresh clock of
    one of `names` (a virtual one without a cost model)."""
    if clock is None:
        return None
    if isinstance(clock, str):
        if clock in names:
            return NAMED_CLOCKS[clock]()
        raise ValueError(f"clock must be {', '.join(map(repr, names))}, a Clock or None, "
                         f"got {clock!r}")
    if not isinstance(clock, Clock):
        raise TypeError(f"clock needs start(), now(), charge() and wait_until(): "
                        f"{type(clock).__name__}")
    return clock
