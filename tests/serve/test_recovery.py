"""A failed step is recovered from whatever else fails: with two plans in flight a failure
between a plan's execution and its completion leaves the scheduler no plan the engine forgot;
a host release that raises while the open requests are failed neither hangs them nor stops
the engine thread; a stop with plans in flight leaves nothing behind; a request refused while
it is handed in keeps nothing."""
from __future__ import annotations

import asyncio
import sys
import threading

import pytest

pytest.importorskip("fastapi")
from starlette.testclient import TestClient  # noqa: E402

from skippy_scheduler.engine import Request  # noqa: E402
from skippy_scheduler.serve import ServeSettings  # noqa: E402

sys.path.insert(0, "bench")
from instant_host import FailingHost, InstantHost, build_server  # noqa: E402

BODY = {"model": "instant", "prompt": "hi", "max_tokens": 12}


def _empty(state: dict) -> bool:
    return not (state["scheduler_active"] or state["scheduler_waiting"] or state["engine_open"]
                or state["engine_outstanding"] or state["host_active"]
                or state["subscriptions"] or state["undecided"])


class DetailsFailOnce(InstantHost):
    """A host whose sample reports (read after a plan executed, before it completes) fail
    once."""

    def __init__(self) -> None:
        super().__init__(n_seq_max=2)
        self.calls = 0

    def sample_details(self, plan):  # type: ignore[no-untyped-def]
        self.calls += 1
        if self.calls == 4:
            raise RuntimeError("the sample report failed")
        return None


@pytest.mark.parametrize("inflight", [1, 2])
def test_a_failure_between_execution_and_completion_is_recovered(inflight):
    host = DetailsFailOnce()
    server = build_server(ServeSettings(max_active=2, inflight=inflight), host)
    server.runner.start()
    try:
        with TestClient(server.app) as client:
            first = client.post("/v1/completions", json=BODY)
            assert first.status_code == 500, first.text
            for _ in range(3):  # before the fix, depth 2 answered every later request 500
                again = client.post("/v1/completions", json=BODY)
                assert again.status_code == 200, again.text
            assert client.get("/health").status_code == 200
        assert server.runner.scheduler.live_plans == 0
        assert _empty(server.runner.state())
    finally:
        server.runner.stop()
    assert server.runner.crashes == 1


class LostDevice(FailingHost):
    """A host whose device is lost at its third plan: that step fails, and so does every
    release after it (while the runner fails the open requests)."""

    def __init__(self) -> None:
        super().__init__(3, RuntimeError("device lost"), n_seq_max=2)

    def release(self, sequence_id, reason=None):  # type: ignore[no-untyped-def]
        if self.failed.is_set() and self.plans == 3:
            raise RuntimeError("release on a lost device")
        return super().release(sequence_id, reason)


def test_a_release_that_fails_during_recovery_neither_hangs_nor_stops_the_engine():
    host = LostDevice()
    server = build_server(ServeSettings(max_active=2), host)
    server.runner.start()
    try:
        with TestClient(server.app) as client:
            first = client.post("/v1/completions", json=BODY)
            assert host.failed.is_set()
            assert first.status_code == 500 and "device lost" in first.text
            assert server.runner._thread.is_alive()
            again = client.post("/v1/completions", json=BODY)  # the device is back
            assert again.status_code == 200, again.text
            assert client.get("/health").status_code == 200
        assert _empty(server.runner.state())
    finally:
        server.runner.stop()


class Counting(InstantHost):
    def __init__(self) -> None:
        super().__init__(n_seq_max=4, step_s=0.002)
        self.released: list[str] = []

    def release(self, sequence_id, reason=None):  # type: ignore[no-untyped-def]
        self.released.append(sequence_id)
        return super().release(sequence_id, reason)


def test_a_stop_with_plans_in_flight_leaves_nothing_behind():
    host = Counting()
    server = build_server(ServeSettings(max_active=4, inflight=2), host)
    runner = server.runner
    runner.start()
    answers: list[int] = []
    client = TestClient(server.app)  # (no lifespan: the runner is this test's)

    def ask() -> None:
        answers.append(client.post("/v1/completions", json=dict(BODY, max_tokens=100)
                                   ).status_code)

    threads = [threading.Thread(target=ask) for _ in range(3)]
    for t in threads:
        t.start()
    for _ in range(1000):  # until all three run (bounded: 10 s)
        stats = runner.stats
        if stats is not None and stats.running == 3:
            break
        threading.Event().wait(0.01)
    assert runner.stop()
    for t in threads:
        t.join(30)
    engine = runner.engine
    assert not engine._inflight and not engine._pending_release
    assert runner.scheduler.live_plans == 0 and engine.open_ids() == []
    assert sorted(set(host.released)) == sorted(host.released) and len(host.released) == 3
    assert answers == [500, 500, 500]  # ended by the shutdown


def test_a_request_refused_while_handed_in_keeps_nothing():
    server = build_server(ServeSettings(max_active=2), InstantHost(n_seq_max=2))
    runner = server.runner
    runner.start()
    try:
        async def hand_in() -> None:
            loop = asyncio.get_running_loop()
            for i in range(20):
                with pytest.raises(ValueError):
                    runner.open(Request(f"r{i}", [1, 2], 4, ttft_ms=-1.0), loop)

        asyncio.run(hand_in())
        assert runner.open_subscriptions == 0 and not runner._undecided
    finally:
        runner.stop()
