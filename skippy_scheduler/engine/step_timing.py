"""Where an iteration's time goes: the engine thread's parts and the host's busy share.

`StepTiming` is an engine observer (engine/observers.py) that keeps one record per iteration (a
plan, from its making to its completion; with one plan in flight, one engine step) and folds it
into a histogram per part and a busy share over the last `window` iterations. It reads
`time.perf_counter_ns` a few times per iteration, never per row, and the engine's own execute
timing (`_InFlight.t0`, `measured_us`, taken whenever the engine has a clock).

The parts, each in ns (`PARTS`):

* `wall`: the iteration's share of elapsed time: from the end of the previous iteration to the
  end of this one, or, when the engine found nothing to run in between (idle), from the start
  of the step that made this plan. Not a part: the whole the others are taken from.
* `before`: the engine's `before_step` hook, which `attach` wraps (the server's: hand-over of
  the inbox's verdicts, the /metrics figures, queued calls), summed over the steps since the
  last iteration ended.
* `plan`: from the hook's return to the plan being made: `plan_iteration`, the releases of the
  sequences it preempted, the engine's bookkeeping of the plan.
* `execute`: the host's execution: `host.execute` from call to return (a synchronous host:
  staging the batch, the decode, reading the logits and sampling are all in it), or, for an
  asynchronous host (plans in flight), from its start (its launch, or the end of the plan
  before it when it was queued behind that one) to the worker's finish (the handle's done
  callback, when it has one; else when the engine saw the result): the engine's measure.
* `wait`: the time the engine thread spent blocked on an asynchronous execution's result (0
  for a synchronous host, whose execute is the engine thread's own time).
* `events`: handing the iteration's samples to the event listeners (`TokenEvents`: the server's
  subscriptions), plus, when the owner reports `step_ended`, what it did after `completed`
  (the server's hand-over of the step's wake-ups to the event loop).
* `complete`: from the samples handed out to this observer's `completed`: the scheduler's
  `complete_iteration`, the releases and finish events of what ended, memory measurement, and
  the observers before this one (the slack rule's cost refit).

Plans in flight (`max_inflight_plans` > 1): `attach` wraps the engine's asynchronous call so
that `wait` and the worker's finish are measured; the parts of one iteration then come from
different steps and `execute` overlaps the others, so they do not add up to `wall`.

The busy share is Σ execute / Σ wall over the last `window` iterations (at most 1).

A host that reports its time inside the model's forward pass (`DecodeTimingHost.decode_ns`, the
llama host: the llama_decode calls and the wait for their outputs) gives the log a `decode_ns`
per iteration: the growth of that total since the previous iteration ended (null for other
hosts). `execute` minus `decode` is then the host's own work around the decode (staging the
batch, sampling).

`step_log(path)` writes one JSON line per iteration (`LOG_FIELDS`) to a buffered file: the
engine thread's cost is the formatting and a buffered write; the buffer goes to disk when it
fills, when the engine next finds nothing to run, and on `close`. Beside the times, a line
says what the step held (prefill tokens, decode rows, rows, the prefill tokens' positions
summed) and, under the slack rule, `predicted_us`: what the scheduler's cost model, as it
stood when the plan was made, predicted the step's execute would take (§2.13; null under the
reference rule), so that a step that overran its prediction can be found and explained.
"""
from __future__ import annotations

import time
from bisect import bisect_left
from collections import deque
from typing import IO, TYPE_CHECKING, Any, Callable, Optional

from ..types import IterationTelemetry
from .contract import DecodeTimingHost
from .observers import BaseObserver

if TYPE_CHECKING:  # pragma: no cover
    from .requests import _InFlight

#: The histogram parts, in the order of `StepTiming.totals` and `counts`.
PARTS = ("wall", "before", "plan", "execute", "wait", "events", "complete")
#: Bucket bounds in seconds (le), from a microsecond step to a long prefill.
BUCKETS_S = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2,
             0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_BOUNDS_NS = tuple(int(round(b * 1e9)) for b in BUCKETS_S)
