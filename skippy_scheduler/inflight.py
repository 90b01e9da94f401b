"""Plans in flight: filling deferred input tokens from earlier plans' sampled outputs (§2.11).

A decode row whose input token is still being sampled by an earlier plan holds -1 in the plan's
token arena; the plan's deferred table says where the token will come from: row
`deferred_rows[j]` takes the token that plan step `deferred_source_steps[j]` sampled at work
index `deferred_source_indexes[j]`. A native host fills these on its device; a Python host calls
`resolve_deferred` once the earlier plans have run (their output blocks written) and before it
runs this one.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import Any, Callable, Iterable, Optional, Sequence

import numpy as np

from .types import MalformedOutputs


def resolve_deferred(plan: Any, earlier_plans: Iterable[Any]) -> int:
    """Write every deferred input token of `plan` from `earlier_plans`' output blocks; returns
    how many were written. A source whose output is the end signal (or missing) ended its
    sequence: that row's output will be discarded, and its input is written as token 0 so the
    row is still a valid row for the runtime. Raises ValueError when a source plan is not given,
    and MalformedOutputs when a source's output names a row outside it.
    """
    rows = plan.deferred_rows
    n = len(rows)
    if n == 0:
        return 0
    earlier_plans = list(earlier_plans)
    fill = getattr(plan, "fill_deferred", None)
    if (fill is not None and all(type(p) is type(plan) for p in earlier_plans)
            and len({int(p.step) for p in earlier_plans}) == len(earlier_plans)):
        # The C core's plans fill them in C, each source plan's entries in one loop.
        if sum(fill(p) for p in earlier_plans) == n:
            return n
    sources = {int(p.step): p for p in earlier_plans}
    steps = np.asarray(plan.deferred_source_steps)
    indexes = np.asarray(plan.deferred_source_indexes).astype(np.intp)
    targets = np.asarray(plan.row_offsets)[np.asarray(rows)]  # a decode row's one token
    tokens = plan.tokens
    first = int(steps[0])
    # NOTE: the usual case (always at depth 2) is one source, the plan made just before.
    groups = [first] if n == 1 or (steps == first).all() else np.unique(steps).tolist()
    for step in groups:
        source = sources.get(int(step))
        if source is None:
            raise ValueError(f"deferred inputs come from plan step {step}, which is not among "
                             "the earlier plans given")
        out = source.outputs
        k = int(out.count)
        rows_of = len(source)
        named = np.asarray(out.request_indexes[:k], dtype=np.intp)
        if k > rows_of:
            raise MalformedOutputs(f"outputs.count {k} exceeds the plan's {rows_of} rows")
        if k and (named.min() < 0 or named.max() >= rows_of):
            bad = int(named[(named < 0) | (named >= rows_of)][0])
            raise MalformedOutputs(f"output names work index {bad}, the plan has {rows_of} "
                                   "rows")
        # Token sampled at each work index of the source plan; -1 where nothing was sampled.
        sampled = np.full(rows_of, -1, dtype=np.int32)
        sampled[named] = out.predicted_tokens[:k]
        if len(groups) == 1:
            values = sampled[indexes]
            tokens[targets] = np.maximum(values, 0)
        else:
            mine = steps == step
            tokens[targets[mine]] = np.maximum(sampled[indexes[mine]], 0)
    return n


class StampedFuture(Future[Any]):
    """A worker's handle: a `concurrent.futures.Future` that also says when its execution
    ended (`ended_ns`, `time.perf_counter_ns()`; 0 until then), which can be earlier than
    when it is said done (`HostWorker(hold_until_launch=True)`). The engine charges a plan to
    that end (engine/contract.py, `ExecutionHandle`)."""

    ended_ns = 0


class HostWorker:
    """A host's one worker thread, running its plans one at a time in the order started: the
    `execute_async` (`start`) and `execute_after` (`after`) of a host whose `execute` must not
    run twice at once (a llama.cpp context).

    `after(plan, earlier)` queues the plan behind those already started, its deferred inputs
    to be filled from `earlier` (`resolve_deferred`), so the engine may start step N+1 while
    N runs and the device does not wait for the engine in between. The inputs are filled
    while the plans they come from are still live (the engine completes a plan only once its
    handle is done): by the worker, when the plan just before this one ends and before its
    handle says so, or at once by the caller when nothing is queued or running. When the plan
    a deferred input comes from failed, the plan is not run and its handle raises.

    `hold_until_launch`: when a plan ends with the next one already queued, its handle is
    said done only once the next one's execution calls `launching()` (the host: just before it
    blocks in the device's call with the GIL given up, or, on a device that computes apart
    from the host, just after the call that queued the step), or ends without calling it. The
    engine thread, waiting on that handle, would otherwise wake as the plan ends and complete
    it and plan the one after in Python while this thread stages the next plan, both wanting
    the GIL (and, with the cores taken, a core), so the device would wait for the two of them.
    The handle's `ended_ns` (`time.perf_counter_ns()`) is the plan's own end either way, for the
    engine's measure. A host that never calls `launching()` must leave it off: its plans'
    handles would then be said done one plan late.
    """

    def __init__(self, execute: Callable[[Any], Any], name: str, *,
                 hold_until_launch: bool = False) -> None:
        self._execute = execute
        self._name = name
        self._hold = hold_until_launch
        self._held: Optional[tuple[_Job, Any]] = None  # a plan's result, until the next launches
        self._ident: Optional[int] = None  # the worker thread's
        self._cv = threading.Condition()
        self._queue: deque[_Job] = deque()
        self._busy = False
        self._closing = False
        self._thread: Optional[threading.Thread] = None
        # The last plan whose execution raised, and its step: a later plan reading from that
        # plan (that object, that step; another scheduler numbers its steps from 0 again)
        # is not run. A plan started behind nothing (`start`: a chain begun again, by this
        # engine after its recovery or by another) lets it go.
        self._failed: Optional[tuple[Any, int]] = None
        self.released = False  # whether the last `launching()` handed a held plan out

    def start(self, plan: Any) -> "Future[Any]":
        return self._enqueue(_Job(plan, None))

    def after(self, plan: Any, earlier: Sequence[Any]) -> "Future[Any]":
        return self._enqueue(_Job(plan, list(earlier)))

    def call(self, fn: Callable[[], Any]) -> "Future[Any]":
        """Run `fn()` on the worker behind the plans started (what must happen with the
        device idle, between two of them: the engine's releases)."""
        job = _Job(None, None)
        job.fn = fn
        return self._enqueue(job)

    def launching(self) -> None:
        """Hand out the plan before the one now executing, if its result is held (called on
        the worker thread by the host as the device starts the one now executing).
        `released` says whether the last call handed one out."""
        held = self._held
        self.released = False
        if held is not None and threading.get_ident() == self._ident:
            self._held = None
            self.released = True
            held[0].future.set_result(held[1])

    def next_plan(self, wait_s: float = 0.0) -> Optional[tuple[Any, int]]:
        """The plan queued to run next on this worker and the number of calls queued before
        it (they run first), or None (no plan queued, or the next one will not run): for the
        host to stage it while the device runs the one now executing (called on the worker
        thread; its deferred inputs may not be filled yet, and the calls before it may change
        what it was staged against). With no plan queued yet, waits up to `wait_s` seconds
        for one (the engine, woken by `launching()`, may be making it)."""
        if threading.get_ident() != self._ident:
            return None
        deadline = None
        with self._cv:
            while True:
                calls = 0
                for job in self._queue:
                    if job.fn is None:
                        return None if job.error is not None else (job.plan, calls)
                    calls += 1
                if wait_s <= 0 or self._closing:
                    return None
                now = time.monotonic()
                if deadline is None:
                    deadline = now + wait_s
                if now >= deadline:
                    return None
                self._cv.wait(deadline - now)

    def close(self) -> None:
        """Run what was started, then end the thread (a later start makes a new one)."""
        with self._cv:
            thread, self._thread = self._thread, None
            self._closing = True
            self._cv.notify()
        if thread is not None:
            thread.join()
        with self._cv:
            self._closing = False

    def _enqueue(self, job: "_Job") -> "Future[Any]":
        with self._cv:
            if self._closing:  # a second thread would run plans beside the closing one's
                raise RuntimeError("the host's worker is closing")
            if job.earlier is None and job.plan is not None:
                self._failed = None
            if job.earlier is not None and not self._queue and not self._busy:
                self._fill(job)  # the plans it reads from have all run
            self._queue.append(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self._name,
                                                daemon=True)
                self._thread.start()
            self._cv.notify()
        return job.future

    def _fill(self, job: "_Job") -> None:
        """Fill `job`'s deferred inputs, or mark it failed (under the lock)."""
        plan, earlier = job.plan, job.earlier
        failed = self._failed
        if failed is not None and earlier and any(
                p is failed[0] and int(p.step) == failed[1] for p in earlier):
            job.error = RuntimeError(f"plan step {int(plan.step)} was not run: plan step "
                                     f"{failed[1]}, whose samples are its inputs, failed")
            return
        job.filled = True
        if earlier and plan.deferred_rows.size:
            try:
                resolve_deferred(plan, earlier)
            except BaseException as exc:
                job.error = exc

    def _loop(self) -> None:
        cv = self._cv
        self._ident = threading.get_ident()
        while True:
            with cv:
                while not self._queue and not self._closing:
                    cv.wait()
                if not self._queue:
                    return
                job = self._queue.popleft()
                self._busy = True
            result: Any = None
            error = job.error
            if error is None:
                try:
                    result = self._execute(job.plan) if job.fn is None else job.fn()
                except BaseException as exc:
                    error = exc
            ended = time.perf_counter_ns()
            self.launching()  # the plan before, if held: this one never launched
            with cv:
                self._busy = False
                if error is not None and job.plan is not None:
                    self._failed = (job.plan, int(job.plan.step))
                nxt = self._queue[0] if self._queue else None
                if nxt is not None and nxt.earlier is not None and not nxt.filled \
                        and nxt.error is None:
                    self._fill(nxt)  # before this plan is seen done: its outputs are live
                hold = (self._hold and error is None and job.fn is None and nxt is not None
                        and nxt.fn is None and nxt.error is None)
            job.future.ended_ns = ended
            if error is not None:
                job.future.set_exception(error)
            elif hold:
                self._held = (job, result)
            else:
                job.future.set_result(result)


class _Job:
    __slots__ = ("plan", "earlier", "future", "filled", "error", "fn")

    def __init__(self, plan: Any, earlier: Optional[list[Any]]) -> None:
        self.plan = plan
        self.earlier = earlier
        self.fn: Optional[Callable[[], Any]] = None  # a call, not a plan
        self.future = StampedFuture()
        self.filled = False
        self.error: Optional[BaseException] = None


__all__ = ["HostWorker", "StampedFuture", "resolve_deferred"]
