"""The engine: one loop over a scheduler and a host (docs/hosts.md).

Every test runs on both schedulers (native and twin). Hosts here are small and exact: they
record every release, so a sequence whose runtime state is lost or released twice shows up.
"""
from __future__ import annotations

import threading

import pytest

from skippy_scheduler import (DuplicateSequence, EmptyPrompt, MemoryComponent, SchedulerConfig,
                              Sequence)
from skippy_scheduler.cost_model import LAB_COST
from skippy_scheduler.engine import (AcceptEvent, CostModelHost, Engine, EngineStalled, FinishEvent, Request,
                                     TokenEvent, VirtualClock, percentile)

from counting_host import CountingHost


def _config(**kw) -> SchedulerConfig:
    base = dict(max_active_sequences=4, max_tokens_per_iteration=64, prefill_chunk_tokens=16)
    base.update(kw)
    return SchedulerConfig(**base)


def _requests():
    return [Request("a", list(range(10, 30)), 5, arrival_us=0),
            Request("b", [1, 2, 3], 3, arrival_us=0, priority=1),
            Request("c", list(range(100, 140)), 4, arrival_us=700)]


def test_virtual_runs_are_deterministic_and_complete(impl):
    def once():
        host = CountingHost()
        engine = Engine(impl(_config()), host, clock=VirtualClock(LAB_COST))
        report = engine.run(_requests())
        assert host.holding == set()
        assert sorted(host.released) == ["a", "b", "c"]
        return report

    a, b = once(), once()
    ra, rb = a.records, b.records
    assert [(r.id, r.tokens, r.token_times_us, r.finish_reason) for r in ra] == \
        [(r.id, r.tokens, r.token_times_us, r.finish_reason) for r in rb]
    by = a.by_id()
    assert by["a"].tokens == [30, 31, 32, 33, 34] and by["a"].finish_reason == "length"
    assert by["b"].tokens == [4, 5, 6]
    assert by["c"].tokens == [140, 141, 142, 143]
    assert by["c"].first_scheduled_us >= 700 and by["c"].queue_wait_us >= 0
    for r in ra:
        assert r.ttft_us == r.token_times_us[0] - r.arrival_us
        assert r.finished_us == r.token_times_us[-1]
        assert len(r.itl_us) == len(r.tokens) - 1 and all(g > 0 for g in r.itl_us)
    its = a.iteration_arrays()
    assert a.makespan_us == its["start_us"][-1] + its["duration_us"][-1]
    assert sum(a.phase_mix()) == a.iterations == len(its["rows"])
    s = a.summary()
    assert s["completed"] == 3 and s["generated_tokens"] == 12 and s["finish_length"] == 3
    t = a.timeline()
    assert t.generated.tolist() == [5, 3, 4]
    assert t.first_token_us.tolist() == [r.token_times_us[0] for r in ra]


def test_recorded_and_lean_engines_make_the_same_decisions(impl):
    sched_a, sched_b = impl(_config()), impl(_config())
    full = Engine(sched_a, CountingHost(), clock=VirtualClock())
    lean = Engine(sched_b, CountingHost(), clock=None, record=False)
    for engine in (full, lean):
        for r in _requests()[:2]:
            engine.submit(r)
    while full.step():
        assert lean.step()
    assert not lean.step()
    assert sched_a.metrics() == sched_b.metrics()
    with pytest.raises(RuntimeError, match="no record"):
        lean.report()


def test_finish_reasons_stop_length_failed(impl):
    host = CountingHost(stop_at={"s": 13}, skip="f")
    engine = Engine(impl(_config()), host, clock="virtual")
    events = []
    engine.add_listener(events.append)
    report = engine.run([Request("s", [10], 8), Request("l", [100], 2), Request("f", [50], 3)])
    by = report.by_id()
    assert (by["s"].finish_reason, by["s"].tokens) == ("stop", [11, 12])  # the end signal is no token
    assert (by["l"].finish_reason, by["l"].tokens) == ("length", [101, 102])
    assert (by["f"].finish_reason, by["f"].tokens) == ("failed", [])
    finishes = {e.request_id: e.reason for e in events if isinstance(e, FinishEvent)}
    assert finishes == {"s": "stop", "l": "length", "f": "failed"}
    assert [e.token for e in events if isinstance(e, TokenEvent) and e.request_id == "s"] == [11, 12]
    assert host.holding == set() and sorted(host.released) == ["f", "l", "s"]


def test_cancel_pending_waiting_and_running(impl):
    host = CountingHost()
    engine = Engine(impl(_config(max_active_sequences=1)), host, clock=VirtualClock())
    engine.submit(Request("run", [1, 2], 50, arrival_us=0))
    engine.submit(Request("wait", [3, 4], 5, arrival_us=0))
    engine.submit(Request("later", [5], 5, arrival_us=10**9))
    assert engine.step()
    assert engine.cancel("later") and engine.cancel("wait") and engine.cancel("run")
    assert not engine.cancel("run") and not engine.cancel("nobody")
    assert engine.open_ids() == [] and engine.outstanding == 0
    assert not engine.step()
    report = engine.run()
    assert {r.id: r.finish_reason for r in report.records} == {
        "run": "cancelled", "wait": "cancelled", "later": "cancelled"}
    assert engine.status("run") == "cancelled"
    assert host.holding == set()
    assert sorted(host.released) == ["run", "wait"]  # "later" never reached the scheduler


