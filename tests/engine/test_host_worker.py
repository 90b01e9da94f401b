"""`inflight.HostWorker`: a host's one worker thread for plans in flight back to back
(`execute_async` / `execute_after`, engine/contract.py `ChainingHost`)."""
from __future__ import annotations

import threading
from concurrent.futures import Future
from types import SimpleNamespace

import numpy as np
import pytest

from skippy_scheduler import inflight
from skippy_scheduler.inflight import HostWorker


def _plan(step: int, deferred: int = 0) -> SimpleNamespace:
    return SimpleNamespace(step=step, deferred_rows=np.zeros(deferred, dtype=np.int32))


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
        one = worker.start(_plan(1))
        two = worker.after(_plan(2, deferred=1), [_plan(1)])
        three = worker.after(_plan(3, deferred=1), [_plan(2)])
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
