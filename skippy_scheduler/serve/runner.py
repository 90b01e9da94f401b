"""The engine on its own thread, and one subscription per request for the event loop.

The event loop never touches the scheduler or the host. It hands requests and cancellations to
the engine's inbox (`Engine.submit` / `Engine.cancel` from another thread) and reads each
request's events from a `Subscription`, which the engine thread fills from an engine listener.
At the end of each step the engine thread hands the loop that step's verdicts and wake-ups in
one callback (docs/measuring.md, "Where a streamed token's time goes"); the subscriptions of
one answer share one `Inbox`, so its consumer waits for all of them at once.

Whether the scheduler took a request or refused it is an engine event: an `AcceptEvent` when
the scheduler holds it, a `FinishEvent("rejected")` whose `rejection` says why (QUEUE_FULL: a
503) when it did not. The `before_step` hook publishes the figures `/metrics` shows
(`EngineStats`, from the host's `host_state`) and runs the calls other threads queued with
`call` or `post` (state snapshots for tests and diagnostics, a staged model's measurements).

Every iteration is timed by a `StepTiming` (engine/step_timing.py; `step_timing`): the hook's
own work, the plan, the host's execution, the events and the completion, folded into the
histograms `/metrics` shows and, with `step_timing.step_log(path)`, one JSON line each.

An exception out of the engine (a host failure) fails every open request with that message,
releases the host's state and restarts the loop: one bad iteration never takes the server down.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Mapping, Optional

from ..engine import (AcceptEvent, Engine, FinishEvent, Host, HostState, Request,
                      SchedulerLike, TokenEvent)
from ..engine.contract import HostOutOfMemory, InterruptibleHost
from ..engine.observers import BaseObserver
from ..engine.step_timing import StepTiming
from ..types import REJECTED, FinishReason, IterationPhase

log = logging.getLogger("skippy_scheduler.serve")

@dataclass(frozen=True)
class EngineStats:
    """What the engine thread last published (at the start of a step)."""

    running: int = 0
    waiting: int = 0
    preemptions: int = 0
    preemptions_priority: int = 0  # those made for priority (the rest: memory pressure)
    prefix_hits: int = 0
    prefix_misses: int = 0
    lanes_in_use: int = 0
    lanes: int = 0
    kv_tokens: int = 0
    kv_capacity: int = 0
    kv_lane_capacity: int = 0  # of those, what the lanes may hold (HostState; 0: all of them)
    iterations: int = 0
    prefill_tokens: int = 0  # prompt tokens prefilled (completed plans)
    restored_tokens: int = 0  # prompt tokens admitted as prefix restores
    recompute_tokens: int = 0  # replay tokens prefilled again (preempted sequences' resumes)
    decoded_tokens: int = 0  # batch entries the host decoded (LlamaHost)
    shared_tokens: int = 0  # entries a fork's KV copy replaced (choices of one prompt)
    kv_copies: int = 0  # the host's KV copies between sequence ids (prefix keeps, restores)
    staged_ahead: int = 0  # plans the host staged while the one before ran (LlamaHost)
    not_staged_ahead: Mapping[str, int] = field(default_factory=dict)  # the others, by why
    slo_relegated: int = 0  # sequences the prefill order put behind for a missed TTFT deadline
    published_s: float = 0.0
    steps: Optional[StepTiming] = None  # the iterations' times (live, not a snapshot)


class Inbox:
    """The wake-up of one consumer on `loop`: the subscriptions of one answer (its choices)
    share it, so the consumer waits for all of them at once, without a task per choice.

    Lock-free under the GIL: the consumer arms the inbox before it looks at its subscriptions'
    items, and the engine thread appends items before it reads the flag (at the end of a step),
    so an item is either seen by the consumer's look or followed by a wake-up. A wake-up that
    finds nothing new (it raced a look that saw the items) only makes the consumer look again.

    A consumer may also set `pump`: at a wake-up that finds the consumer waiting, the pump runs
    first, on the loop, and when it returns True it has taken the new events itself (and armed
    the inbox again, as `wait` does) and the consumer sleeps on; when False the consumer
    wakes. A streamed answer's pump writes the step's tokens without waking its task
    (`stream.sse`).
    """

    __slots__ = ("loop", "_waiter", "_armed", "_queued", "pump")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._waiter: Optional[asyncio.Future[None]] = None
        self._armed = False
        self._queued = False  # in the engine thread's list of this step's wake-ups
        self.pump: Optional[Callable[[], bool]] = None

    def arm(self) -> None:
        """Say the consumer looks at its items next (before it looks: see the class)."""
        self._armed = True

    async def wait(self, subs: Iterable["Subscription"]) -> None:
        """Return when any of `subs` has events to take, or at the next wake-up (which may
        find none: the caller looks and waits again)."""
        self._armed = True
        for sub in subs:
            if sub._items:
                self._armed = False
                return
        waiter = self._waiter = self.loop.create_future()
        try:
            await waiter
        finally:
            self._waiter = None

    def _fire(self) -> None:  # on the loop, from the engine thread's hand-over
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            pump = self.pump
            if pump is not None:
                try:
                    if pump():
                        return
                except Exception as exc:  # events it took are lost: the answer ends with it
                    self.pump = None
                    log.exception("a streamed answer's direct writer failed")
                    waiter.set_exception(exc)
                    return
            waiter.set_result(None)


class Subscription:
    """Events of one request, delivered to an asyncio consumer on `loop`.

    `verdict` resolves to None once the scheduler holds the request, or to the rejecting
    `FinishEvent`. `error` is set when the engine failed underneath the request. The engine
    thread appends events as they happen and hands the loop the step's wake-ups at its end
    (`EngineRunner._flush`): one loop callback per step, whatever the number of tokens.
    """

    __slots__ = ("request_id", "inbox", "_items", "_rejection", "verdict",
                 "error", "out_of_memory", "finished", "arrival_us", "cached_tokens")

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop, arrival_us: float,
                 inbox: Optional[Inbox] = None) -> None:
        self.request_id = request_id
        self.inbox = inbox if inbox is not None else Inbox(loop)
        self._items: deque[Any] = deque()
        self._rejection: Optional[FinishEvent] = None
        self.verdict: asyncio.Future[Optional[FinishEvent]] = loop.create_future()
        self.error: Optional[str] = None
        self.out_of_memory = False  # failed by a step that ran out of device memory (a 503)
        self.finished = False
        self.arrival_us = arrival_us
        # Prompt positions its first admission took from kept KV instead of computing them
        # (a restored prefix, a choice's copy of the first one's prompt): set on the engine
        # thread when that plan has run, before any of its tokens goes out (`_Restores`).
        self.cached_tokens: Optional[int] = None

    def _fire(self) -> None:  # on the loop: the verdict the engine thread decided
        if not self.verdict.done():
            self.verdict.set_result(self._rejection)

    # -- event loop ---------------------------------------------------------------------------

    def take(self) -> list[Any]:
        """The events that arrived since the last take (maybe none)."""
        items = self._items
        return [items.popleft() for _ in range(len(items))]

    async def next_batch(self) -> list[Any]:
        """The events that arrived since the last call (waits for at least one)."""
        while not self._items:
            await self.inbox.wait((self,))
        return self.take()


class EngineRunner:
    """Runs `engine.run_forever()` on a daemon thread and multiplexes its events."""

    def __init__(self, scheduler: SchedulerLike, host: Host, *,
                 idle_wait_s: float = 0.05) -> None:
        self.scheduler = scheduler
        self.host = host
        self.engine = Engine(scheduler, host, clock="wall", record=False,
                             before_step=self._before_step)
        self.engine.add_listener(self._deliver)
        # After the token events, before the hand-over to the loop (which it times as events);
        # it times the before-step hook too.
        self.step_timing = StepTiming(ends_step=False).attach(self.engine)
        self.engine.observers.append(_StepEnd(self._flush, self.step_timing.step_ended))
        self._idle_wait_s = idle_wait_s
        self._subs: dict[str, Subscription] = {}
        self._undecided: dict[str, Subscription] = {}
        self.engine.observers.insert(0, _Restores(self))
        self._lock = threading.Lock()
        self._gate = threading.Lock()  # held around submissions; taken when the loop restarts
        self._calls: deque[tuple[Callable[[], Any], Future[Any]]] = deque()
        # What the loop must be told at the end of the step (wake-ups and verdicts):
        self._touched: deque[tuple[asyncio.AbstractEventLoop, Any]] = deque()
        self._engine_tid: Optional[int] = None
        self._thread: Optional[threading.Thread] = None
        self._started = threading.Event()
        self._running = False
        self._stopping = False
        self.stats = EngineStats()
        self.prefill_progress: Optional[PrefillProgress] = None
        self.crashes = 0
        self.last_crash: Optional[str] = None

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self, timeout_s: float = 10.0) -> None:
        if self._thread is not None:
            raise RuntimeError("the engine runner is already started")
        self._thread = threading.Thread(target=self._main, name="skippy-engine", daemon=True)
        self._thread.start()
        if not self._started.wait(timeout_s):
            raise RuntimeError("the engine thread did not start")

    def stop(self, timeout_s: float = 10.0) -> bool:
        """Stop the loop; requests still open end as cancelled. False when the engine thread
        did not stop within `timeout_s` (it is still inside an iteration: the host must not
        be closed under it). An `InterruptibleHost` (a stage host waiting for a stage) is
        interrupted after the first second of waiting."""
        self._stopping = True
        with self._gate:
            self._running = False
        self.engine.stop()
        if self._thread is not None:
            self._thread.join(min(1.0, timeout_s))
            if self._thread.is_alive() and isinstance(self.host, InterruptibleHost):
                self.host.interrupt("the server is shutting down")
            self._thread.join(max(timeout_s - 1.0, 0.0))
            if self._thread.is_alive():
                # Still inside an iteration: touching the scheduler from here would race it.
                log.error("the engine thread did not stop within %.0f s", timeout_s)
                return False
        self.step_timing.close()
        # The loop has returned: the engine runs on this thread now. What was submitted while
        # it stopped is taken in first, so that it ends too.
        for error in self._fail_all("the server is shutting down", drain=True):
            log.error("ending the open requests at shutdown: %s: %s", type(error).__name__,
                      error, exc_info=error)
        while self._calls:
            _, fut = self._calls.popleft()
            fut.set_exception(RuntimeError("the engine stopped"))
        return True

    @property
    def running(self) -> bool:
        return self._running

    @property
    def unavailable_reason(self) -> str:
        """Why new requests get a 503 while `running` is false (what `/health` says)."""
        return "the engine is not running"

    @property
    def started(self) -> bool:
        """Whether `start` made the engine thread (it may have stopped since)."""
        return self._thread is not None

    def _main(self) -> None:
        self._engine_tid = threading.get_ident()
        # The engine is this thread's between the loop's runs too: a cancel while it
        # recovers waits in the engine's inbox instead of running on the caller's thread.
        with self.engine.driven_here():
            while not self._stopping:
                try:
                    self.engine.run_forever(self._idle_wait_s)
                    return
                except Exception as exc:  # a host or engine failure: fail open work, go on
                    # The server stays up: a request that comes in meanwhile waits in the
                    # engine's inbox, which this thread takes only once it runs again, so the
                    # recovery fails the requests open now and not it (a client answered 500
                    # that asks again at once is not told the engine is down).
                    self.crashes += 1
                    self.last_crash = f"{type(exc).__name__}: {exc}"
                    log.exception("engine iteration failed; failing %d open requests",
                                  len(self.engine.open_ids()))
                    self._recover(self.last_crash,
                                  out_of_memory=isinstance(exc, HostOutOfMemory))

    def _recover(self, message: str, out_of_memory: bool = False) -> None:
        """After a failed step: the plans in flight undone, every open request failed, the
        host's state let go. Each part runs whatever an earlier one raised (a release that
        fails must not leave the other requests hanging or stop the engine thread); what
        raised is logged."""
        self.step_timing.forget_flights()
        errors = self._fail_all(f"the engine failed: {message}", out_of_memory=out_of_memory)
        release_all = self.engine.hooks.release_all
        if release_all is not None:
            try:
                release_all()
            except Exception as exc:
                errors.append(exc)
        for error in errors:
            log.error("recovering from the failed iteration: %s: %s", type(error).__name__,
                      error, exc_info=error)

    def _fail_all(self, message: str, *, drain: bool = False,
                  out_of_memory: bool = False) -> list[BaseException]:
        """Undo the plans in flight (their releases applied), take in the inbox (`drain`),
        fail every open request with `message`, and hand the loop their ends; each part runs
        whatever an earlier one raised (a release that fails must not leave the other requests
        hanging). What raised."""
        errors: list[BaseException] = []
        try:
            self.engine.abandon_flights()
        except Exception as exc:
            errors.append(exc)
        if drain:
            self.engine.drain_inbox()
        for rid in self.engine.open_ids():
            sub = self._subs.get(rid)
            if sub is not None and out_of_memory:
                sub.out_of_memory = True
            try:
                self._fail(rid, message)
            except Exception as exc:
                errors.append(exc)
        self._flush()
        return errors

    def _fail(self, rid: str, message: str) -> None:
        sub = self._subs.get(rid)
        if sub is not None:
            sub.error = message
        if not self.engine.cancel(rid):
            # The scheduler no longer knows it; the subscription still gets its end.
            self._deliver(FinishEvent(rid, FinishReason.FAILED.value, self.engine.now(), message))

    # -- requests (event loop) ----------------------------------------------------------------

    def now_us(self) -> float:
        return self.engine.now()

    def open(self, request: Request, loop: asyncio.AbstractEventLoop,
             inbox: Optional[Inbox] = None) -> Subscription:
        """Subscribe to `request` and hand it to the engine; await `sub.verdict` next.
        Subscriptions given the same `inbox` (on `loop`) are waited for together. An id whose
        subscription is still open is refused (`DuplicateRequest`) before anything changes;
        ids are the caller's to keep unique (serve's are random). A request
        without an arrival time arrives now: its first-token deadline counts from here, not
        from the end of the step the engine is in when it takes the request."""
        arrival = request.arrival_us
        if arrival is None:
            arrival = self.engine.now()
            request = replace(request, arrival_us=arrival)
        sub = Subscription(request.id, loop, arrival, inbox)
        with self._lock:
            if request.id in self._subs:
                # Its subscription would take the open one's place (whose consumer would then
                # wait forever) and the engine would refuse it without a word: nothing changes.
                raise DuplicateRequest(f"a request of id {request.id!r} is open already")
            self._subs[request.id] = sub
            self._undecided[request.id] = sub
        with self._gate:
            try:
                if not self._running:
                    raise EngineUnavailable("the engine is not running")
                self.engine.submit(request)
            except BaseException:  # nothing of it is kept
                with self._lock:
                    self._subs.pop(request.id, None)
                    self._undecided.pop(request.id, None)
                raise
        return sub

    def cancel(self, request_id: str) -> None:
        """Cancel from any thread (a no-op for a request that has ended)."""
        self.engine.cancel(request_id)

    def close(self, sub: Subscription) -> None:
        """The consumer is done with `sub` (after its FinishEvent or after cancelling)."""
        with self._lock:
            self._undecided.pop(sub.request_id, None)
            if sub.finished:
                self._subs.pop(sub.request_id, None)

    def call(self, fn: Callable[[], Any], timeout_s: float = 10.0) -> Any:
        """Run `fn()` on the engine thread between two steps and return its result."""
        return self.post(fn).result(timeout_s)

    def post(self, fn: Callable[[], Any]) -> "Future[Any]":
        """Have the engine thread run `fn()` between two steps, without waiting: the future
        gets its result (or the engine's stop, as a RuntimeError)."""
        fut: Future[Any] = Future()
        self._calls.append((fn, fut))
        self.engine.wake()
        return fut

    def subscription(self, request_id: str) -> Optional[Subscription]:
        """The open subscription of `request_id` (None once its end was delivered)."""
        return self._subs.get(request_id)

    @property
    def open_subscriptions(self) -> int:
        return len(self._subs)

    # -- engine thread ------------------------------------------------------------------------

    def _deliver(self, event: Any) -> None:
        rid = event.request_id
        sub = self._subs.get(rid)
        if sub is None:
            if self.prefill_progress is not None and isinstance(event, FinishEvent):
                self.prefill_progress.done.pop(rid, None)  # (its client closed it first)
            return
        if type(event) is TokenEvent:
            pass
        elif isinstance(event, AcceptEvent):
            with self._lock:
                undecided = self._undecided.pop(rid, None) is not None
            if undecided:
                self._decide(sub, None)
            return
        if isinstance(event, FinishEvent):
            sub.finished = True
            progress = self.prefill_progress
            if progress is not None:
                progress.done.pop(rid, None)
            with self._lock:
                undecided = self._undecided.pop(rid, None) is not None
                self._subs.pop(rid, None)
            if undecided:
                self._decide(sub, event if event.reason == REJECTED else None)
        sub._items.append(event)
        inbox = sub.inbox
        if not inbox._queued:
            inbox._queued = True
            self._touch(inbox.loop, inbox)

    def _decide(self, sub: Subscription, rejection: Optional[FinishEvent]) -> None:
        sub._rejection = rejection
        self._touch(sub.inbox.loop, sub)

    def _touch(self, loop: asyncio.AbstractEventLoop, item: Any) -> None:
        self._touched.append((loop, item))
        if threading.get_ident() != self._engine_tid:
            # Delivered off the engine thread (a cancel while the loop restarts, a stop):
            # no step end will come to hand it over.
            self._flush()

    def _flush(self) -> None:
        """Hand the loop(s) what this step decided: one callback per loop, which resolves the
        verdicts and wakes every consumer waiting for a subscription that got events."""
        touched = self._touched
        if not touched:
            return
        calls: dict[asyncio.AbstractEventLoop, list[Any]] = {}
        while True:  # popleft: atomic against a deliverer on another thread
            try:
                loop, item = touched.popleft()
            except IndexError:
                break
            if isinstance(item, Inbox):
                item._queued = False
                if not item._armed:
                    continue  # its consumer looks at the items before it waits again
                item._armed = False
            calls.setdefault(loop, []).append(item)
        for loop, items in calls.items():
            try:
                loop.call_soon_threadsafe(_fire_all, items)
            except RuntimeError:  # the loop is closed: nobody is left to tell
                pass

    def _before_step(self, engine: Engine) -> None:
        if not self._running:
            with self._gate:
                self._running = not self._stopping
            self._started.set()
        self._flush()  # what the inbox's submissions and cancellations decided
        self._publish()
        while self._calls:
            fn, fut = self._calls.popleft()
            try:
                fut.set_result(fn())
            except BaseException as exc:  # handed to the caller's thread
                fut.set_exception(exc)

    def _publish(self) -> None:
        m = self.scheduler.metrics()
        h = self.host_state()
        self.stats = EngineStats(
            running=m.active_sequences, waiting=m.waiting_sequences, preemptions=m.preempted,
            preemptions_priority=m.preempted_priority,
            prefix_hits=m.prefix_hits, prefix_misses=m.prefix_misses,
            lanes_in_use=len(h.active), lanes=h.lanes, kv_tokens=h.kv_tokens,
            kv_capacity=h.kv_capacity, kv_lane_capacity=h.lane_cells,
            iterations=m.iterations, prefill_tokens=m.prefill_tokens,
            restored_tokens=m.restored_tokens, recompute_tokens=m.recompute_tokens,
            decoded_tokens=h.decoded_tokens, shared_tokens=h.shared_tokens,
            kv_copies=h.kv_copies, staged_ahead=h.staged_ahead,
            not_staged_ahead=h.not_staged_ahead,
            slo_relegated=getattr(m, "slo_relegated", 0),
            published_s=time.monotonic(), steps=self.step_timing)

    def track_prefill(self) -> "PrefillProgress":
        """From now on, keep how far each request's prompt has been prefilled
        (`PrefillProgress`; before the runner starts)."""
        if self.prefill_progress is None:
            self.prefill_progress = PrefillProgress()
            self.engine.observers.insert(0, self.prefill_progress)
        return self.prefill_progress

    def host_state(self, detail: bool = False) -> HostState:
        """The host's figures (engine thread only); zeros for a host that reports none."""
        report = self.engine.hooks.host_state
        return report(detail) if report is not None else HostState(lanes=0, free_lanes=0)

    # -- diagnostics --------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """Everything that must be empty when no request is open (taken on the engine thread)."""

        def take() -> dict[str, Any]:
            snap = self.scheduler.snapshot()
            h = self.host_state(detail=True)
            return {
                "scheduler_active": list(snap.active_ids),
                "scheduler_waiting": list(snap.waiting_ids),
                "engine_open": self.engine.open_ids(),
                "engine_outstanding": self.engine.outstanding,
                "host_active": list(h.active),
                "host_free_lanes": h.free_lanes,
                "host_kv_positions": dict(h.lane_positions),
                "host_samplers": h.samplers,
                "subscriptions": len(self._subs),
                "undecided": len(self._undecided),
            }

        result: dict[str, Any] = self.call(take)
        return result


def _fire_all(items: list[Any]) -> None:
    for item in items:  # each one, whatever another raises: a lost wake-up is a hung answer
        try:
            item._fire()
        except Exception:
            log.exception("waking a consumer failed")


class PrefillProgress(BaseObserver):
    """How far each request's prompt has been prefilled: `done` maps its sequence id to the
    prompt positions its KV covers (a restored prefix included) after the last executed plan
    that prefilled it, from its first chunk; at its first token, the whole prompt. The engine
    thread writes it once per executed plan that carries prompt rows (before the plan's tokens
    go out), drops a request's entry when it is preempted (its KV is gone) and when it ends;
    the event loop only reads single entries (`Slo`, for shedding). Rows of a plan made before
    their request ended or was preempted are left out, as the engine leaves out their samples."""

    def __init__(self) -> None:
        self.done: dict[str, int] = {}

    def executed(self, flight: Any, duration_us: float) -> None:
        plan = flight.plan  # (live until its completion, which comes next)
        prompt_rows = (plan.phases != _DECODE).nonzero()[0]
        if not len(prompt_rows):
            return
        ids = plan.sequence_ids
        ends = plan.row_offsets[1:]
        positions = plan.positions
        done = self.done
        for r in prompt_rows.tolist():
            if not flight.row_current(r):
                continue  # ended or preempted since the plan was made
            done[ids[r]] = int(positions[int(ends[r]) - 1]) + 1

    def preempted(self, ids: list[str]) -> None:
        for sid in ids:
            self.done.pop(sid, None)


_DECODE = IterationPhase.DECODE.value


class _Restores(BaseObserver):
    """Sets each subscription's `cached_tokens` from the plan that first ran its request: the
    restored positions of its new row (usage's `prompt_tokens_details.cached_tokens`). Only a
    plan that admitted something is read; a row of a request ended or preempted since its
    plan was made is left out."""

    def __init__(self, runner: "EngineRunner") -> None:
        self._subs = runner._subs

    def executed(self, flight: Any, duration_us: float) -> None:
        plan = flight.plan
        if not plan.admitted:
            return
        restored = plan.restored_tokens
        ids = plan.sequence_ids
        subs = self._subs
        for r in plan.new_rows.nonzero()[0].tolist():
            sub = subs.get(ids[r])
            if sub is not None and sub.cached_tokens is None and flight.row_current(r):
                sub.cached_tokens = int(restored[r])


class _StepEnd(BaseObserver):
    """The last observer of a step: calls `flush` once the step's events are all out (its
    samples, then the ends its completion decided), then `end` (the step timing's end)."""

    def __init__(self, flush: Callable[[], None], end: Callable[[], None]) -> None:
        self._flush = flush
        self._end = end

    def completed(self, flight: Any, duration_us: float, telemetry: Any) -> None:
        self._flush()
        self._end()


class EngineUnavailable(RuntimeError):
    """The engine loop is not running (starting, restarting after a failure, or stopped)."""


class DuplicateRequest(EngineUnavailable):
    """`EngineRunner.open` was given the id of a request whose subscription is still open
    (a subclass of `EngineUnavailable`, which every caller of `open` handles: refused, and
    nothing of the open request touched)."""