class PressureHost(CountingHost):
    """Reports the KV cells its sequences hold; one component of `capacity` cells."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity
        self.cells: dict[str, int] = {}
        self.spike = 0

    def execute(self, plan) -> None:
        super().execute(plan)
        ends = plan.row_offsets[1:]
        for r, sid in enumerate(plan.sequence_ids):
            self.cells[sid] = int(plan.positions[ends[r] - 1]) + 1

    def release(self, sequence_id: str, reason: object = None) -> None:
        super().release(sequence_id)
        self.cells.pop(sequence_id, None)

    def memory_used(self):
        return [sum(self.cells.values()) + self.spike]


def test_memory_pressure_preempts_releases_and_recomputes(impl):
    config = _config(memory_components=[MemoryComponent("kv", 200, 0, 1, 0)])
    host = PressureHost(200)
    scheduler = impl(config)

    def spike(engine):
        host.spike = 150 if engine.iterations == 3 else 0

    engine = Engine(scheduler, host, clock=VirtualClock(), before_step=spike)
    report = engine.run([Request(f"r{i}", list(range(i * 50, i * 50 + 30)), 6) for i in range(3)])
    by = report.by_id()
    assert sum(r.preemptions for r in report.records) >= 1
    assert scheduler.metrics().recompute_tokens > 0
    for i in range(3):
        assert by[f"r{i}"].tokens == list(range(i * 50 + 30, i * 50 + 36))
        assert by[f"r{i}"].finish_reason == "length"
    assert host.holding == set() and host.cells == {}


def test_refusals(impl):
    engine = Engine(impl(_config(max_waiting_sequences=2)), CountingHost(), clock=VirtualClock())
    with pytest.raises(EmptyPrompt):
        engine.submit(Request("empty", [], 1))
    assert engine.open_ids() == []
    engine.submit(Request("a", [1], 2))
    with pytest.raises(DuplicateSequence):
        engine.submit(Request("a", [2], 2))
    report = engine.run([Request("b", [1], 2, arrival_us=0), Request("c", [1], 2, arrival_us=0)])
    by = report.by_id()
    assert by["a"].finish_reason == "length"
    # a and b fill the waiting queue (2) before the first plan; c arrives to a full queue.
    assert (by["b"].finish_reason, by["c"].finish_reason) == ("length", "rejected")
    assert "QueueFull" in by["c"].error and by["c"].tokens == []


def test_stalls_and_stream_order_are_errors(impl):
    config = _config(memory_components=[MemoryComponent("kv", 10, 0, 1, 0)])
    engine = Engine(impl(config), CountingHost(), clock=VirtualClock())
    with pytest.raises(EngineStalled):
        engine.run([Request("huge", list(range(100)), 2)])
    engine = Engine(impl(_config()), CountingHost(), clock=VirtualClock())
    with pytest.raises(ValueError, match="arrival order"):
        engine.run([Request("x", [1], 1, arrival_us=50), Request("y", [1], 1, arrival_us=10)])


def test_other_threads_submit_cancel_and_stream(impl):
    engine = Engine(impl(_config()), CostModelHost(token=5), clock="wall")
    worker = threading.Thread(target=engine.run_forever, kwargs={"idle_wait_s": 0.01})
    worker.start()
    try:
        streams = {rid: engine.stream(rid) for rid in ("t0", "t1", "t2")}
        for rid in streams:
            engine.submit(Request(rid, [1, 2, 3], 4 if rid != "t2" else 10**6))
        for rid in ("t0", "t1"):
            events = list(streams[rid])
            assert isinstance(events[0], AcceptEvent)  # the scheduler took it, then tokens
            assert [e.token for e in events if isinstance(e, TokenEvent)] == [5, 5, 5, 5]
            assert isinstance(events[-1], FinishEvent) and events[-1].reason == "length"
        it = streams["t2"]
        assert isinstance(next(it), AcceptEvent)
        assert isinstance(next(it), TokenEvent)
        engine.cancel("t2")
        assert [e.reason for e in it if isinstance(e, FinishEvent)] == ["cancelled"]
    finally:
        engine.stop()
        worker.join(5)
    assert not worker.is_alive()
    assert engine.outstanding == 0


def test_percentile_is_nearest_rank():
    assert percentile([], 50) == 0
    assert percentile([3, 1, 2], 50) == 2
    assert percentile([1, 2, 3, 4], 50) == 2
    assert percentile([1, 2, 3, 4], 99) == 4
    import numpy as np
    assert percentile(np.array([4.0, 1.0, 3.0, 2.0]), 75) == 3.0


def test_engine_refuses_things_that_are_not_schedulers_or_hosts():
    with pytest.raises(TypeError, match="scheduler"):
        Engine(object(), CountingHost())
    from skippy_scheduler import Scheduler
    with pytest.raises(TypeError, match="host"):
        Engine(Scheduler(_config()), object())
    with pytest.raises(ValueError, match="clock"):
        Engine(Scheduler(_config()), CountingHost(), clock="sundial")
    engine = Engine(Scheduler(_config()), CountingHost())
    with pytest.raises(TypeError):
        engine.submit(("x", [1], 2))
