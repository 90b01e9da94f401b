"""`inflight.HostWorker`: a host's one worker thread for plans in flight back to back
(`execute_async` / `execute_after`, engine/contract.py `ChainingHost`)."""
from __future__ import annotations

import gc
import threading
import time
import weakref
from concurrent.futures import Future
from types import SimpleNamespace

import numpy as np
import pytest

from skippy_scheduler import inflight
from skippy_scheduler.inflight import HostWorker


class _Plan(SimpleNamespace):
    """A plan's step and deferred rows (a class of its own: weakly referable)."""


def _plan(step: int, deferred: int = 0) -> SimpleNamespace:
    return _Plan(step=step, deferred_rows=np.zeros(deferred, dtype=np.int32))


class _Device:
    """An `execute` that records the plans it ran; plan steps in `gates` wait for their event
    first, those in `fail` raise."""

    def __init__(self, gates=(), fail=()) -> None:
        self.ran: list[int] = []
        self.gates = {step: threading.Event() for step in gates}
        self.fail = set(fail)

    def __call__(self, plan) -> int:
        gate = self.gates.get(plan.step)
        if gate is not None:
            assert gate.wait(10)
        if plan.step in self.fail:
            raise RuntimeError(f"device lost at {plan.step}")
        self.ran.append(plan.step)
        return plan.step


def test_plans_run_one_at_a_time_in_the_order_started():
    device = _Device(gates=[1])
    worker = HostWorker(device, "test-worker")
    try:
        futures = [worker.start(_plan(1)), worker.after(_plan(2), [_plan(1)]),
                   worker.start(_plan(3))]
        device.gates[1].set()
        assert [f.result(10) for f in futures] == [1, 2, 3]
        assert device.ran == [1, 2, 3]
    finally:
        worker.close()


def test_deferred_inputs_are_filled_before_the_plan_they_come_from_is_seen_done(monkeypatch):
    # Plan 2 is queued while plan 1 runs: its inputs are filled on the worker when 1 ends,
    # before 1's handle is done (after which the engine may complete plan 1 and its outputs
    # are gone).
    filled: list[tuple[int, bool]] = []
    first: Future = Future()

    def fill(plan, earlier) -> int:
        filled.append((plan.step, first.done()))
        return len(plan.deferred_rows)

    monkeypatch.setattr(inflight, "resolve_deferred", fill)
    device = _Device(gates=[1])
    worker = HostWorker(device, "test-worker")
    try:
        one = worker.start(_plan(1))
        one.add_done_callback(lambda f: first.set_result(None))
        two = worker.after(_plan(2, deferred=3), [_plan(1)])
        device.gates[1].set()
        assert two.result(10) == 2
        assert filled == [(2, False)]
        # Nothing queued or running: the caller fills at once (the earlier plan has run).
        assert worker.after(_plan(3, deferred=1), [_plan(2)]).result(10) == 3
        assert filled[-1][0] == 3
    finally:
        worker.close()


def test_a_plan_whose_inputs_come_from_a_failed_plan_is_not_run():
    device = _Device(gates=[1], fail=[1])
    worker = HostWorker(device, "test-worker")
    try:
        # The plans it reads from are the plans started (the engine's own objects).
        p1, p2 = _plan(1), _plan(2, deferred=1)
        one = worker.start(p1)
        two = worker.after(p2, [p1])
        three = worker.after(_plan(3, deferred=1), [p2])
        device.gates[1].set()
        with pytest.raises(RuntimeError, match="device lost at 1"):
            one.result(10)
        with pytest.raises(RuntimeError, match="plan step 2 was not run: plan step 1"):
            two.result(10)
        with pytest.raises(RuntimeError, match="plan step 3 was not run: plan step 2"):
            three.result(10)
        assert device.ran == []
        assert worker.start(_plan(4)).result(10) == 4  # a fresh start runs
    finally:
        worker.close()


