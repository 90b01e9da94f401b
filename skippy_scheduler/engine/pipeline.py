"""The engine's steps when plans are in flight (max_inflight_plans > 1, docs/behaviour.md §2.11).

One device runs plans one after another. While plan N executes, the engine makes plan N+1 and
completes plan N-1; N+1 starts once N has finished (its deferred inputs are N's samples). A host
releases state only while no plan of it executes, so releases that come up meanwhile wait until
the running plan is done. A failed execution aborts its plan and every later one.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from ..inflight import resolve_deferred
from .requests import EngineStalled, _InFlight

if TYPE_CHECKING:  # pragma: no cover
    from collections import deque


class _Pipeline:
    """Mixed into `Engine`: the depth > 1 step and the release queue it needs."""

    _inflight: "deque[_InFlight]"
    _pending_release: list[str]
    _depth: int
    _outstanding: int
    _empty_plan: Any
    _execute_async: Any
    scheduler: Any
    host: Any

    if TYPE_CHECKING:  # provided by Engine
        def _make_flight(self) -> "_InFlight | None": ...
        def _finish(self, flight: _InFlight) -> None: ...
        def now(self) -> float: ...

    def _step_pipelined(self) -> bool:
        inflight = self._inflight
        if self._outstanding and len(inflight) < self._depth:
            flight = self._make_flight()
            if flight is not None:
                self._launch(flight)
                return True
            # Nothing to run until what is in flight lands (e.g. every sequence's samples are
            # in flight): give the empty plan back and complete instead.
            self.scheduler.abort_iteration(self._empty_plan)
            self._empty_plan = None
            if not inflight:
                raise EngineStalled(
                    f"the scheduler made an empty plan with {self._outstanding} requests "
                    f"waiting or running and nothing in flight at {self.now()} µs")
        if not inflight:
            return False
        flight = inflight[0]
        try:
            self._wait_executed(flight)
        except BaseException:
            self._failed_from(0)
            raise
        inflight.popleft()
        self._apply_releases()
        self._finish(flight)
        return True

    def _launch(self, flight: "_InFlight") -> None:
        inflight = self._inflight
        if inflight:
            try:
                self._wait_executed(inflight[-1])  # the device is free, its samples are known
            except BaseException:
                self._failed_from(len(inflight) - 1)  # the new plan is later: undone too
                raise
        self._apply_releases()
        if flight.plan.deferred_rows.size:
            resolve_deferred(flight.plan, [f.plan for f in inflight])
        run_async = self._execute_async
        flight.t0 = time.perf_counter_ns()
        try:
            if run_async is not None:
                flight.handle = run_async(flight.plan)
            else:
                self.host.execute(flight.plan)
                flight.measured_us = (time.perf_counter_ns() - flight.t0) / 1e3
        except BaseException:
            self.scheduler.abort_iteration(flight.plan)
            raise
        inflight.append(flight)

    def _failed_from(self, nth: int) -> None:
        """The runtime could not run the nth plan in flight: it and every later plan are
        undone (executions still running are waited for first, so the device is idle)."""
        inflight = self._inflight
        for later in list(inflight)[nth + 1:]:
            try:
                self._wait_executed(later)
            except BaseException:
                pass
        self.scheduler.abort_iteration(inflight[nth].plan)
        while len(inflight) > nth:
            inflight.pop()
        self._apply_releases()

    @staticmethod
    def _wait_executed(flight: "_InFlight") -> None:
        handle = flight.handle
        if handle is None:
            return
        flight.handle = None
        wait = getattr(handle, "result", None) or getattr(handle, "wait")
        try:
            wait()
        finally:
            flight.measured_us = (time.perf_counter_ns() - flight.t0) / 1e3

    def _busy(self) -> bool:
        return any(f.handle is not None for f in self._inflight)

    def _release(self, sequence_id: str) -> None:
        if self._inflight and self._busy():
            self._pending_release.append(sequence_id)
        else:
            self.host.release(sequence_id)

    def _apply_releases(self) -> None:
        if self._pending_release and not self._busy():
            pending, self._pending_release = self._pending_release, []
            for rid in pending:
                self.host.release(rid)
