"""The engine's one step path: plan, execute, complete, release (docs/behaviour.md §2.11).

Up to `max_inflight_plans` plans are in flight. With one, a step makes a plan, runs it and
completes it. With more, a step makes a plan and starts it while earlier ones are in flight
(the host's `execute_async`), or, when no more fit, waits for the oldest and completes it; plan
N+1 starts once N has finished (its deferred inputs are N's samples). A host releases state
only while no plan of it executes, so releases that come up meanwhile wait until the running
plan is done. A failed execution aborts its plan and every later one.

A pipelined host (`pipeline_depth` > 1: a model split over stage processes) runs several
started plans at once, in order: a plan with no deferred input starts without waiting for the
ones in flight (the scheduler's `disjoint_inflight_plans` makes every plan so), and releases
go to the host at once, which applies them after the plans already started.

Observers (engine/observers.py) are called at each point of a step. With none, no clock, one
plan at a time and neither `max_iterations` nor `profile` set, a step is the bare scheduler
loop: plan_iteration, execute, complete_iteration, and the releases when something ended (the
branch at the top of `step`, which checks those conditions on every step, so no setter has to
keep a flag right). Everything else takes the path below it.
"""
from __future__ import annotations

import time
from collections import deque
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional

from ..cost_model import decode_row_count
from ..inflight import resolve_deferred
from ..types import FinishReason, MalformedOutputs, ReleaseReason
from .requests import _SUBMITTED, EngineStalled, _InFlight

if TYPE_CHECKING:  # pragma: no cover
    from .clock import Clock
    from .contract import Host, HostHooks, Plan, SchedulerLike
    from .observers import StepObserver
    from .requests import _Entry

_INF = float("inf")
_REENTRY = ("the engine is in a step: step() and run() cannot be called from a listener, an "
            "observer or a hook (submit and cancel can)")