def test_close_runs_what_was_started_and_a_later_start_gets_a_new_thread():
    device = _Device(gates=[1])
    worker = HostWorker(device, "test-worker")
    one = worker.start(_plan(1))
    device.gates[1].set()
    worker.close()
    assert one.done() and one.result() == 1
    assert worker.start(_plan(2)).result(10) == 2
    worker.close()


def test_a_call_runs_between_the_plans_around_it_and_the_next_plan_is_filled_after_it(
        monkeypatch):
    order: list[str] = []
    monkeypatch.setattr(inflight, "resolve_deferred",
                        lambda plan, earlier: order.append(f"fill {plan.step}"))
    device = _Device(gates=[1])
    worker = HostWorker(lambda plan: order.append(f"run {device(plan)}"), "test-worker")
    try:
        worker.start(_plan(1))
        released = worker.call(lambda: order.append("release"))
        last = worker.after(_plan(2, deferred=1), [_plan(1)])
        device.gates[1].set()
        released.result(10)
        last.result(10)
        assert order == ["run 1", "release", "fill 2", "run 2"]
    finally:
        worker.close()


def test_nothing_is_started_while_the_worker_closes():
    device = _Device(gates=[1])
    worker = HostWorker(device, "test-worker")
    worker.start(_plan(1))
    closing = threading.Thread(target=worker.close)
    closing.start()
    for _ in range(1000):  # until close() has begun
        if worker._closing:
            break
        threading.Event().wait(0.001)
    with pytest.raises(RuntimeError, match="closing"):
        worker.start(_plan(2))
    device.gates[1].set()
    closing.join(10)
    assert device.ran == [1]
    assert worker.start(_plan(3)).result(10) == 3  # closed: a later start runs again
    worker.close()


class _Launching:
    """An `execute` that says it launches (`worker.launching()`) unless the plan is in
    `silent`, recording whether the plan before was seen done when this one started; plans in
    `gates` then wait for their event (before launching), those in `fail` raise there."""

    def __init__(self, gates=(), fail=(), silent=()) -> None:
        self.worker: HostWorker | None = None
        self.gates = {step: threading.Event() for step in gates}
        self.fail, self.silent = set(fail), set(silent)
        self.futures: dict[int, Future] = {}
        self.before_done_at_start: dict[int, bool] = {}

    def __call__(self, plan) -> int:
        before = self.futures.get(plan.step - 1)
        if before is not None:
            self.before_done_at_start[plan.step] = before.done()
        gate = self.gates.get(plan.step)
        if gate is not None:
            assert gate.wait(10)
        if plan.step in self.fail:
            raise RuntimeError(f"device lost at {plan.step}")
        if plan.step not in self.silent:
            assert self.worker is not None
            self.worker.launching()
            if before is not None:
                assert before.done()  # said done by the launch, before the device call
        return plan.step


def _held_worker(device: _Launching, hold: bool = True) -> HostWorker:
    worker = HostWorker(device, "test-worker", hold_until_launch=hold)
    device.worker = worker
    return worker


@pytest.mark.parametrize("hold", [True, False])
def test_a_plan_is_said_done_when_the_next_one_launches_and_keeps_its_own_end(hold):
    device = _Launching(gates=[1])
    worker = _held_worker(device, hold)
    try:
        device.futures[1] = one = worker.start(_plan(1))
        device.futures[2] = two = worker.after(_plan(2), [_plan(1)])
        device.gates[1].set()
        assert [one.result(10), two.result(10)] == [1, 2]
        # Plan 2 was queued when 1 ended: with the hold, 1 was held until 2 launched; without
        # it, 1 was said done at its end.
        assert device.before_done_at_start == {2: not hold}
        assert 0 < one.ended_ns <= two.ended_ns
    finally:
        worker.close()


