"""The engine's events under listeners and threads that misbehave: a second request with an
open request's id leaves that request's stream and events alone; a listener that cancels
another request mid-plan sees nothing of it after its FinishEvent; a listener that raises does
not leave requests open; listeners and streams added from several threads at once are told
each token once; a stop before `run_forever` is kept; two streams of one id both end."""
from __future__ import annotations

import threading
import time

from skippy_scheduler import SchedulerConfig
from skippy_scheduler.engine import (CostModelHost, Engine, FinishEvent, Request, TokenEvent)


class SlowHost(CostModelHost):
    def execute(self, plan):  # type: ignore[no-untyped-def]
        time.sleep(0.002)
        return super().execute(plan)


def test_a_second_request_with_an_open_id_leaves_the_open_one_alone(impl):
    refused: list = []
    engine = Engine(impl(), SlowHost(), on_reject=lambda req, exc: refused.append(req.id))
    ends: list = []
    engine.add_listener(lambda ev: isinstance(ev, FinishEvent) and ends.append(ev.reason))
    thread = threading.Thread(target=engine.run_forever, daemon=True)
    thread.start()
    try:
        events = engine.stream("x")
        engine.submit(Request("x", [1, 2], 20))
        engine.submit(Request("x", [1, 2], 20))  # from this thread: through the inbox
        got = list(events)
    finally:
        engine.stop()
        thread.join(30)
    tokens = [e for e in got if isinstance(e, TokenEvent)]
    assert len(tokens) == 20 and isinstance(got[-1], FinishEvent)
    assert got[-1].reason == "length" and ends == ["length"] and refused == ["x"]


def test_a_listener_that_cancels_another_request_sees_nothing_of_it_after_its_end(impl):
    for depth in (1, 2):
        engine = Engine(impl(SchedulerConfig(max_inflight_plans=depth)), CostModelHost(),
                        clock=None)
        ended: set = set()
        late: list = []

        def on(ev, engine=engine, ended=ended, late=late):
            if isinstance(ev, TokenEvent) and ev.request_id in ended:
                late.append(ev)
            if isinstance(ev, FinishEvent):
                ended.add(ev.request_id)
            if isinstance(ev, TokenEvent) and ev.request_id == "a":
                engine.cancel("b")

        engine.add_listener(on)
        report = engine.run([Request("a", [1, 2], 3), Request("b", [1, 2], 3)])
        assert late == [], (depth, late)
        assert {r.id: r.finish_reason for r in report.records} == {"a": "length",
                                                                    "b": "cancelled"}


def test_a_listener_that_raises_does_not_leave_requests_open(impl):
    engine = Engine(impl(), CostModelHost(), clock=None)
    boom = [True]
    ends: list = []

    def on(ev):
        if isinstance(ev, FinishEvent):
            ends.append(ev.request_id)
            if boom[0]:
                boom[0] = False
                raise RuntimeError("listener bug")

    engine.add_listener(on)
    try:
        engine.run([Request(f"r{i}", [1, 2], 3) for i in range(3)])
    except RuntimeError as exc:
        assert "listener bug" in str(exc)
    assert engine.open_ids() == [] and engine.outstanding == 0
    assert sorted(ends) == ["r0", "r1", "r2"]  # every FinishEvent was told
    report = engine.run([Request("r3", [1, 2], 2)])  # and the engine goes on
    assert report.records[-1].finish_reason == "length"


