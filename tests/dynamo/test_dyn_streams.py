"""Dynamo's streams on a real `EngineRunner` (skippy_scheduler/dynamo/adapter.py, worker.py;
serve/runner.py): a request id repeated while its first request runs (a client's retry with
the same x-dynamo-request-id) keeps each stream its own and an abort ends both; the runner
refuses an id that is open instead of taking its subscription over; a negative Dynamo
priority runs, in Dynamo's order; an engine failure reaches Dynamo as `WorkerUnavailable`.
No model needed; the worker's test needs Dynamo (skipped without it)."""
from __future__ import annotations

import asyncio
import importlib
import time
from typing import Any, Optional

import pytest

from skippy_scheduler import Scheduler, SchedulerConfig
from skippy_scheduler.dynamo.adapter import EngineAdapter, Vocabulary
from skippy_scheduler.engine import CostModelHost, FinishEvent, Request
from skippy_scheduler.serve import runner as runner_module
from skippy_scheduler.serve.runner import EngineRunner, EngineUnavailable

TOKEN = 7  # what the host samples, every step


class SlowHost(CostModelHost):
    """A step of about 5 ms, so that a long request is still running while a test acts."""

    def execute(self, plan: Any) -> None:
        time.sleep(0.005)
        super().execute(plan)


def _runner(lanes: int = 4) -> EngineRunner:
    config = SchedulerConfig(max_active_sequences=lanes, max_waiting_sequences=64,
                             max_tokens_per_iteration=512, prefill_chunk_tokens=256,
                             reserved_sequence_ids=0)
    runner = EngineRunner(Scheduler(config), SlowHost(TOKEN))
    runner.start()
    return runner


@pytest.fixture
def runner():
    r = _runner()
    yield r
    if r.running:
        r.stop()


def _adapter(runner: EngineRunner) -> EngineAdapter:
    return EngineAdapter(runner, Vocabulary(n_vocab=100, n_ctx_seq=4096, bos=1))


async def _collect(adapter: EngineAdapter, request: dict, rid: str) -> list[dict]:
    out = []
    agen = adapter.stream(request, rid)
    try:
        async for chunk in agen:
            out.append(chunk)
    finally:
        await agen.aclose()
    return out


def _produced(chunks: list[dict]) -> int:
    return sum(len(c["token_ids"]) for c in chunks)


async def _until(predicate, timeout_s: float = 5.0) -> None:
    end = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < end, "timed out"
        await asyncio.sleep(0.01)


def _idle(runner: EngineRunner) -> bool:
    return runner.call(lambda: not runner.engine.open_ids()) and \
        runner.open_subscriptions == 0


def test_the_runner_refuses_an_open_id_and_leaves_the_open_request_alone(runner):
    async def main() -> None:
        loop = asyncio.get_running_loop()
        first = runner.open(Request("x", [1, 5], 40), loop)
        assert await first.verdict is None
        # Refused as an engine that is not running is (what every caller of `open` handles).
        with pytest.raises(EngineUnavailable, match="'x' is open already") as refused:
            runner.open(Request("x", [1, 6], 3), loop)
        assert type(refused.value) is runner_module.DuplicateRequest
        assert runner.subscription("x") is first
        tokens, end = 0, None
        deadline = time.monotonic() + 10
        while end is None:
            assert time.monotonic() < deadline
            for event in await asyncio.wait_for(first.next_batch(), 5):
                if isinstance(event, FinishEvent):
                    end = event
                else:
                    tokens += 1
        assert (end.reason, tokens) == ("length", 40)
        runner.close(first)
        assert _idle(runner)
        # Once it ended the id may be used again.
        again = runner.open(Request("x", [1, 6], 2), loop)
        assert await again.verdict is None
        runner.cancel("x")
        runner.close(again)

    asyncio.run(main())