def test_a_plan_with_nothing_queued_behind_it_is_said_done_at_its_end():
    device = _Launching()
    worker = _held_worker(device)
    try:
        device.futures[1] = one = worker.start(_plan(1))
        assert one.result(10) == 1  # no next plan to launch: not held
        device.futures[2] = two = worker.after(_plan(2), [_plan(1)])
        assert two.result(10) == 2 and device.before_done_at_start == {2: True}
    finally:
        worker.close()


def test_a_held_plan_is_said_done_when_the_next_one_ends_without_launching_or_fails():
    for silent, fail in (([2], []), ([], [2])):
        device = _Launching(gates=[1], fail=fail, silent=silent)
        worker = _held_worker(device)
        try:
            device.futures[1] = one = worker.start(_plan(1))
            device.futures[2] = two = worker.after(_plan(2), [_plan(1)])
            device.gates[1].set()
            if fail:
                with pytest.raises(RuntimeError, match="device lost at 2"):
                    two.result(10)
            else:
                assert two.result(10) == 2
            # Held while 2 ran, said done before 2 was (its result or its failure).
            assert device.before_done_at_start == {2: False}
            assert one.done() and one.result() == 1
        finally:
            worker.close()


def test_a_call_behind_a_plan_does_not_hold_it():
    device = _Launching(gates=[1])
    worker = _held_worker(device)
    try:
        device.futures[1] = one = worker.start(_plan(1))
        seen: list[bool] = []
        released = worker.call(lambda: seen.append(one.done()))
        device.futures[2] = two = worker.after(_plan(2), [_plan(1)])
        device.gates[1].set()
        released.result(10)
        assert seen == [True]  # a release runs with the plan before it seen done
        assert two.result(10) == 2
    finally:
        worker.close()


def test_launching_on_another_thread_does_not_release_a_held_plan():
    device = _Launching(gates=[1, 2])
    worker = _held_worker(device)
    try:
        device.futures[1] = one = worker.start(_plan(1))
        device.futures[2] = two = worker.after(_plan(2), [_plan(1)])
        device.gates[1].set()
        for _ in range(10000):  # until plan 2 has started (1 is held: it has not launched)
            if 2 in device.before_done_at_start:
                break
            threading.Event().wait(0.001)
        assert device.before_done_at_start == {2: False}
        worker.launching()  # the test's thread, not the worker's
        assert not one.done()
        device.gates[2].set()
        assert [one.result(10), two.result(10)] == [1, 2]
    finally:
        worker.close()



def test_next_plan_is_what_runs_next_and_only_on_the_worker():
    # What a host may stage while its device runs a plan: the plan queued next with the calls
    # queued before it, not a plan that will not run, and nothing from another thread.
    seen: dict[int, object] = {}
    gate = threading.Event()
    worker: HostWorker

    def execute(plan) -> int:
        if plan.step in (1, 4):
            assert gate.wait(10)
        nxt = worker.next_plan()
        seen[plan.step] = None if nxt is None else (nxt[0].step, nxt[1])
        return plan.step

    worker = HostWorker(execute, "test-worker")
    try:
        p1, p2 = _plan(1), _plan(2)
        futures = [worker.start(p1), worker.after(p2, [p1]), worker.start(_plan(3))]
        assert worker.next_plan() is None  # not the worker thread
        gate.set()
        assert [f.result(10) for f in futures] == [1, 2, 3]
        assert seen == {1: (2, 0), 2: (3, 0), 3: None}
        gate.clear()
        first = worker.start(_plan(4))
        calls = [worker.call(lambda: 0), worker.call(lambda: 1)]
        last = worker.start(_plan(5))
        gate.set()
        assert (first.result(10), last.result(10)) == (4, 5)
        assert [c.result(10) for c in calls] == [0, 1]
        assert seen[4] == (5, 2)  # two calls run before it
    finally:
        worker.close()


