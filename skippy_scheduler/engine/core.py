"""The engine: the one loop that drives a scheduler and a host.

Each iteration: take what other threads handed in (submissions, cancellations), submit the
requests whose arrival time has come, make a plan, let the host execute it, charge its
duration on the clock, report the duration to the scheduler, complete the plan from the
plan's output block, release on the host every sequence that ended, and, when the host
measures memory, preempt until the measurement fits and release the victims. The recorder
notes what a client would see (docs/behaviour.md §5.4).

Row owners come from `plan.sequence_ids`, sampled tokens from `plan.outputs`; nothing else is
read. The scheduler is not thread-safe and the engine touches it from one thread only: calls
from other threads (`submit`, `cancel`) go through an inbox drained at the start of each step.
"""
from __future__ import annotations

import heapq
import itertools
import logging
import math
import numbers
import queue
import threading
import weakref
from collections import deque
from contextlib import contextmanager
from typing import (TYPE_CHECKING, Any, Callable, Generic, Iterable, Iterator, Literal, Optional,
                    Sequence as _Seq, overload)

from .._validate import as_float
from ..types import (REJECTED, AdmissionError, DuplicateSequence, FinishReason, QueueFull,
                     RejectReason, ReleaseReason, Sequence)
from ..slack import PlanningRule
from .clock import Clock, ClockArg, make_clock
from .cost_fit import SlackFeed, StepCostFitter
from .contract import (Host, HostHooks, RequestLike, SchedulerLike, attach, attach_store,
                       check_scheduler, check_slack_scheduler)
from .observers import OnPlan as _OnPlan, PlanHook, Recording, StepObserver, TokenEvents, replace_hook
from .record import EngineReport, Recorder
from .requests import (_ENDED, _PENDING, _SUBMITTED, AcceptEvent, EngineStalled, Event,
                       FinishEvent, Request, RequestNeverFits, TokenEvent, _Entry,
                       _SequenceRequest)
from .step import _REENTRY, _Steps

if TYPE_CHECKING:
    from typing_extensions import TypeVar

    # What `Engine.run` returns: an `EngineReport` for `Engine(..., record=True)` (the
    # default), None for `record=False`; a bare `Engine` annotation means either.
    _Report = TypeVar("_Report", covariant=True, default=Optional[EngineReport])
else:
    from typing import TypeVar

    _Report = TypeVar("_Report", covariant=True)

_INF = float("inf")

__all__ = ["AcceptEvent", "Engine", "EngineStalled", "Event", "EventStream", "FinishEvent",
           "Request", "RequestNeverFits", "TokenEvent"]

log = logging.getLogger(__name__)


