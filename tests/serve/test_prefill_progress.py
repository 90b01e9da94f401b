"""The engine's report of how far each prompt has been prefilled (serve/runner.py
`PrefillProgress`), on an engine with a host that runs no model: each executed chunk moves a
prompt's count to the end of the chunk, the chunk with its first token to the whole prompt, a
preemption takes the count away (its KV is gone) until its recompute runs, and a plan made
before a request ended or was preempted writes nothing for it."""
from __future__ import annotations

import pytest

from skippy_scheduler import MemoryComponent, Scheduler, SchedulerConfig
from skippy_scheduler.cost_model import LAB_COST
from skippy_scheduler.engine import BaseObserver, CostModelHost, Engine, Request, VirtualClock
from skippy_scheduler.serve.runner import PrefillProgress

KV = 10**9


class _Snapshots(BaseObserver):
    """What the report says after each executed plan (runs after it), and every preemption."""

    def __init__(self, progress: PrefillProgress) -> None:
        self.progress = progress
        self.after: list[dict[str, int]] = []
        self.preemptions: list[list[str]] = []
        self.at_preemption: list[dict[str, int]] = []

    def executed(self, flight, duration_us) -> None:
        self.after.append(dict(self.progress.done))

    def preempted(self, ids) -> None:
        self.preemptions.append(list(ids))
        self.at_preemption.append(dict(self.progress.done))


def _engine(depth: int, before_step=None) -> tuple[Engine, PrefillProgress, _Snapshots]:
    scheduler = Scheduler(SchedulerConfig(
        max_active_sequences=2, max_tokens_per_iteration=16, prefill_chunk_tokens=16,
        max_inflight_plans=depth, memory_components=[MemoryComponent("kv", KV, 0, 1, 0)]))
    engine = Engine(scheduler, CostModelHost(token=5), clock=VirtualClock(LAB_COST),
                    before_step=before_step, max_iterations=200)
    progress = PrefillProgress()
    snaps = _Snapshots(progress)
    engine.observers.extend([progress, snaps])
    return engine, progress, snaps


@pytest.mark.parametrize("depth", [1, 2])
def test_each_chunk_moves_the_count_and_the_first_token_makes_it_whole(depth):
    engine, progress, snaps = _engine(depth)
    engine.submit(Request("a", list(range(1, 41)), 3, arrival_us=0.0))  # 40 tokens: 16+16+8
    engine.run()
    counts = [s.get("a") for s in snaps.after]
    assert counts[:3] == [16, 32, 40]  # the last chunk samples its first token: all 40
    assert all(c == 40 for c in counts[3:])  # decode steps leave it
    assert snaps.preemptions == []


def test_a_preemption_takes_the_count_away_until_the_recompute_runs():
    steps = [0]

    def pressure(engine):
        steps[0] += 1
        if steps[0] == 3:  # after two chunks of "a"
            assert engine.preempt([KV + 1]) == ["a"]
            engine.preempt([0])

    engine, progress, snaps = _engine(1, before_step=pressure)
    engine.submit(Request("a", list(range(1, 61)), 2, arrival_us=0.0))  # 60 tokens
    engine.run()
    assert snaps.preemptions == [["a"]]
    assert snaps.at_preemption == [{}]  # its 32 went with its KV
    counts = [s.get("a") for s in snaps.after]
    # 16, 32; preempted (gone); the recompute starts over: 16, 32, 48, then the whole 60.
    assert counts[:2] == [16, 32]
    assert counts[2:6] == [16, 32, 48, 60]


def test_a_plan_made_before_its_request_ended_writes_nothing_for_it():
    """With two plans in flight, a request cancelled while its next chunk is already made: that
    chunk runs (the host cannot take it back) but its count is not written again."""
    cancelled = []

    def cancel(engine):
        if not cancelled and progress.done.get("a"):
            engine.cancel("a")
            progress.done.pop("a", None)  # as the server does at the request's end
            cancelled.append(True)

    engine, progress, snaps = _engine(2, before_step=cancel)
    engine.submit(Request("a", list(range(1, 81)), 2, arrival_us=0.0))  # 80 tokens: 5 chunks
    engine.run()
    assert cancelled
    first = next(i for i, s in enumerate(snaps.after) if s.get("a"))
    assert all("a" not in s for s in snaps.after[first + 1:]), snaps.after
