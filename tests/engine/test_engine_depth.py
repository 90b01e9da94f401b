"""The engine with plans in flight (depth 2 and 3): overlapped execution on a worker thread,
deferred inputs filled from earlier outputs, releases only while the device is idle, and every
request still gets exactly the tokens it gets alone (docs/hosts.md, docs/behaviour.md §2.11)."""
from __future__ import annotations

import random
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from token_model import VOCAB, alone_tokens, run_rows

from skippy_scheduler import MemoryComponent, Scheduler, SchedulerConfig, TwinScheduler
from skippy_scheduler.engine import Engine, Request, VirtualClock
from skippy_scheduler.inflight import HostWorker

class ThreadedModelHost:
    """KV per sequence as lists; `execute_async` runs on one worker thread, like a device."""

    def __init__(self, threaded: bool = True) -> None:
        self.kv: dict[str, list[int]] = {}
        self.pool = ThreadPoolExecutor(max_workers=1) if threaded else None
        self.running = threading.Event()
        self.released: list[str] = []
        if not threaded:
            self.execute_async = None  # type: ignore[assignment]

    def execute(self, plan) -> None:
        self.running.set()
        try:
            run_rows(self.kv, plan)
        finally:
            self.running.clear()

    def execute_async(self, plan):
        return self.pool.submit(self.execute, plan)

    def release(self, sequence_id: str, reason: object = None) -> None:
        assert not self.running.is_set(), "released while a plan executes"
        self.kv.pop(sequence_id, None)
        self.released.append(sequence_id)


class ChainedModelHost(ThreadedModelHost):
    """The same, with `execute_after`: plan N+1 queued on the worker behind N, its deferred
    inputs filled there (`inflight.HostWorker`), as the llama.cpp host does."""

    def __init__(self) -> None:
        super().__init__(True)
        self.pool.shutdown()
        self.pool = None
        self.worker = HostWorker(self.execute, "chained-model")
        self.chained = 0
        self.calls_after = 0  # the engine's releases, between two plans on the worker

    def execute_async(self, plan):
        return self.worker.start(plan)

    def execute_after(self, plan, earlier):
        self.chained += 1
        return self.worker.after(plan, earlier)

    def call_after(self, fn):
        self.calls_after += 1
        return self.worker.call(fn)


def _host(kind):
    return ChainedModelHost() if kind == "chained" else ThreadedModelHost(kind == "threaded")


def _close(host):
    if isinstance(host, ChainedModelHost):
        host.worker.close()
    elif host.pool is not None:
        host.pool.shutdown()


def _requests(rng, n):
    return [Request(f"q{i}", [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 20))],
                    rng.randrange(1, 12), arrival_us=0) for i in range(n)]


@pytest.mark.parametrize("impl", [Scheduler, TwinScheduler], ids=["native", "twin"])
@pytest.mark.parametrize("depth", [1, 2, 3])
@pytest.mark.parametrize("kind", ["inline", "threaded", "chained"])
def test_depth_runs_give_alone_tokens_with_cancels_and_preemption(impl, depth, kind):
    for seed in range(6):
        rng = random.Random(seed)
        requests = _requests(rng, 8)
        config = SchedulerConfig(max_active_sequences=4, max_tokens_per_iteration=24,
                                 prefill_chunk_tokens=8, max_inflight_plans=depth,
                                 mixed_prefill_decode=seed % 2 == 1,
                                 memory_components=[MemoryComponent("kv", 10**6, 0, 1, 0)])
        host = _host(kind)
        scheduler = impl(config)
        cancelled = set()

        def chaos(engine):
            if rng.random() < 0.04 and engine.open_ids():
                rid = rng.choice(engine.open_ids())
                if engine.cancel(rid):
                    cancelled.add(rid)
            if rng.random() < 0.06:
                engine.preempt([10**7])
                engine.preempt([0])

        engine = Engine(scheduler, host, clock=VirtualClock(), before_step=chaos,
                        max_iterations=10_000)
        report = engine.run(requests)
        for req, rec in zip(requests, report.records):
            want = alone_tokens(req.prompt_tokens, req.max_tokens)
            if rec.finish_reason == "cancelled":
                assert req.id in cancelled and rec.tokens == want[:len(rec.tokens)]
            else:
                assert rec.tokens == want, (seed, depth, req.id, rec.finish_reason)
                assert rec.finish_reason == ("length" if len(want) == req.max_tokens else "stop")
        assert scheduler.live_plans == 0 and engine.outstanding == 0
        assert host.kv == {}, "every sequence's state was released"
        if kind == "chained":  # queued behind the plan running, at depth 2 only
            assert (host.chained > 0) == (depth == 2)
            assert (host.calls_after > 0) == (depth == 2)
        _close(host)


@pytest.mark.parametrize("kind", ["threaded", "chained"])
def test_depth_two_really_overlaps_and_defers(kind):
    rng = random.Random(3)
    requests = _requests(rng, 6)
    config = SchedulerConfig(max_active_sequences=6, max_tokens_per_iteration=64,
                             max_inflight_plans=2)
    host = _host(kind)
    deferred = []
    engine = Engine(Scheduler(config), host, clock="wall",
                    on_plan=lambda plan, start, duration: deferred.append(len(plan.deferred_rows)))
    report = engine.run(requests)
    assert sum(deferred) > 10  # decode rows fed from the previous plan's samples
    for req, rec in zip(requests, report.records):
        assert rec.tokens == alone_tokens(req.prompt_tokens, req.max_tokens)
    _close(host)


class _FailsAt:
    """Mixed into a model host: its `fail_at`-th execution raises (the device is lost)."""

    fail_at = 0
    calls = 0

    def execute(self, plan) -> None:
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("device lost")
        super().execute(plan)


class FailingHost(_FailsAt, ThreadedModelHost):
    def __init__(self, fail_at: int) -> None:
        super().__init__(True)
        self.fail_at = fail_at


class ChainedFailingHost(_FailsAt, ChainedModelHost):
    def __init__(self, fail_at: int) -> None:
        super().__init__()
        self.fail_at = fail_at


@pytest.mark.parametrize("impl", [Scheduler, TwinScheduler], ids=["native", "twin"])
@pytest.mark.parametrize("chained", [False, True], ids=["threaded", "chained"])
def test_a_failed_execution_aborts_its_plans_and_nothing_is_lost(impl, chained):
    # Chained, the plan queued behind the failed one is not run (its inputs would come from
    # the failed plan): running it would write wrong state, and the tokens would differ.
    rng = random.Random(9)
    requests = _requests(rng, 5)
    config = SchedulerConfig(max_active_sequences=5, max_tokens_per_iteration=32,
                             max_inflight_plans=2)
    host = ChainedFailingHost(fail_at=4) if chained else FailingHost(fail_at=4)
    scheduler = impl(config)
    engine = Engine(scheduler, host, clock=VirtualClock())
    with pytest.raises(RuntimeError, match="device lost"):
        engine.run(requests)
    assert scheduler.live_plans == 0 and scheduler.metrics().aborted_plans >= 1
    report = engine.run()  # the host recovered: the lost work is planned again
    for req, rec in zip(requests, report.records):
        assert rec.tokens == alone_tokens(req.prompt_tokens, req.max_tokens), req.id
    _close(host)