def test_listeners_and_streams_added_at_once_are_told_each_token_once(impl):
    for _ in range(50):
        engine = Engine(impl(), CostModelHost(), clock=None)
        barrier = threading.Barrier(8)

        def add(k, engine=engine, barrier=barrier):
            barrier.wait()
            if k % 2:
                engine.stream(f"other{k}")
            else:
                engine.add_listener(lambda ev: None)

        threads = [threading.Thread(target=add, args=(k,)) for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        events = engine.stream("a")
        engine.run([Request("a", [1, 2], 3)])
        assert sum(isinstance(e, TokenEvent) for e in events) == 3


def test_a_submission_that_races_the_stop_is_taken_in_and_ended(impl):
    """Submitted from another thread while the engine is inside a step and stopped right
    after: once `run_forever` returns, `drain_inbox` takes it in, and it is open (so whoever
    stops the engine ends it) instead of sitting unseen in the inbox."""

    class Slower(CostModelHost):
        def execute(self, plan):  # type: ignore[no-untyped-def]
            time.sleep(0.2)
            return super().execute(plan)

    engine = Engine(impl(), Slower())
    thread = threading.Thread(target=engine.run_forever, daemon=True)
    thread.start()
    engine.submit(Request("first", [1, 2], 50))
    time.sleep(0.1)  # inside the first step
    events = engine.stream("late")
    engine.submit(Request("late", [3, 4], 5))
    engine.stop()
    thread.join(30)
    assert not thread.is_alive()
    engine.drain_inbox()
    assert sorted(engine.open_ids()) == ["first", "late"]
    for rid in engine.open_ids():
        assert engine.cancel(rid)
    assert [type(e).__name__ for e in events][-1] == "FinishEvent"
    assert engine.open_ids() == []


def test_a_stop_before_run_forever_begins_ends_it_and_each_stop_ends_one_run(impl):
    """A stop asked before the thread reaches `run_forever` is not lost (the server's stop can
    land there); once used, the next `run_forever` serves again until its own stop."""
    engine = Engine(impl(), CostModelHost())
    engine.stop()
    thread = threading.Thread(target=engine.run_forever, daemon=True)
    thread.start()
    thread.join(10)
    assert not thread.is_alive(), "a stop asked before run_forever began was lost"
    thread = threading.Thread(target=engine.run_forever, daemon=True)
    thread.start()
    try:
        events = engine.stream("r")
        engine.submit(Request("r", [1, 2], 5))
        assert isinstance(list(events)[-1], FinishEvent)
        assert thread.is_alive()
    finally:
        engine.stop()
        thread.join(10)
    assert not thread.is_alive()


def test_two_streams_of_one_id_each_get_every_event(impl):
    engine = Engine(impl(), SlowHost())
    thread = threading.Thread(target=engine.run_forever, daemon=True)
    thread.start()
    try:
        first, second = engine.stream("x"), engine.stream("x")
        engine.submit(Request("x", [1, 2], 6))
        got: dict = {}
        reader = threading.Thread(target=lambda: got.update(first=list(first)), daemon=True)
        reader.start()
        got["second"] = list(second)
        reader.join(30)
    finally:
        engine.stop()
        thread.join(30)
    assert not reader.is_alive(), "the first stream was left blocked"
    for name in ("first", "second"):
        assert [type(e).__name__ for e in got[name]] == (["AcceptEvent"] + ["TokenEvent"] * 6
                                                         + ["FinishEvent"])
    assert got["first"] == got["second"]


def test_a_stream_nobody_reads_holds_nothing(impl):
    """A stream of an id never submitted, once closed or dropped, leaves the engine nothing;
    one closed early leaves its sibling the events."""
    import gc

    engine = Engine(impl(), CostModelHost(), clock=None)
    for i in range(50):
        engine.stream(f"never-{i}")  # dropped at once
    gc.collect()
    with engine.stream("closed") as closed:
        assert repr(closed) == "EventStream('closed')"
    assert repr(closed) == "EventStream('closed', closed)" and list(closed) == []
    kept = engine.stream("x")
    engine.stream("x").close()
    assert list(engine._streams) == ["x"] and len(engine._streams["x"]) == 1
    engine.submit(Request("x", [1, 2], 3))
    engine.run()
    assert [type(e).__name__ for e in kept] == ["AcceptEvent"] + ["TokenEvent"] * 3 + [
        "FinishEvent"]
    assert engine._streams == {}


def test_a_refusal_raised_to_the_submitter_still_ends_its_streams(impl):
    """On the engine's thread a refused submission raises; a consumer already reading the
    request's stream is told its end instead of waiting forever."""
    import pytest

    from skippy_scheduler.types import AdmissionError

    engine = Engine(impl(), CostModelHost(), clock=None)
    events = engine.stream("bad")
    with pytest.raises(AdmissionError):
        engine.submit(Request("bad", [], 4))  # an empty prompt
    got: list = []
    reader = threading.Thread(target=lambda: got.extend(events), daemon=True)
    reader.start()
    reader.join(10)
    assert not reader.is_alive(), "the stream's consumer was left blocked"
    assert [e.reason for e in got] == ["rejected"] and engine._streams == {}


def test_a_cancel_while_a_runner_holds_the_engine_waits_for_it(impl):
    """`driven_here`: between `run_forever` calls the driving thread still owns the engine,
    so another thread's cancel is queued for it, not run on the canceller's thread."""
    released: list = []

    class Host(CostModelHost):
        def release(self, sequence_id, reason=None):  # type: ignore[no-untyped-def]
            released.append(threading.current_thread().name)
            return super().release(sequence_id, reason)

    engine = Engine(impl(), Host(), clock=None)
    engine.submit(Request("x", [1, 2], 50))
    with engine.driven_here():
        engine.step()
        other = threading.Thread(target=lambda: engine.cancel("x"), name="canceller")
        other.start()
        other.join(10)
        assert released == [] and engine.open_ids() == ["x"]
        engine.drain_inbox()  # takes the queued cancel, on this thread
    assert released == [threading.current_thread().name] and engine.open_ids() == []


def test_a_stream_the_collector_frees_under_the_engines_lock_does_not_deadlock(impl):
    """A stream in a reference cycle is freed by the cyclic collector, which runs on whatever
    thread allocates, one holding the engine's lock included: its finalizer must not take it."""
    import gc

    engine = Engine(impl(), CostModelHost(), clock=None)
    done = threading.Event()

    def churn() -> None:
        for i in range(200):
            s = engine.stream(f"cycle{i}")
            box: list = [s]
            box.append(box)  # a cycle, as a traceback's frame makes
            gc.collect(0)
            del s, box
            for j in range(20):  # allocating under the lock: the collector runs here
                engine.stream(f"other{i}-{j}").close()
        done.set()

    old = gc.get_threshold()
    gc.set_threshold(3, 2, 10)
    try:
        worker = threading.Thread(target=churn, daemon=True)
        worker.start()
        assert done.wait(60), "the engine's lock was taken twice on one thread"
    finally:
        gc.set_threshold(*old)
    gc.collect()
    engine.stream("last").close()  # the forgotten queues go at the next subscription
    assert engine._streams == {}


def test_closing_a_stream_stops_a_reader_waiting_on_another_thread(impl):
    engine = Engine(impl(), CostModelHost(), clock=None)
    events = engine.stream("never")
    got: list = []
    reader = threading.Thread(target=lambda: got.extend(events), daemon=True)
    reader.start()
    time.sleep(0.05)
    events.close()
    reader.join(10)
    assert not reader.is_alive() and got == [] and engine._streams == {}