class _Steps:
    """Mixed into `Engine`: the step path and the release queue it needs."""

    # Slots, not a per-instance dict: every attribute the step path reads is a fixed offset
    # (the engine has more fields than a dict shares its keys for, which slows each read).
    __slots__ = ("_inflight", "_pending_release", "_run_async", "_run_after", "_pipelined",
                 "_measures",
                 "_keeps", "_pending_keeps", "_each_completion",
                 "iterations", "last_plan_ns", "last_complete_ns", "last_telemetry",
                 "_outstanding", "_ran_until", "_stepping")

    scheduler: "SchedulerLike"
    host: "Host"
    hooks: "HostHooks"
    observe: bool
    profile: bool
    max_iterations: Optional[int]
    iterations: int
    last_plan_ns: int
    last_complete_ns: int
    last_telemetry: Any
    _clock: Optional["Clock"]
    _observers: list["StepObserver"]
    _depth: int
    _outstanding: int
    _live: dict[str, "_Entry"]

    before_step: Optional[Callable[[Any], None]]
    _inbox: deque[tuple[str, Any]]
    _next_due: float

    if TYPE_CHECKING:  # provided by Engine
        def now(self) -> float: ...
        def _drain(self) -> None: ...
        def _submit_due(self) -> None: ...
        def _end(self, entry: "_Entry", reason: str, error: Optional[str] = None,
                 emit: bool = True) -> None: ...
        def _measure_memory(self) -> None: ...
        def _release_victims(self, victims: Iterable[str]) -> None: ...

    def _init_steps(self) -> None:
        self._stepping = False  # in a step (step() refuses to be called again from inside it)
        self._inflight: deque[_InFlight] = deque()
        self._ran_until = 0  # perf_counter ns: the end of the last execution waited for
        self._pending_release: list[tuple[str, ReleaseReason]] = []
        # Plans in flight run on the host's worker; one at a time runs in the caller's thread.
        self._run_async = self.hooks.execute_async if self._depth > 1 else None
        self._pipelined = self._run_async is not None and self.hooks.pipeline_depth > 1
        # A chaining host takes plan N+1 while N runs (its deferred inputs filled on its
        # worker); at depth 2 only, where N+1's inputs come from N alone, which the engine
        # completes only once it is done (deeper, a source could be completed first).
        self._run_after = (self.hooks.execute_after
                           if self._run_async is not None and self._depth == 2 else None)
        self._measures = self.hooks.memory_used is not None
        # Cold prefix hold (docs/behaviour.md §2.3a): the prompts a completion's telemetry
        # names (`prompt_keeps`) are kept as resident prefixes, while no plan executes.
        hold = (self.scheduler.config.cold_prefix_hold_tokens > 0
                and self.hooks.prefix_store is not None)
        self._keeps = self.hooks.keep_prompt if hold else None
        self._pending_keeps: list[tuple[str, int]] = []
        self._each_completion = self._measures or self._keeps is not None

    def step(self) -> bool:
        """One step: inbox, due arrivals, hook, and one iteration if anything is live (make,
        run and complete plans as the depth allows). Returns False when there was nothing to
        run. Not from inside a step (a listener, an observer or a hook): RuntimeError, nothing
        changed (a step inside a step would plan over the plan in hand)."""
        if self._stepping:
            raise RuntimeError(_REENTRY)
        self._stepping = True
        try:
            if self._inbox:
                self._drain()
            if self._next_due != _INF and self._next_due <= self.now():
                self._submit_due()
            if self.before_step is not None:
                self.before_step(self)
            if (self._observers or self._clock is not None or self._depth != 1
                    or self.max_iterations is not None or self.profile):
                return self._step_flights()
            # Nothing watches, times, guards or stays in flight: a step is the three calls and
            # the releases, without the per-plan bookkeeping of _step_flights (what `bench`
            # times).
            if not self._outstanding:
                return False
            sched = self.scheduler
            plan = sched.plan_iteration()
            if (plan.preempted or not len(plan)) and self._admit(plan) is None:
                raise EngineStalled(self._stalled())
            try:  # _execute, inline: one call less per step
                self.host.execute(plan)
            except BaseException:
                sched.abort_iteration(plan)
                raise
            try:
                telemetry = self.last_telemetry = sched.complete_iteration(plan)
            except MalformedOutputs:
                sched.abort_iteration(plan)  # refused, unchanged: its rows run again
                raise
            self.iterations += 1
            if telemetry.finished_ids or telemetry.failed_ids or self._each_completion:
                self._after_completion(telemetry)
            return True
        finally:
            self._stepping = False

    def _step_flights(self) -> bool:
        """The iteration of a step that something watches, times, guards or pipelines: plans
        as `_InFlight` records, observers called at each point."""
        inflight = self._inflight
        if self._outstanding and len(inflight) < self._depth:
            flight = self._make_flight()
            if flight is not None:
                self._launch(flight)
                if self._depth > 1:
                    return True
            elif not inflight:
                raise EngineStalled(self._stalled())
        if not inflight:
            return False
        flight = inflight[0]
        if flight.handle is not None:
            try:
                self._wait_executed(flight)
            except BaseException:
                self._failed_from(0)
                raise
        inflight.popleft()
        if self._pending_release or self._pending_keeps:
            self._apply_releases()
        try:
            self._finish(flight)
        except MalformedOutputs:
            # The host wrote outputs the completion refused: the plan is still live, unchanged.
            # It and every later plan in flight are undone, so their rows run again.
            inflight.appendleft(flight)
            self._failed_from(0)
            raise
        return True

    def _stalled(self) -> str:
        return (f"the scheduler made an empty plan with {self._outstanding} requests waiting "
                f"or running and nothing in flight at {self.now()} µs (measured memory that "
                "leaves no room for any of them?)")

    def _plan(self) -> Optional["Plan"]:
        """plan_iteration; None (the empty plan given back) when it has no row."""
        if self.max_iterations is not None and self.iterations >= self.max_iterations:
            raise RuntimeError(f"no completion after {self.iterations} iterations")
        sched = self.scheduler
        if self.profile:
            t0 = time.perf_counter_ns()
            plan = sched.plan_iteration()
            self.last_plan_ns = time.perf_counter_ns() - t0
        else:
            plan = sched.plan_iteration()
        return self._admit(plan)

    def _admit(self, plan: "Plan") -> Optional["Plan"]:
        """`plan` once the sequences it preempted are released; None (the empty plan given
        back) when it has no row."""
        if plan.preempted:
            # Preemption for priority (docs/behaviour.md §2.8a): the victims' lanes are handed
            # to this plan's new rows, so the host lets them go before it runs the plan.
            self._release_victims(plan.priority_victims)
        if len(plan) == 0:
            self.scheduler.abort_iteration(plan)
            return None
        return plan

    def _execute(self, plan: "Plan") -> None:
        try:
            self.host.execute(plan)
        except BaseException:
            self.scheduler.abort_iteration(plan)  # its rows are undone: nothing lost
            raise

    def _make_flight(self) -> Optional[_InFlight]:
        """A plan and what observers note when it is made; None when there is nothing to run
        until what is in flight lands."""
        plan = self._plan()
        if plan is None:
            return None
        flight = _InFlight(plan)
        clock = self._clock
        observers = self._observers
        if clock is not None:
            flight.start = clock.now()
        flight.token_count = plan.token_count
        flight.decode = decode_row_count(plan.phases)
        if observers:
            try:
                for o in observers:
                    o.planned(flight)
            except BaseException:
                self.scheduler.abort_iteration(plan)  # never launched: its rows are undone
                raise
            if self._depth > 1:
                live = self._live
                flight.entries = entries = [live[i] for i in plan.sequence_ids]
                flight.voids = [e.voids for e in entries]
        return flight

    def _launch(self, flight: _InFlight) -> None:
        inflight = self._inflight
        chained: Optional[list[Plan]] = None
        releasing: Any = None  # the releases queued on a chaining host's worker
        if inflight and self._pipelined:
            if flight.plan.deferred_rows.size:  # its inputs are in flight: wait for them all
                for nth, earlier in enumerate(inflight):
                    try:
                        self._wait_executed(earlier)
                    except BaseException:
                        self._failed_from(nth)  # the new plan is later: undone too
                        raise
                self._resolve(flight)
        elif inflight and self._run_after is None:
            try:
                self._wait_executed(inflight[-1])  # the device is free, its samples are known
            except BaseException:
                self._failed_from(len(inflight) - 1)  # the new plan is later: undone too
                raise
            if self._pending_release or self._pending_keeps:
                self._apply_releases()
            if flight.plan.deferred_rows.size:
                self._resolve(flight)
        elif inflight:
            if self._pending_release or self._pending_keeps:
                # On the worker between the plan running and this one (queued right behind
                # them below), the engine waiting for them and touching nothing meanwhile: the
                # device goes on to this plan without waiting for the engine to wake.
                releasing = self.hooks.call_after(partial(self._apply_releases, True))
            chained = [f.plan for f in inflight]  # behind them, on the host's worker
        timed = self._clock is not None
        if timed:
            flight.t0 = time.perf_counter_ns()
        if self._run_async is not None:
            try:
                run_after = self._run_after
                if chained is not None and run_after is not None:
                    flight.handle = handle = run_after(flight.plan, chained)
                else:
                    flight.handle = handle = self._run_async(flight.plan)
            except BaseException:
                if releasing is not None:  # they touch the engine's lists: let them end first
                    try:
                        releasing.result()
                    except BaseException:
                        pass
                self.scheduler.abort_iteration(flight.plan)
                raise
            done = getattr(handle, "add_done_callback", None)
            if done is not None:  # the worker's finish, for the measure and the step timing
                done(flight.stamp_done)
            if releasing is not None:
                try:
                    releasing.result()
                except BaseException:
                    try:
                        handle.result()  # queued behind the releases: let it end, then undo it
                    except BaseException:
                        pass
                    self.scheduler.abort_iteration(flight.plan)
                    raise
        else:
            self._execute(flight.plan)
            if timed:
                flight.measured_us = (time.perf_counter_ns() - flight.t0) / 1e3
        inflight.append(flight)

    def _resolve(self, flight: _InFlight) -> None:
        """Fill `flight`'s deferred inputs from the plans in flight, whose executions ended.
        Outputs a host wrote out of its plan's rows undo every plan in flight and this one
        (MalformedOutputs, as their completion would raise)."""
        try:
            resolve_deferred(flight.plan, [f.plan for f in self._inflight])
        except MalformedOutputs:
            self._failed_from(0)  # aborting the oldest undoes every later plan, this one too
            raise

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

    def abandon_flights(self) -> None:
        """Undo every plan in flight (each execution still running is waited for first, so
        the device is idle), then apply the releases and keeps that waited for the device: a
        caller recovering from a failed step (or stopping) does this before ending the open
        requests, so that the scheduler holds no plan the engine has forgotten. On the
        engine's thread, or while `run_forever` is not running."""
        inflight = self._inflight
        if inflight:
            for flight in list(inflight):
                try:
                    self._wait_executed(flight)
                except BaseException:
                    pass  # it failed: it is undone all the same
            try:
                self.scheduler.abort_iteration(inflight[0].plan)  # and every later one
            finally:
                inflight.clear()
        self._apply_releases()

    def _wait_executed(self, flight: _InFlight) -> None:
        handle = flight.handle
        if handle is None:
            return
        flight.handle = None
        try:
            handle.result()
        finally:
            if self._clock is not None:
                flight.measured_us = self._execution_us(flight)

    def _execution_us(self, flight: _InFlight) -> float:
        """How long an asynchronous execution ran: to its end (the worker's, from the handle's
        done callback, else now) from its start. A host that runs one plan at a time starts a
        plan when it was launched or when the plan before it ended, whichever is later (with
        plans in flight the next is launched while one runs: it waits in the host's queue, and
        that wait is not the step's cost the slack rule fits). A pipelined host runs its plans
        at once: from the launch."""
        end = flight.done_ns or time.perf_counter_ns()
        start = flight.t0
        if not self._pipelined:
            if self._ran_until > start:
                start = self._ran_until
            self._ran_until = end
        return (end - start) / 1e3 if end > start else 0.0

    def _finish(self, flight: _InFlight) -> None:
        """Charge an executed plan on the clock, show it to the observers, complete it."""
        clock = self._clock
        if clock is not None:
            duration = clock.charge(flight.token_count - flight.decode, flight.decode,
                                    flight.measured_us)
            end = clock.now()
        else:
            duration = end = 0
        error: Optional[Exception] = None
        if self._observers:
            try:  # an observer that raises does not keep the executed plan from completing
                for o in self._observers:
                    o.executed(flight, duration)
                self._report_samples(flight, end)
            except Exception as exc:
                error = exc
        self._complete(flight, duration)
        if error is not None:
            raise error

    def _complete(self, flight: _InFlight, duration: float) -> None:
        """Observe the duration, complete the plan, release what ended, measure memory."""
        plan = flight.plan
        sched = self.scheduler
        if self.observe:
            sched.observe_iteration_duration(plan, duration / 1e6)
        if self.profile:
            t0 = time.perf_counter_ns()
            telemetry = sched.complete_iteration(plan)
            self.last_complete_ns = time.perf_counter_ns() - t0
        else:
            telemetry = sched.complete_iteration(plan)
        self.last_telemetry = telemetry
        self.iterations += 1
        if telemetry.finished_ids or telemetry.failed_ids or self._each_completion:
            self._after_completion(telemetry)
        for o in self._observers:
            o.completed(flight, duration, telemetry)

    def _after_completion(self, telemetry: Any) -> None:
        """Release what ended, keep the prompts the telemetry names, then measure memory (when
        the host measures it)."""
        if telemetry.finished_ids or telemetry.failed_ids:
            self._retire(telemetry)
        if self._keeps is not None:
            keeps = telemetry.prompt_keeps
            if keeps:
                self._pending_keeps.extend(keeps)
                if not (self._inflight and not self._pipelined and self._busy()):
                    self._apply_keeps()
        if self._measures:
            self._measure_memory()

    def _report_samples(self, flight: _InFlight, end: float) -> None:
        watchers = [o for o in self._observers if o.wants_samples]
        out = flight.plan.outputs
        k = out.count
        if not watchers or not k:
            return
        n = len(flight.plan)
        if not 0 < k <= n:
            return  # malformed: the completion raises MalformedOutputs for it
        rows: list[int] = out.request_indexes[:k].tolist()
        if min(rows) < 0 or max(rows) >= n:
            return
        tokens = out.predicted_tokens[:k]
        if flight.entries is not None:
            # Rows whose request ended or was preempted since the plan was made: the scheduler
            # drops their outputs, so do the observers.
            entries, voids = flight.entries, flight.voids
            keep = [j for j, r in enumerate(rows)
                    if entries[r].state == _SUBMITTED and entries[r].voids == voids[r]]
            if len(keep) != k:
                rows = [rows[j] for j in keep]
                tokens = tokens[keep]
        for o in watchers:
            o.sampled(flight, rows, tokens, end)

    def _retire(self, telemetry: Any) -> None:
        """End every request the scheduler retired and release its host state. A release or a
        listener that raises does not keep the others from ending (the scheduler has let them
        all go): the first such error is raised once every one has ended."""
        reasons = telemetry.finish_reasons
        error: Optional[BaseException] = None
        for rid in telemetry.finished_ids:
            e = self._retire_one(rid, ReleaseReason.FINISHED, reasons[rid].value)
            error = error or e
        for rid in telemetry.failed_ids:
            e = self._retire_one(rid, ReleaseReason.FAILED, FinishReason.FAILED.value)
            error = error or e
        if error is not None:
            raise error

    def _retire_one(self, rid: str, why: ReleaseReason, reason: str) -> Optional[Exception]:
        """Release and end one retired request whatever raises; the first error (None)."""
        error: Optional[Exception] = None
        try:
            self._release(rid, why)
        except Exception as exc:
            error = exc
        self._outstanding -= 1
        try:
            self._end(self._live[rid], reason)
        except Exception as exc:
            error = error or exc
        return error

    # -- releases -----------------------------------------------------------------------------

    def _busy(self) -> bool:
        return any(f.handle is not None for f in self._inflight)

    def _release(self, sequence_id: str, reason: ReleaseReason) -> None:
        if self._inflight and not self._pipelined and self._busy():
            self._pending_release.append((sequence_id, reason))
        else:
            self.host.release(sequence_id, reason)

    def _apply_keeps(self) -> None:
        pending, self._pending_keeps = self._pending_keeps, []
        keep = self._keeps
        assert keep is not None
        for rid, tokens in pending:
            keep(rid, tokens)

    def _apply_releases(self, device_idle: bool = False) -> None:
        """The releases and keeps waiting for the device, when no plan executes (or, with
        `device_idle`, on a chaining host's worker between two plans, idle there whatever the
        engine's flights say)."""
        if not device_idle and self._busy():
            return
        if self._pending_keeps:
            self._apply_keeps()  # before releases: a leader's lane is still there
        if self._pending_release:
            pending, self._pending_release = self._pending_release, []
            release = self.host.release
            error: Optional[BaseException] = None
            for rid, reason in pending:  # each one, whatever another raises (`_retire`)
                try:
                    release(rid, reason)
                except Exception as exc:
                    error = error or exc
            if error is not None:
                raise error