class Engine(_Steps, Generic[_Report]):
    """Drive `scheduler` and `host` (a `Host`, engine/contract.py) until the work runs out.

    clock: "wall" (default), "virtual" (host-measured durations, idle gaps skipped), a `Clock`
        such as `VirtualClock(cost_model)`, or None (no time at all: for benchmarks).
    record: keep a `Recorder` (per-request and per-iteration figures; `report()`). Typed, an
        engine that records is an `Engine[EngineReport]` and one that does not an
        `Engine[None]`: what its `run` returns.
    observe: report iteration durations to the scheduler (mixed planning calibrates on them).
    on_plan: `f(plan, start_us, duration_us)` called while the plan is live, after it ran.
    before_step: `f(engine)` called at the start of every step (to cancel or preempt).
    on_reject: `f(request, exc)` when the scheduler refuses a submission at its arrival; by
        default the request is recorded as rejected (a `FinishEvent` says why).
    max_iterations: raise RuntimeError beyond this many iterations (a guard for tests).

    The host is checked against the contract once, here (`contract.attach`); `hooks` holds what
    it provides. A host that checks a scheduler's config (`ConfigCheckingHost`) is given the
    scheduler's config here too, before anything changes: its ValueError refuses the pairing.
    An engine's fields are fixed (slots): a subclass may add its own.
    """

    # The step path's fields and `_Steps`' own are slots (engine/step.py says why).
    __slots__ = ("scheduler", "hooks", "host", "_clock", "observe", "before_step", "on_reject",
                 "max_iterations", "profile", "_depth", "recorder", "_live", "_record_of",
                 "_pending", "_seq", "_source", "_source_next", "_last_source_arrival",
                 "_next_due", "_inbox", "_wake", "_lock", "_thread", "_started", "_stop",
                 "_listeners", "_streams", "_forgotten", "_observers", "_slack_feed",
                 "_components")

    @overload
    def __init__(self: "Engine[EngineReport]", scheduler: SchedulerLike, host: Host, *,
                 clock: ClockArg = ..., record: Literal[True] = ..., observe: bool = ...,
                 on_plan: Optional[PlanHook] = ...,
                 before_step: Optional[Callable[["Engine"], None]] = ...,
                 on_reject: Optional[Callable[[Any, BaseException], None]] = ...,
                 max_iterations: Optional[int] = ...) -> None: ...

    @overload
    def __init__(self: "Engine[None]", scheduler: SchedulerLike, host: Host, *,
                 clock: ClockArg = ..., record: Literal[False], observe: bool = ...,
                 on_plan: Optional[PlanHook] = ...,
                 before_step: Optional[Callable[["Engine"], None]] = ...,
                 on_reject: Optional[Callable[[Any, BaseException], None]] = ...,
                 max_iterations: Optional[int] = ...) -> None: ...

    @overload
    def __init__(self: "Engine[Optional[EngineReport]]", scheduler: SchedulerLike, host: Host,
                 *, clock: ClockArg = ..., record: bool = ..., observe: bool = ...,
                 on_plan: Optional[PlanHook] = ...,
                 before_step: Optional[Callable[["Engine"], None]] = ...,
                 on_reject: Optional[Callable[[Any, BaseException], None]] = ...,
                 max_iterations: Optional[int] = ...) -> None: ...

    def __init__(self, scheduler: SchedulerLike, host: Host, *, clock: ClockArg = "wall",
                 record: bool = True, observe: bool = True,
                 on_plan: Optional[PlanHook] = None,
                 before_step: Optional[Callable[["Engine"], None]] = None,
                 on_reject: Optional[Callable[[Any, BaseException], None]] = None,
                 max_iterations: Optional[int] = None) -> None:
        if max_iterations is not None and (isinstance(max_iterations, bool)
                                           or not isinstance(max_iterations, numbers.Integral)):
            raise TypeError(f"max_iterations must be an int or None, got "
                            f"{type(max_iterations).__name__}")
        if max_iterations is not None and max_iterations < 0:
            raise ValueError(f"max_iterations must be >= 0, got {max_iterations}")
        for name, hook in (("on_plan", on_plan), ("before_step", before_step),
                           ("on_reject", on_reject)):
            if hook is not None and not callable(hook):
                raise TypeError(f"{name} must be callable or None, got {type(hook).__name__}")
        self.scheduler = check_scheduler(scheduler)
        self.hooks: HostHooks = attach(host)
        config = scheduler.config
        if self.hooks.check_config is not None:
            self.hooks.check_config(config)  # a pairing the host refuses changes nothing
        self.host = host
        self._clock = make_clock(clock)
        self.observe = bool(observe) and self._clock is not None
        self.before_step = before_step
        self.on_reject = on_reject
        self.max_iterations = max_iterations
        #: Time plan_iteration and complete_iteration of every step (`last_plan_ns`,
        #: `last_complete_ns`).
        self.profile = False
        # The memory pools admission reserves in: a request whose reservation exceeds one of
        # them alone could never be admitted, and is refused at its arrival (`_check_fits`).
        self._components = tuple(config.memory_components)
        store = self.hooks.prefix_store
        if store is not None:
            attach_store(scheduler, store, config)
        self._depth = int(config.max_inflight_plans or 1)
        self.recorder: Optional[Recorder] = Recorder() if record else None
        self.iterations = 0
        self.last_plan_ns = 0
        self.last_complete_ns = 0
        self.last_telemetry: Any = None  # what the last complete_iteration returned
        # Requests that have not ended, by id; with a recorder, each id's latest record index.
        self._live: dict[str, _Entry] = {}
        self._record_of: dict[str, int] = {}
        self._outstanding = 0  # submitted to the scheduler and not ended
        self._pending: list[tuple[float, int, _Entry]] = []  # (arrival, order, entry)
        self._seq = itertools.count()
        self._source: Optional[Iterator[Any]] = None
        self._source_next: Any = None
        self._last_source_arrival: float = float("-inf")
        self._next_due: float = _INF  # earliest pending or streamed arrival
        self._inbox: deque[tuple[str, Any]] = deque()
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._thread: Optional[int] = None
        self._started = False
        self._stop = False
        self._listeners: list[Callable[[Event], None]] = []
        self._forgotten: deque[tuple[str, Any]] = deque()  # dropped streams (`_forget`)
        self._streams: dict[str, "list[queue.SimpleQueue[Event]]"] = {}
        self._observers: list[StepObserver] = []
        if self.recorder is not None:
            self._observers.append(Recording(self.recorder, self._record_of))
        replace_hook(self._observers, on_plan)
        # The slack rule reads the clock and a cost model fitted from these steps (§2.13); its
        # prefill order reads each request's age from the clock at its submit.
        self._slack_feed: Optional[SlackFeed] = None
        if config.planning_rule is PlanningRule.SLACK and self._clock is not None:
            self._slack_feed = SlackFeed(check_slack_scheduler(scheduler), self.now)
            self._observers.append(self._slack_feed)
        self._init_steps()

    # -- settings that may change between steps -----------------------------------------------

    @property
    def cost_fitter(self) -> Optional[StepCostFitter]:
        """The slack rule's cost fitter (engine/cost_fit.py), None when the scheduler does not
        run the slack rule or the engine has no clock. Set it, before the first step, to start
        from steps timed elsewhere (engine/warmup.py); the scheduler takes its model at once."""
        return self._slack_feed.fitter if self._slack_feed is not None else None

    @cost_fitter.setter
    def cost_fitter(self, fitter: StepCostFitter) -> None:
        if self._slack_feed is None:
            raise ValueError("this engine fits no cost model: its scheduler does not run the "
                             "slack rule, or it has no clock")
        if not isinstance(fitter, StepCostFitter):
            raise TypeError(f"cost_fitter must be a StepCostFitter, got {type(fitter).__name__}")
        self._slack_feed.fitter = fitter
        self._slack_feed.scheduler.set_step_cost(fitter.cost)

    @property
    def clock(self) -> Optional[Clock]:
        return self._clock

    @clock.setter
    def clock(self, clock: ClockArg) -> None:
        new = make_clock(clock)
        if new is None:
            # Without a clock time stays at 0: a request still waiting for its arrival (not
            # cancelled meanwhile) would never arrive.
            pending = [p for p in self._pending if p[2].state == _PENDING]
            src = self._source_next
            if pending or (src is not None and src.arrival_us is not None
                           and src.arrival_us > 0):
                raise ValueError("requests wait for their arrival times: an engine without a "
                                 "clock would never reach them")
            if len(pending) != len(self._pending):
                self._pending = pending  # (cancelled ones only were left: none waits)
                self._update_next_due()
        self._clock = new

    @property
    def on_plan(self) -> Optional[PlanHook]:
        for o in self._observers:
            if isinstance(o, _OnPlan):
                return o.hook
        return None

    @on_plan.setter
    def on_plan(self, hook: Optional[PlanHook]) -> None:
        replace_hook(self._observers, hook)

    @property
    def observers(self) -> list[StepObserver]:
        """Called at every step's points (engine/observers.py); an empty list is the lean
        path. Add your own `StepObserver` here."""
        return self._observers

    def _watch_events(self) -> None:
        with self._lock:  # listeners and streams may be added from several threads at once
            if not any(isinstance(o, TokenEvents) for o in self._observers):
                self._observers.append(TokenEvents(self._emit, self.hooks.sample_details,
                                                   self._live))

    # -- time ---------------------------------------------------------------------------------

    def now(self) -> float:
        """Microseconds on the engine's clock (0 without a clock)."""
        return self._clock.now() if self._clock is not None else 0

    def _ensure_started(self) -> None:
        if not self._started:
            self._started = True
            if self._clock is not None:
                self._clock.start()

    # -- submitting ---------------------------------------------------------------------------

    def submit(self, request: Any) -> None:
        """Hand a request (a `Request`, a `Sequence`, or any object with `id`, `arrival_us` and
        `to_sequence()`) to the engine. On the engine's thread (or before it runs) a request
        whose time has come goes to the scheduler at once and its refusal raises; from another
        thread it waits in the inbox and a refusal ends it as rejected (but a second request
        with the id of one still open ends as a rejected record of its own, told to
        `on_reject` or the log but not to that id's listeners and streams, which are the open
        one's). An `arrival_us` that is not None or a finite number (or, on an engine without
        a clock, a number above 0: its time never passes), or a `ttft_ms` / `itl_ms` that is
        not None or a finite number > 0, raises ValueError or TypeError here, on either
        thread, before the engine keeps anything of the request."""
        request = self._as_request(request)
        self._check_arrival(request)
        if isinstance(request, Request):  # its own budgets, whenever it arrives
            request.check_budgets()
        if not self._on_engine_thread():
            self._inbox.append(("submit", request))
            self._wake.set()
            return
        self._accept(request, raise_errors=True)

    def add_requests(self, requests: Iterable[Any]) -> None:
        """A stream of requests in non-decreasing arrival order, pulled as time reaches them
        (so a long trace never sits in memory at once); one at a time (RuntimeError while
        another still has requests to give)."""
        if self._source is not None:
            raise RuntimeError("the engine already has a request stream")
        self._source = iter(requests)
        self._last_source_arrival = float("-inf")  # the order is each stream's own
        self._pull_source()

    def cancel(self, request_id: str) -> bool:
        """Cancel a request that has not ended (pending, waiting or running); frees its host
        state. From another thread the cancel is queued and True means "queued"."""
        if not isinstance(request_id, str):
            raise TypeError(f"request id must be a str, got {type(request_id).__name__}")
        if not self._on_engine_thread():
            self._inbox.append(("cancel", request_id))
            self._wake.set()
            return True
        return self._cancel(request_id)

    def preempt(self, used_bytes: _Seq[int]) -> list[str]:
        """Report measured memory use; preempted sequences lose their runtime state."""
        victims = list(self.scheduler.preempt_for_component_pressure(list(used_bytes)))
        self._release_victims(victims)
        return victims

    def wake(self) -> None:
        """Make an idle `run_forever` take a step now (thread-safe): its `before_step` hook runs
        even when nothing was submitted (a server runs its queued calls there)."""
        self._wake.set()

    def stop(self) -> None:
        """Ask `run_forever` to return after the current step (thread-safe). Each stop ends
        one `run_forever`: asked before it begins, it makes the next one return at once."""
        self._stop = True
        self._wake.set()

    # -- observing ----------------------------------------------------------------------------

    def add_listener(self, listener: Callable[[Event], None]) -> None:
        """Call `listener(event)` for every `TokenEvent` and `FinishEvent`, on the engine's
        thread, as they happen."""
        if not callable(listener):
            raise TypeError(f"listener must be callable, got {type(listener).__name__}")
        self._listeners.append(listener)
        self._watch_events()

    def stream(self, request_id: str) -> "EventStream":
        """Events of one request, for a consumer on another thread: subscribe before
        submitting; the iterator ends after the request's `FinishEvent`. Several streams of
        one id each get every event. A stream closed early (`close()`, a `with` block, or
        dropped) holds nothing: one of a request never submitted included."""
        if not isinstance(request_id, str):
            raise TypeError(f"request id must be a str, got {type(request_id).__name__}")
        q: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        with self._lock:
            self._drop_forgotten()
            self._streams.setdefault(request_id, []).append(q)
        self._watch_events()
        return EventStream(request_id, q, self._forget, self._unsubscribe)

    def _forget(self, request_id: str, q: "queue.SimpleQueue[Any]") -> None:
        """A dropped stream's queue, let go at the next subscription or event: called by the
        garbage collector, on whatever thread allocates, maybe one holding `_lock`, so it only
        appends (atomic) and never takes the lock."""
        self._forgotten.append((request_id, q))

    def _unsubscribe(self, request_id: str, q: "queue.SimpleQueue[Any]") -> None:
        with self._lock:
            self._drop_stream(request_id, q)

    def _drop_forgotten(self) -> None:
        forgotten = self._forgotten  # (under `_lock`)
        while forgotten:
            self._drop_stream(*forgotten.popleft())

    def _drop_stream(self, request_id: str, q: "queue.SimpleQueue[Any]") -> None:
        queues = self._streams.get(request_id)  # (under `_lock`)
        if queues is not None and q in queues:
            queues.remove(q)
            if not queues:
                del self._streams[request_id]

    def status(self, request_id: str) -> Optional[str]:
        """How the latest request with this id ended (None while it is pending or live);
        KeyError for an id never submitted (or, without a recorder, one that has ended)."""
        if request_id in self._live:
            return None
        index = self._record_of.get(request_id)
        if index is None:
            raise KeyError(request_id)
        return self.recorder.finish[index]  # type: ignore[union-attr]

    def open_ids(self) -> list[str]:
        """Ids of requests not yet ended (pending arrivals included), in submission order."""
        return list(self._live)

    @property
    def outstanding(self) -> int:
        """Requests submitted to the scheduler and not ended."""
        return self._outstanding

    def report(self) -> EngineReport:
        if self.recorder is None:
            raise RuntimeError("this engine keeps no record (record=False)")
        return EngineReport(self.recorder, self.now())

    def __repr__(self) -> str:
        clock = type(self._clock).__name__ if self._clock is not None else None
        return (f"<Engine {type(self.scheduler).__name__} on {type(self.host).__name__}: "
                f"clock={clock}, depth={self._depth}, open={len(self._live)}, "
                f"outstanding={self._outstanding}, in_flight={len(self._inflight)}, "
                f"iterations={self.iterations}{', running' if self._thread is not None else ''}>")

    # -- running ------------------------------------------------------------------------------

    def run(self, requests: Optional[Iterable[Any]] = None) -> _Report:
        """Run until every request has ended and no arrival is left; returns the report (None
        for an engine built with `record=False`). Not from inside a step (RuntimeError)."""
        if self._stepping:
            raise RuntimeError(_REENTRY)
        if requests is not None:
            self.add_requests(requests)
        previous, self._thread = self._thread, threading.get_ident()
        self._ensure_started()
        try:
            while True:
                if self.step():
                    continue
                nxt = self._next_arrival()
                if nxt is None:
                    if self._inbox:
                        continue
                    break
                self._wait(nxt)
        finally:
            self._thread = previous
        # (_Report is EngineReport exactly when the engine records: see the overloads above)
        return self.report() if self.recorder is not None else None  # type: ignore[return-value]

    def run_forever(self, idle_wait_s: float = 0.05) -> None:
        """Serve until `stop()`: idle, wait for submissions from other threads."""
        if self._stepping:
            raise RuntimeError(_REENTRY)
        previous, self._thread = self._thread, threading.get_ident()
        self._ensure_started()
        try:
            while not self._stop:
                if self.step():
                    continue
                nxt = self._next_arrival()
                self._wake.clear()
                if self._inbox or self._stop:
                    continue
                if nxt is None:
                    self._wake.wait(idle_wait_s)
                elif self._clock is not None:
                    # The wake event was cleared before `_stop` and the inbox were read: a
                    # stop or a submission since has set it, and the wait returns at once.
                    self._clock.wait_until(nxt, self._wake)
            self._stop = False  # that stop is used up: `run_forever` can be started again
        finally:
            self._thread = previous

    @contextmanager
    def driven_here(self) -> Iterator[None]:
        """Make the calling thread the engine's for the block: a runner that calls
        `run_forever` again and again on one thread, and recovers from a failed step between
        the calls, holds the engine meanwhile, so that other threads' submits and cancels
        wait in the inbox instead of running on theirs."""
        previous, self._thread = self._thread, threading.get_ident()
        try:
            yield
        finally:
            self._thread = previous

    def drain_inbox(self) -> None:
        """Take in what other threads submitted or cancelled and the engine has not read yet
        (on the engine's thread, or while `run_forever` is not running): a caller stopping
        the engine does this before ending what is open, so that a submission that raced the
        stop is among `open_ids()`."""
        if not self._on_engine_thread():
            raise RuntimeError("drain_inbox runs on the engine's thread or while run_forever "
                               "is not running")
        self._drain()

    # `step()` (engine/step.py): inbox, due arrivals, hook, one iteration.

    # -- internals ----------------------------------------------------------------------------

    def _on_engine_thread(self) -> bool:
        return self._thread is None or self._thread == threading.get_ident()

    @staticmethod
    def _as_request(request: Any) -> RequestLike:
        # The engine's own Request first: a runtime check against the RequestLike protocol
        # inspects every member (tens of microseconds per request on the server's loop).
        if type(request) is Request and type(request.id) is str:
            return request
        if isinstance(request, Sequence):
            return _SequenceRequest(request, None)
        if not isinstance(request, RequestLike):
            raise TypeError(f"a request needs id, arrival_us and to_sequence(); "
                            f"{type(request).__name__} lacks some")
        if not isinstance(request.id, str):
            raise TypeError(f"request id must be a str, got {type(request.id).__name__}")
        return request

    def _new_entry(self, request: Any, arrival: float) -> _Entry:
        rid = request.id
        with self._lock:
            if rid in self._live:
                raise DuplicateSequence(rid)
            record = -1
            if self.recorder is not None:
                record = self.recorder.add_request(rid, arrival)
                self._record_of[rid] = record
            entry = _Entry(request, record)
            self._live[rid] = entry
        return entry

    def _accept(self, request: Any, *, raise_errors: bool) -> None:
        self._ensure_started()
        arrival = request.arrival_us  # checked by `submit`
        now = self.now()
        if arrival is None:
            arrival = now
        entry = self._new_entry(request, arrival)
        entry.quiet = not raise_errors  # from the inbox: refused by events alone
        if arrival > now:
            heapq.heappush(self._pending, (arrival, next(self._seq), entry))
            self._update_next_due()
        else:
            self._submit(entry, raise_errors=raise_errors)

    def _pull_source(self) -> None:
        assert self._source is not None
        nxt = next(self._source, None)
        if nxt is not None:
            try:
                nxt = self._as_request(nxt)  # (a TypeError naming what it lacks)
                arrival = self._check_arrival(nxt)
                if arrival is not None and arrival < self._last_source_arrival:
                    raise ValueError(f"request stream is not in arrival order at {nxt.id!r}")
            except (TypeError, ValueError):
                # The stream is dropped from this request on (those taken before it go on),
                # so that a later run can take another.
                self._source = self._source_next = None
                self._update_next_due()
                raise
            if arrival is None:
                arrival = float("-inf")
            self._last_source_arrival = arrival
        else:
            self._source = None  # exhausted: a later run may bring another
        self._source_next = nxt
        self._update_next_due()

    def _update_next_due(self) -> None:
        due = self._pending[0][0] if self._pending else float("inf")
        src = self._source_next
        if src is not None:
            due = min(due, float("-inf") if src.arrival_us is None else src.arrival_us)
        self._next_due = due

    def _next_arrival(self) -> Optional[float]:
        times = []
        if self._pending:
            times.append(self._pending[0][0])
        if self._source_next is not None:
            nxt = self._source_next.arrival_us
            times.append(self.now() if nxt is None else nxt)
        return min(times) if times else None

    def _wait(self, t_us: float) -> None:
        if self._clock is None:
            if self._pending:  # refused where they come in (`_check_arrival`, `clock`)
                raise RuntimeError("an engine without a clock has requests waiting for their "
                                   "arrival times; none would ever arrive")
            return
        self._wake.clear()
        if self._inbox:
            return
        self._clock.wait_until(t_us, self._wake)

    def _submit_due(self) -> None:
        now = self.now()
        while True:
            src = self._source_next
            src_t = None if src is None else (now if src.arrival_us is None else src.arrival_us)
            heap_t = self._pending[0][0] if self._pending else None
            if src_t is not None and src_t <= now and (heap_t is None or src_t <= heap_t):
                try:  # taken first, so that a bad request after it cannot lose it
                    try:
                        entry = self._new_entry(src, src_t)
                    except DuplicateSequence as exc:
                        self._refuse_duplicate(src, src_t, exc)
                    else:
                        self._submit(entry, raise_errors=False, arrived=True)
                finally:
                    self._pull_source()
            elif heap_t is not None and heap_t <= now:
                _, _, entry = heapq.heappop(self._pending)
                self._update_next_due()
                if entry.state == _PENDING:  # not cancelled while pending
                    self._submit(entry, raise_errors=False, arrived=True)
            else:
                return

    def _check_arrival(self, request: Any) -> Optional[float]:
        """`_arrival_of(request)`; ValueError for an arrival above 0 on an engine without a
        clock, whose time stays at 0 (the request would wait for it forever)."""
        arrival = _arrival_of(request)
        if arrival is not None and arrival > 0 and self._clock is None:
            raise ValueError(
                f"request {request.id!r}: arrival_us={arrival:g} on an engine without a clock "
                "(clock=None), whose time stays at 0: it would never arrive (give None or 0, or "
                "build the engine with a clock)")
        return arrival

    def _check_fits(self, seq: Sequence) -> None:
        """RequestNeverFits when `seq`'s reservation exceeds what a memory component holds
        with nothing else admitted (docs/behaviour.md §2.10): it could never be admitted."""
        tokens = seq.admission_tokens
        if isinstance(tokens, int) and tokens < len(seq.prompt_tokens):
            tokens = len(seq.prompt_tokens)  # the scheduler's reservation: never below the prompt
        for component in self._components:
            need = component.reservation_bytes(tokens)
            have = component.available_bytes()
            if need > have:
                raise RequestNeverFits(
                    f"request {seq.id!r} can never be admitted: it reserves {need} bytes of "
                    f"memory component {component.name!r} ({tokens} tokens: its prompt and "
                    f"max_tokens, or its admission_tokens) but the component holds {have}")

    def _refuse_duplicate(self, request: Any, arrival: float, exc: DuplicateSequence) -> None:
        """A request with the id of one still open ends at once: a rejected record of its own
        when the engine records (its error names the duplicate), and nothing said under that
        id, whose listeners and streams are the open request's. `on_reject` is told, else the
        log."""
        rec = self.recorder
        if rec is not None:
            index = rec.add_request(request.id, arrival)
            rec.ended(index, REJECTED, self.now())
            rec.errors[index] = f"{type(exc).__name__}: {exc}"
        if self.on_reject is not None:
            self.on_reject(request, exc)
        else:
            log.warning("request %r was submitted while a request of that id is open; the "
                        "second was refused (rejected)", request.id)

    def _submit(self, entry: _Entry, *, raise_errors: bool, arrived: bool = False) -> None:
        """Give the entry's request to the scheduler (through the host's `prepare_sequence`).
        A refusal ends it as rejected; `raise_errors` (a submit on the engine's thread) raises
        it to the submitter instead of telling it. `arrived`: submitted at its arrival by the
        engine (a stream's request, or a pending one), where a request that can never fit is
        raised after it ended, as the stall it would have become, unless it came from another
        thread."""
        request = entry.request
        entry.request = None  # the scheduler keeps its own copy from here on
        try:
            seq = request.to_sequence()
            ttft_ms = request.ttft_ms if isinstance(request, Request) else None
            if ttft_ms is not None and seq.ttft_deadline is None:  # from its arrival
                arrival = request.arrival_us
                since = self.now() if arrival is None else arrival
                seq.with_deadlines(ttft_deadline=since / 1e6 + ttft_ms / 1e3,
                                   itl_target=seq.itl_target)
            prepare = self.hooks.prepare_sequence
            if prepare is not None:
                seq = prepare(seq)
            if self._components:
                self._check_fits(seq)
            if self._slack_feed is not None:  # set only with a clock
                self._slack_feed.tick()
            self.scheduler.submit(seq)
        except (AdmissionError, TypeError, ValueError) as exc:
            why = exc.reason if isinstance(exc, AdmissionError) else None
            if self.on_reject is not None:
                self._end(entry, REJECTED, error=str(exc), rejection=why)
                self.on_reject(request, exc)
                return
            if raise_errors and not isinstance(exc, QueueFull):
                self._end(entry, REJECTED, error=str(exc), emit=False)
                raise
            self._end(entry, REJECTED, error=f"{type(exc).__name__}: {exc}", rejection=why)
            if arrived and not entry.quiet and isinstance(exc, RequestNeverFits):
                raise  # it has ended: a later run goes on with the others
            return
        except BaseException as exc:
            # Any other error (a host's prepare_sequence failing, an interrupt): the scheduler
            # never took the request, so it ends here, failed (not refused: the request was
            # not at fault), before the error goes on; left pending it would stay open, its
            # id taken and its stream waiting forever.
            self._end(entry, FinishReason.FAILED.value, error=f"{type(exc).__name__}: {exc}",
                      emit=not raise_errors)
            raise
        entry.state = _SUBMITTED
        self._outstanding += 1
        if self._listeners or self._streams:
            self._emit(AcceptEvent(entry.id, self.now()))

    def _drain(self) -> None:
        while self._inbox:
            kind, item = self._inbox.popleft()
            if kind == "submit":
                try:
                    self._accept(item, raise_errors=False)
                except DuplicateSequence as exc:
                    arrival = item.arrival_us
                    self._refuse_duplicate(item, self.now() if arrival is None else arrival,
                                           exc)
            else:
                self._cancel(item)

    def _cancel(self, request_id: str) -> bool:
        entry = self._live.get(request_id)
        if entry is None:
            return False
        if entry.state == _SUBMITTED:
            if not self.scheduler.cancel(request_id):
                return False
            self._outstanding -= 1
            try:
                self._release(request_id, ReleaseReason.CANCELLED)
            finally:  # the scheduler has let it go: it ends whatever the host raised
                self._end(entry, FinishReason.CANCELLED.value)
            return True
        self._end(entry, FinishReason.CANCELLED.value)
        return True

    def _end(self, entry: _Entry, reason: str, error: Optional[str] = None,
             emit: bool = True, rejection: Optional[RejectReason] = None) -> None:
        entry.state = _ENDED
        entry.request = None
        with self._lock:
            del self._live[entry.id]
        now = self.now()
        if self.recorder is not None:
            self.recorder.ended(entry.record, reason, now)
            if error is not None:
                self.recorder.errors[entry.record] = error
        if emit and (self._listeners or self._streams):
            self._emit(FinishEvent(entry.id, reason, now, error, rejection))
        elif self._streams:  # a refusal raised to the submitter: its streams still end
            self._to_streams(FinishEvent(entry.id, reason, now, error, rejection))

    def _emit(self, event: Event) -> None:
        """Tell every listener and the request's stream; a listener that raises does not keep
        the others or the stream from it (the first error is raised after)."""
        error: Optional[BaseException] = None
        for listener in self._listeners:
            try:
                listener(event)
            except Exception as exc:
                error = error or exc
        if self._streams:
            self._to_streams(event)
        if error is not None:
            raise error

    def _to_streams(self, event: Event) -> None:
        with self._lock:
            if self._forgotten:
                self._drop_forgotten()
            queues = self._streams.get(event.request_id)
            if queues is not None and isinstance(event, FinishEvent):
                del self._streams[event.request_id]
        if queues is not None:
            for q in queues:
                q.put(event)

    def _release_victims(self, victims: Iterable[str]) -> None:
        rec = self.recorder
        live = self._live
        if self._observers:
            victims = list(victims)
            for o in self._observers:
                told = getattr(o, "preempted", None)  # optional (observers.py)
                if told is not None and victims:
                    told(victims)
        error: Optional[BaseException] = None
        for rid in victims:  # each one, whatever another's release raises (as `_retire`)
            try:
                self._release(rid, ReleaseReason.PREEMPTED)
            except Exception as exc:
                error = error or exc
            live[rid].voids += 1
            if rec is not None:
                rec.preemptions[self._record_of[rid]] += 1
        if error is not None:
            raise error

    def _measure_memory(self) -> None:
        measure = self.hooks.memory_used
        used = measure() if measure is not None else None
        if used is not None:
            sched = self.scheduler
            self._release_victims(list(sched.preempt_for_component_pressure(list(used))))


