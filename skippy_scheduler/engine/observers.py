"""What watches the engine's steps: the recorder, the event stream, a plan hook.

The engine keeps its observers in a list and calls each at three points of a step: when a plan
is made (`planned`), after it ran (`executed`, the plan still live), and once its samples are
known (`sampled`, rows whose request ended or was preempted meanwhile already left out) and it
is completed (`completed`). An engine with an empty list does plan + execute + complete and
nothing else: the lean path is the same code with nothing to call. `BaseObserver` does nothing at
every point: an observer subclasses it and overrides the points it uses. One more point is
optional (the engine calls it where an observer has it, as `BaseObserver` does):
`preempted(ids)`, when requests lose their KV to a preemption (at a plan's admission, under
memory pressure, or by `Engine.preempt`), before anything else happens to them.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Container, Optional, Protocol

from ..types import IterationTelemetry
from .record import Recorder
from .requests import TokenEvent, _InFlight

if TYPE_CHECKING:  # pragma: no cover
    from .contract import Plan


class StepObserver(Protocol):
    """Called by the engine at each point of a step (module docstring)."""

    #: True when `sampled` must be called (the engine then reads the output block).
    wants_samples: bool

    def planned(self, flight: _InFlight) -> None: ...
    def executed(self, flight: _InFlight, duration_us: float) -> None: ...
    def sampled(self, flight: _InFlight, rows: list[int], tokens: Any, end_us: float) -> None: ...
    def completed(self, flight: _InFlight, duration_us: float,
                  telemetry: IterationTelemetry) -> None: ...


class BaseObserver:
    """A `StepObserver` that does nothing at any point: subclass it and override the points
    you use (and set `wants_samples` when `sampled` is one of them)."""

    wants_samples = False

    def planned(self, flight: _InFlight) -> None:
        return None

    def executed(self, flight: _InFlight, duration_us: float) -> None:
        return None

    def sampled(self, flight: _InFlight, rows: list[int], tokens: Any, end_us: float) -> None:
        return None

    def completed(self, flight: _InFlight, duration_us: float,
                  telemetry: IterationTelemetry) -> None:
        return None

    def preempted(self, ids: list[str]) -> None:
        return None


class Recording(BaseObserver):
    """Writes the `Recorder`: who was scheduled when, every sample, every iteration."""

    wants_samples = True

    def __init__(self, recorder: Recorder, record_of: dict[str, int]) -> None:
        self.recorder = recorder
        self._record_of = record_of

    def planned(self, flight: _InFlight) -> None:
        record_of = self._record_of
        flight.owners = [record_of[i] for i in flight.plan.sequence_ids]
        self.recorder.scheduled(flight.owners, flight.start)

    def sampled(self, flight: _InFlight, rows: list[int], tokens: Any, end_us: float) -> None:
        owners = flight.owners
        self.recorder.sampled(end_us, [owners[r] for r in rows], tokens)

    def completed(self, flight: _InFlight, duration_us: float,
                  telemetry: IterationTelemetry) -> None:
        plan = flight.plan
        self.recorder.iteration(flight.start, duration_us, len(plan), flight.decode,
                                flight.token_count, plan.admitted, telemetry.waiting_sequences)


class TokenEvents(BaseObserver):
    """Emits a `TokenEvent` for every kept sample (not the end signal, a negative token, unless
    the host reported a detail with it). `details(plan)` is the host's `sample_details` (None:
    it reports none): asked once per plan, so a plan nobody asked details of costs one call."""

    wants_samples = True

    def __init__(self, emit: Callable[[TokenEvent], None],
                 details: Optional[Callable[["Plan"], Any]] = None,
                 live: Optional[Container[str]] = None) -> None:
        self._emit = emit
        self._details = details
        # The requests not ended (None: all are): a listener may end one (cancel it) while
        # this plan's tokens are being told, and nothing of it follows its FinishEvent.
        self._live = live

    def sampled(self, flight: _InFlight, rows: list[int], tokens: Any, end_us: float) -> None:
        ids = flight.plan.sequence_ids
        emit = self._emit
        live = self._live
        details = self._details(flight.plan) if self._details is not None else None
        if details:
            for r, t in zip(rows, tokens.tolist()):
                detail = details.get(r)
                if (t >= 0 or detail is not None) and (live is None or ids[r] in live):
                    emit(TokenEvent(ids[r], t, end_us, detail))
            return
        for r, t in zip(rows, tokens.tolist()):
            if t >= 0 and (live is None or ids[r] in live):
                emit(TokenEvent(ids[r], t, end_us))


PlanHook = Callable[["Plan", float, float], None]


class OnPlan(BaseObserver):
    """Calls `hook(plan, start_us, duration_us)` while the plan is live, after it ran."""

    def __init__(self, hook: PlanHook) -> None:
        self.hook = hook

    def executed(self, flight: _InFlight, duration_us: float) -> None:
        self.hook(flight.plan, flight.start, duration_us)


def replace_hook(observers: list[StepObserver], hook: Optional[PlanHook]) -> None:
    """Put `hook` in place of the list's `OnPlan` (first in the list: it runs before the others
    see the step's samples, as the plan is still live then); None removes it."""
    observers[:] = [o for o in observers if not isinstance(o, OnPlan)]
    if hook is not None:
        observers.insert(0, OnPlan(hook))