def test_a_repeated_dynamo_id_keeps_each_stream_its_own_and_an_abort_ends_both(runner):
    adapter = _adapter(runner)

    async def main() -> None:
        long = {"token_ids": [5, 6, 7], "stop_conditions": {"max_tokens": 3000}}
        first = asyncio.ensure_future(_collect(adapter, long, "same"))
        await _until(lambda: adapter.requests == 1)
        short = await asyncio.wait_for(_collect(
            adapter, {"token_ids": [5], "stop_conditions": {"max_tokens": 3}}, "same"), 10)
        assert _produced(short) == 3 and short[-1]["finish_reason"] == "length"
        assert short[-1]["completion_usage"]["completion_tokens"] == 3
        assert not first.done()
        # Two at once under the id: Dynamo's abort of it ends every one.
        second = asyncio.ensure_future(_collect(adapter, long, "same"))
        await _until(lambda: adapter.requests == 3)
        await asyncio.sleep(0.05)
        adapter.cancel("same")
        ends = await asyncio.wait_for(asyncio.gather(first, second), 5)
        for chunks in ends:
            assert chunks[-1]["finish_reason"] == "cancelled"
            assert _produced(chunks) == chunks[-1]["completion_usage"]["completion_tokens"]
            assert _produced(chunks) < 3000
        await _until(lambda: _idle(runner))
        assert adapter._open == {}

    asyncio.run(main())


def test_a_negative_dynamo_priority_runs_and_keeps_dynamos_order():
    runner = _runner(lanes=1)
    adapter = _adapter(runner)
    try:
        async def main() -> None:
            low = await asyncio.wait_for(_collect(adapter, {
                "token_ids": [5], "stop_conditions": {"max_tokens": 2},
                "routing": {"priority": -(1 << 31)}}, "low"), 10)
            assert low[-1]["finish_reason"] == "length" and _produced(low) == 2
            # One lane, held: the waiting ones are admitted by priority when it frees, a
            # higher Dynamo priority first (as Dynamo's vLLM handler has vLLM run it first).
            order: list[str] = []

            async def run(rid: str, priority: Optional[int], n: int) -> None:
                request: dict = {"token_ids": [5], "stop_conditions": {"max_tokens": n}}
                if priority is not None:
                    request["routing"] = {"priority": priority}
                agen = adapter.stream(request, rid)
                try:
                    async for _ in agen:
                        if rid not in order:
                            order.append(rid)
                finally:
                    await agen.aclose()

            holder = asyncio.ensure_future(run("holder", None, 3000))
            await _until(lambda: bool(order))
            waiting = [asyncio.ensure_future(run(rid, p, 2)) for rid, p in
                       (("minus-five", -5), ("default", None), ("minus-one", -1),
                        ("plus-two", 2))]
            await _until(lambda: runner.stats.waiting == 4)
            adapter.cancel("holder")
            await asyncio.wait_for(asyncio.gather(holder, *waiting), 10)
            assert order == ["holder", "plus-two", "default", "minus-one", "minus-five"]

        asyncio.run(main())
    finally:
        runner.stop()


# -- the worker (Dynamo's side) ----------------------------------------------------------------


@pytest.fixture
def worker_module():
    """skippy_scheduler.dynamo.worker and the exceptions it raises, Dynamo's own (skipped where
    Dynamo does not import)."""
    exceptions = pytest.importorskip("dynamo.llm.exceptions")
    worker = importlib.import_module("skippy_scheduler.dynamo.worker")
    return worker, exceptions.InvalidArgument, exceptions.WorkerUnavailable


class _Context:
    def __init__(self, rid: str) -> None:
        self._rid = rid

    def id(self) -> str:
        return self._rid

    def is_stopped(self) -> bool:
        return False


def test_an_engine_failure_reaches_dynamo_as_worker_unavailable(worker_module, runner):
    worker, invalid, unavailable = worker_module
    engine = worker.SkippyEngine(None, worker.WorkerSettings("folder", "m"))
    engine.adapter = _adapter(runner)

    async def generate(request: dict, rid: str) -> list[dict]:
        return [c async for c in engine.generate(request, _Context(rid))]

    async def main() -> None:
        # Refusals as before: a request that has no counterpart here is InvalidArgument.
        with pytest.raises(invalid, match="allowed_token_ids"):
            await generate({"token_ids": [5], "sampling_options": {
                "allowed_token_ids": [3]}}, "bad")
        # The engine shuts down under a running request: retryable, not a 500.
        task = asyncio.ensure_future(generate(
            {"token_ids": [5], "stop_conditions": {"max_tokens": 3000}}, "running"))
        await _until(lambda: engine.adapter.requests == 1)
        await asyncio.sleep(0.05)
        await asyncio.to_thread(runner.stop)
        with pytest.raises(unavailable, match="shutting down"):
            await asyncio.wait_for(task, 5)
        # After the stop: refused as busy (unchanged), also WorkerUnavailable.
        with pytest.raises(unavailable):
            await generate({"token_ids": [5]}, "late")

    asyncio.run(main())