def test_a_plan_seen_next_is_not_run_when_the_plan_before_it_fails():
    # A host may have staged plan 2 while plan 1 ran; plan 1 then fails, and plan 2, whose
    # inputs it was to sample, is not run (the host drops what it staged: host.py).
    seen: list[object] = []
    ran: list[int] = []
    gate = threading.Event()
    worker: HostWorker

    def execute(plan) -> int:
        ran.append(plan.step)
        if plan.step == 1:
            assert gate.wait(10)
            seen.append(worker.next_plan())
            raise RuntimeError("device lost")
        return plan.step

    worker = HostWorker(execute, "test-worker")
    try:
        p1 = _plan(1)
        failed = worker.start(p1)
        after = worker.after(_plan(2, deferred=1), [p1])
        gate.set()
        with pytest.raises(RuntimeError, match="device lost"):
            failed.result(10)
        with pytest.raises(RuntimeError, match="plan step 2 was not run"):
            after.result(10)
        assert [(p.step, calls) for p, calls in seen] == [(2, 0)] and ran == [1]
    finally:
        worker.close()


def test_next_plan_waits_a_while_for_a_plan_being_made():
    # The host's launch wakes the engine, which is making the next plan: the worker waits for
    # it up to the time given, and no longer when nothing comes.
    seen: list[object] = []
    waited: list[float] = []
    worker: HostWorker
    started = threading.Event()

    def execute(plan) -> int:
        if plan.step == 1:
            t = time.monotonic()  # (before the test is told: it sleeps 50 ms from then)
            started.set()
            seen.append(worker.next_plan(5.0))  # plan 2 arrives while this waits
            waited.append(time.monotonic() - t)
            t = time.monotonic()
        else:
            t = time.monotonic()
            seen.append(worker.next_plan(0.05))  # nothing more comes
            waited.append(time.monotonic() - t)
        return plan.step

    worker = HostWorker(execute, "test-worker")
    try:
        p1 = _plan(1)
        first = worker.start(p1)
        assert started.wait(10)
        time.sleep(0.05)
        second = worker.after(_plan(2), [p1])
        assert (first.result(10), second.result(10)) == (1, 2)
        assert seen[0] is not None and seen[0][0].step == 2 and seen[1] is None
        assert 0.04 < waited[0] < 4.0  # woken by the plan, not the time limit
        assert 0.04 < waited[1] < 1.0  # the limit
    finally:
        worker.close()


def test_released_says_whether_the_launch_handed_a_held_plan_out():
    flags: dict[int, bool] = {}
    gate = threading.Event()
    worker: HostWorker

    def execute(plan) -> int:
        if plan.step == 1:
            assert gate.wait(10)
        worker.launching()
        flags[plan.step] = worker.released
        return plan.step

    worker = HostWorker(execute, "test-worker", hold_until_launch=True)
    try:
        p1 = _plan(1)
        futures = [worker.start(p1), worker.after(_plan(2), [p1])]
        gate.set()
        assert [f.result(10) for f in futures] == [1, 2]
        assert flags == {1: False, 2: True}  # plan 1 was held until plan 2 launched
    finally:
        worker.close()


def test_a_later_scheduler_s_plan_of_the_failed_step_number_runs():
    """Another scheduler on the same host numbers its steps from 0 again: its plan of the
    failed plan's step number is not that plan, and the plan reading from it runs."""
    device = _Device(fail=[3])
    worker = HostWorker(device, "test-worker")
    try:
        failed = _plan(3)
        with pytest.raises(RuntimeError, match="device lost at 3"):
            worker.start(failed).result(10)
        gone = weakref.ref(failed)
        del failed
        device.fail.clear()
        again = _plan(3)  # the new scheduler's step 3
        assert worker.start(again).result(10) == 3
        assert worker.after(_plan(4), [again]).result(10) == 4
        # A chain begun again lets the failed plan go (a native plan keeps its scheduler).
        gc.collect()
        assert gone() is None
    finally:
        worker.close()