class EventStream:
    """The events of one request (`Engine.stream`), iterated until its `FinishEvent`.
    `close()` (or the end of a `with` block, or dropping it) unsubscribes, and a reader
    waiting on another thread then stops: the engine keeps nothing for a stream nobody
    reads."""

    __slots__ = ("request_id", "_queue", "_done", "_close", "_unsubscribe", "__weakref__")

    def __init__(self, request_id: str, q: "queue.SimpleQueue[Any]",
                 forget: Callable[[str, "queue.SimpleQueue[Any]"], None],
                 unsubscribe: Callable[[str, "queue.SimpleQueue[Any]"], None]) -> None:
        self.request_id = request_id
        self._queue = q
        self._done = False
        self._unsubscribe = unsubscribe
        # Dropped unclosed: the engine lets the queue go later (the collector may run this
        # on a thread that holds the engine's lock).
        self._close = weakref.finalize(self, forget, request_id, q)

    def __iter__(self) -> "EventStream":
        return self

    def __next__(self) -> Event:
        if self._done:
            raise StopIteration
        event = self._queue.get()
        if event is _CLOSED:
            self._done = True
            raise StopIteration
        if isinstance(event, FinishEvent):
            self.close()
        return event  # type: ignore[no-any-return]

    def close(self) -> None:
        """Stop listening (no more events are kept for this stream; a reader waiting for
        the next one stops)."""
        if self._close.detach() is not None:  # (once)
            self._unsubscribe(self.request_id, self._queue)
            if not self._done:
                self._queue.put(_CLOSED)
        self._done = True

    def __enter__(self) -> "EventStream":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"EventStream({self.request_id!r}{', closed' if self._done else ''})"


_CLOSED = object()  # put on a stream's queue by `EventStream.close` to wake its reader


def _arrival_of(request: Any) -> Optional[float]:
    """A request's `arrival_us`: None (when submitted) or a finite number of µs; ValueError or
    TypeError otherwise, before the engine takes it (an infinite or NaN arrival would never be
    due, and the run would wait for it forever)."""
    arrival = request.arrival_us
    if arrival is None:
        return None
    if isinstance(arrival, bool) or not isinstance(arrival, numbers.Real):
        raise TypeError(f"request {request.id!r}: arrival_us must be a number of µs or None, "
                        f"got {type(arrival).__name__}")
    if not math.isfinite(as_float(arrival)):
        raise ValueError(f"request {request.id!r}: arrival_us must be finite, got {arrival}")
    return float(arrival)