#: Iterations the busy share is taken over by default.
BUSY_WINDOW = 64
#: The fields of a step log line.
LOG_FIELDS = ("i", "end_ns", "wall_ns", "before_ns", "plan_ns", "execute_ns", "wait_ns",
              "events_ns", "complete_ns", "decode_ns", "prefill_tokens", "decode_rows", "rows",
              "prefill_positions", "predicted_us", "busy")

# A record's slots (a list per plan in flight).
_FLIGHT, _PLANNED, _PLAN, _DONE, _WAIT, _SHAPE = range(6)


class StepTiming(BaseObserver):
    """Per-iteration times (module docstring). Attach with `attach(engine)` (which times the
    engine's `before_step` hook as `before`); made with `ends_step=False`, the iteration ends
    when its owner calls `step_ended()`, once its own end-of-step work is done."""

    wants_samples = True  # `sampled` marks the end of the token events

    def __init__(self, window: int = BUSY_WINDOW, clock: Callable[[], int] = time.perf_counter_ns,
                 ends_step: bool = True) -> None:
        if window < 1:
            raise ValueError(f"window must be at least 1 iteration, got {window}")
        self._clock = clock
        self._ends_step = ends_step
        self.iterations = 0
        #: Per part: the summed ns, and the count per bucket (the last: above every bound).
        self.totals = [0] * len(PARTS)
        self.counts = [[0] * (len(_BOUNDS_NS) + 1) for _ in PARTS]
        self._window = window
        self._ring_exec = [0] * window
        self._ring_wall = [0] * window
        self._ring_at = 0
        self._sum_exec = 0
        self._sum_wall = 0
        self._flights: deque[list[Any]] = deque()
        self._step_at = 0  # the current step's start (step_started)
        self._plan_from = 0  # where the next plan's time starts (before_done)
        self._before = 0  # before-step time since the last iteration ended
        self._last_end = 0  # 0: no iteration ended since the engine was last idle
        self._ended_at = 0  # when the last iteration ended (kept through idle time)
        self._worked = True  # the current step made or completed a plan
        self._executed = 0  # this iteration's marks (one completes at a time)
        self._sampled = 0
        self._completed = 0
        self._current: Optional[list[Any]] = None
        self._log: Optional[IO[str]] = None
        self._log_dirty = False
        self._t0 = clock()
        # The host's running total of forward-pass time (DecodeTimingHost), when it has one.
        self._decode_total: Optional[Callable[[], int]] = None
        self._decode_seen = 0
        # The slack rule's prediction of a step's execute in µs from its terms (attach).
        self._predict: Optional[Callable[..., float]] = None

    # -- wiring -------------------------------------------------------------------------------

    def attach(self, engine: Any, index: Optional[int] = None) -> "StepTiming":
        """Add this observer to `engine` (at `index`, default last), wrap its `before_step`
        hook (a step's start, and `before`) and, with plans in flight, time the engine's
        asynchronous executions (`wait`, the worker's finish)."""
        observers = engine.observers
        observers.insert(len(observers) if index is None else index, self)
        hook = engine.before_step
        started, done = self.step_started, self.before_done

        def before_step(e: Any) -> None:
            started()
            if hook is not None:
                hook(e)
            done()

        engine.before_step = before_step
        if getattr(engine, "_slack_feed", None) is not None:
            scheduler = engine.scheduler
            self._predict = lambda *terms: float(scheduler.step_cost.predict_us(*terms))
        host = getattr(engine, "host", None)
        if isinstance(host, DecodeTimingHost):
            self._decode_total = lambda: host.decode_ns
            self._decode_seen = host.decode_ns
        run_async = engine._run_async
        if run_async is not None:
            engine._run_async = self._timed_async(run_async)
        run_after = engine._run_after
        if run_after is not None:
            engine._run_after = self._timed_async(run_after)
        return self

    def _timed_async(self, run_async: Callable[..., Any]) -> Callable[..., Any]:
        flights = self._flights
        clock = self._clock

        def start(plan: Any, *rest: Any) -> Any:
            handle = run_async(plan, *rest)
            rec = flights[-1] if flights else None
            if rec is None or rec[_FLIGHT].plan is not plan:
                return handle
            return _TimedHandle(handle, rec, clock)  # (the worker's finish: `flight.done_ns`)

        return start

    def step_log(self, path: str, buffer_bytes: int = 1 << 16) -> None:
        """Write one JSON line per iteration to `path` (truncated first)."""
        self.close()
        self._log = open(path, "w", encoding="utf-8", buffering=buffer_bytes)

    def flush(self) -> None:
        if self._log is not None and self._log_dirty:
            self._log_dirty = False
            self._log.flush()

    def close(self) -> None:
        log, self._log = self._log, None
        if log is not None:
            log.close()

    def forget_flights(self) -> None:
        """Drop the records of plans that will never complete (the engine failed)."""
        self._flights.clear()
        self._current = None
        self._last_end = 0

    # -- the step's start (the owner's before-step hook) --------------------------------------

    def step_started(self) -> None:
        now = self._clock()
        if not self._worked:  # the last step found nothing to run: the engine went idle
            self._last_end = 0
            self._before = 0
            if self._log_dirty:
                self.flush()
        self._worked = False
        self._step_at = now

    def before_done(self) -> None:
        now = self._plan_from = self._clock()
        self._before += now - self._step_at

    # -- observer points ----------------------------------------------------------------------

    def planned(self, flight: "_InFlight") -> None:
        now = self._clock()
        self._worked = True
        # [flight, step start, plan ns, async done, async wait, (positions, predicted µs)]
        shape = None
        if self._log is not None:  # read while the plan is live, with the model of its making
            plan = flight.plan
            decode = flight.decode
            prefill_rows = len(plan) - decode
            positions = plan.prefill_positions if prefill_rows else 0
            predicted = None if self._predict is None else self._predict(
                flight.token_count - decode, decode, prefill_rows, positions)
            shape = (positions, predicted)
        self._flights.append([flight, self._step_at, now - self._plan_from, 0, 0, shape])

    def executed(self, flight: "_InFlight", duration_us: float) -> None:
        self._sampled = self._executed = self._clock()
        flights = self._flights
        for rec in flights:
            if rec[_FLIGHT] is flight:
                break
        else:
            self._current = None  # planned before this observer was attached
            return
        while flights.popleft() is not rec:  # records of plans aborted since
            pass
        self._current = rec

    def sampled(self, flight: "_InFlight", rows: list[int], tokens: Any, end_us: float) -> None:
        self._sampled = self._clock()

    def completed(self, flight: "_InFlight", duration_us: float,
                  telemetry: IterationTelemetry) -> None:
        self._completed = self._clock()
        if self._ends_step:
            self.step_ended()

    def step_ended(self) -> None:
        """The iteration's end: fold its record (the owner calls it after its own end-of-step
        work when made with `ends_step=False`)."""
        rec = self._current
        if rec is None:
            return
        self._current = None
        now = self._clock()
        self._worked = True
        flight = rec[_FLIGHT]
        start = self._last_end or rec[1]
        self._last_end = self._ended_at = now
        done = flight.done_ns or rec[_DONE]  # the engine's done stamp, else when it looked
        if flight.measured_us:  # the engine's own measure (engine/step.py `_execution_us`)
            execute = int(flight.measured_us * 1e3)
        elif done:  # asynchronous, no engine clock: to the worker's finish
            execute = max(done - flight.t0, 0)
        else:
            execute = 0
        wall = now - start
        before, self._before = self._before, 0
        events = self._sampled - self._executed + now - self._completed
        parts = (wall, before, rec[_PLAN], execute, rec[_WAIT], events,
                 self._completed - self._sampled)
        totals = self.totals
        counts = self.counts
        bounds = _BOUNDS_NS
        for k, v in enumerate(parts):
            totals[k] += v
            counts[k][bisect_left(bounds, v)] += 1
        at = self._ring_at
        self._sum_exec += execute - self._ring_exec[at]
        self._sum_wall += wall - self._ring_wall[at]
        self._ring_exec[at] = execute
        self._ring_wall[at] = wall
        self._ring_at = at + 1 if at + 1 < self._window else 0
        self.iterations += 1
        if self._log is not None:
            self._write(parts, flight, now, rec[_SHAPE])

    def _write(self, parts: tuple[int, ...], flight: Any, now: int,
               shape: Optional[tuple[int, Optional[float]]]) -> None:
        decode = flight.decode
        positions, predicted = shape if shape is not None else (0, None)
        assert self._log is not None
        forward = "null"
        if self._decode_total is not None:
            total = self._decode_total()
            forward = str(total - self._decode_seen)
            self._decode_seen = total
        self._log.write(
            f'{{"i": {self.iterations}, "end_ns": {now - self._t0}, "wall_ns": {parts[0]}, '
            f'"before_ns": {parts[1]}, "plan_ns": {parts[2]}, "execute_ns": {parts[3]}, '
            f'"wait_ns": {parts[4]}, "events_ns": {parts[5]}, "complete_ns": {parts[6]}, '
            f'"decode_ns": {forward}, '
            f'"prefill_tokens": {flight.token_count - decode}, "decode_rows": {decode}, '
            f'"rows": {len(flight.plan)}, '
            f'"prefill_positions": {positions}, '
            f'"predicted_us": {"null" if predicted is None else f"{predicted:.1f}"}, '
            f'"busy": {self.busy_ratio():.4f}}}\n')
        self._log_dirty = True

    # -- summaries (any thread: plain reads) --------------------------------------------------

    def busy_ratio(self, idle_counts: bool = False) -> float:
        """Σ execute / Σ wall over the last `window` iterations (0 before the first). With
        `idle_counts`, and the engine idle (its last step found nothing to run), the time since
        the last iteration ended is wall time too: an idle host's share falls towards 0
        instead of staying at its last busy value (what a gauge read between loads shows)."""
        wall = self._sum_wall
        if idle_counts and not self._worked and self._ended_at:
            wall += max(self._clock() - self._ended_at, 0)
        return min(self._sum_exec / wall, 1.0) if wall > 0 else 0.0

    def histogram(self, part: str) -> tuple[list[int], float]:
        """(cumulative counts per bucket of `BUCKETS_S`, then the total; the sum in seconds)."""
        k = PARTS.index(part)
        counts = list(self.counts[k])
        total_s = self.totals[k] / 1e9
        out: list[int] = []
        acc = 0
        for c in counts:
            acc += c
            out.append(acc)
        return out, total_s


class _TimedHandle:
    """An asynchronous execution's handle that notes how long the engine waited on it, and
    when the execution had finished (if no done callback said so earlier)."""

    __slots__ = ("_handle", "_rec", "_clock")

    def __init__(self, handle: Any, rec: list[Any], clock: Callable[[], int]) -> None:
        self._handle = handle
        self._rec = rec
        self._clock = clock

    @property
    def add_done_callback(self) -> Callable[[Callable[[Any], None]], None]:
        """The wrapped handle's (AttributeError when it has none, as for the handle itself)."""
        return self._handle.add_done_callback  # type: ignore[no-any-return]

    def result(self) -> object:
        clock = self._clock
        t = clock()
        try:
            return self._handle.result()
        finally:
            end = clock()
            rec = self._rec
            rec[_WAIT] += end - t
            if not rec[_DONE]:
                rec[_DONE] = end
