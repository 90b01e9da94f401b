"""The engine's bare step (no observer, no clock, one plan at a time, no guard) against the full
step path (engine/step.py): the same plans, the same releases in the same order, the same
errors. The bare branch is what the benchmarks time, so every duty of a step is checked on it
too: priority victims released before their lane is reused, memory pressure, a failed
execution, a stall, the `max_iterations` guard.

Each scenario runs twice on fresh schedulers: once bare, once through the full path, which
`max_iterations` set far beyond the run selects without changing anything else.
"""
from __future__ import annotations

from typing import Any, Callable

import pytest

from skippy_scheduler import MemoryComponent, ReleaseReason, SchedulerConfig
from skippy_scheduler.engine import (CostModelHost, Engine, EngineStalled, Request,
                                     RequestNeverFits)

FAR = 1 << 30  # a max_iterations no run reaches: selects the full path


class LogHost(CostModelHost):
    """Echoes each row's last input token; logs new rows and releases; optionally fails one
    execution and reports the KV cells it holds (one memory component)."""

    def __init__(self, fail_at: int = -1) -> None:
        super().__init__(token=None)
        self.log: list[tuple[str, str]] = []
        self.cells: dict[str, int] = {}
        self.executions = 0
        self.fail_at = fail_at
        self.spike = 0

    def execute(self, plan: Any) -> None:
        self.executions += 1
        if self.executions == self.fail_at:
            raise RuntimeError("device lost")
        ids = plan.sequence_ids
        ends = plan.row_offsets[1:]
        for row in range(len(plan)):
            if plan.new_rows[row]:
                self.log.append(("new", ids[row]))
            self.cells[ids[row]] = int(plan.positions[ends[row] - 1]) + 1
        super().execute(plan)

    def release(self, sequence_id: str, reason: ReleaseReason = ReleaseReason.FINISHED) -> None:
        self.cells.pop(sequence_id, None)
        self.log.append((reason.name, sequence_id))


class MeasuringHost(LogHost):
    def memory_used(self) -> list[int]:
        return [sum(self.cells.values()) + self.spike]


def _drive(engine: Engine, steps: int, submit_at: dict[int, list[Request]]) -> None:
    """Step until idle (at most `steps` steps), submitting `submit_at[i]` before step i."""
    for i in range(steps):
        for request in submit_at.get(i, []):
            engine.submit(request)
        if not engine.step() and not any(k > i for k in submit_at):
            return
    raise AssertionError(f"not idle after {steps} steps")


def _both(impl: Any, config: SchedulerConfig, make_host: Callable[[], LogHost],
          submit_at: dict[int, list[Request]],
          hook: Callable[[LogHost], Any] = lambda host: None,
          ) -> tuple[LogHost, LogHost, Any, Any]:
    """The scenario bare and through the full path: (bare host, full host, their metrics)."""
    runs = []
    for guard in (None, FAR):
        host = make_host()
        scheduler = impl(config)
        engine = Engine(scheduler, host, clock=None, record=False, max_iterations=guard,
                        before_step=hook(host))
        _drive(engine, 500, submit_at)
        runs.append((host, scheduler.metrics()))
    (bare, m_bare), (full, m_full) = runs
    return bare, full, m_bare, m_full


def test_priority_victims_are_released_before_their_lane_is_reused(impl: Any) -> None:
    config = SchedulerConfig(max_active_sequences=1, max_tokens_per_iteration=64,
                             prefill_chunk_tokens=16, priority_preemption=True)
    arrivals = {0: [Request("low", list(range(10, 30)), 40)],
                4: [Request("high", [7, 8, 9], 3, priority=5)]}
    bare, full, m_bare, m_full = _both(impl, config, LogHost, arrivals)
    assert bare.log == full.log and m_bare == m_full
    assert bare.log.index(("PREEMPTED", "low")) < bare.log.index(("new", "high"))
    assert m_bare.preempted == 1 and m_bare.finished == 2
    assert not bare.cells


def test_memory_pressure_preempts_and_releases(impl: Any) -> None:
    config = SchedulerConfig(max_active_sequences=4, max_tokens_per_iteration=64,
                             prefill_chunk_tokens=16,
                             memory_components=[MemoryComponent("kv", 200, 0, 1, 0)])

    def spike(host: LogHost) -> Callable[[Engine], None]:
        def before_step(engine: Engine) -> None:
            host.spike = 150 if engine.iterations == 3 else 0
        return before_step

    arrivals = {0: [Request(f"r{i}", list(range(i * 50, i * 50 + 30)), 6) for i in range(3)]}
    bare, full, m_bare, m_full = _both(impl, config, MeasuringHost, arrivals, spike)
    assert bare.log == full.log and m_bare == m_full
    assert any(kind == "PREEMPTED" for kind, _ in bare.log)
    assert m_bare.recompute_tokens > 0 and m_bare.finished == 3
    assert not bare.cells


def test_a_failed_execution_aborts_the_plan_and_loses_nothing(impl: Any) -> None:
    config = SchedulerConfig(max_active_sequences=4, max_tokens_per_iteration=64,
                             prefill_chunk_tokens=16)
    for guard in (None, FAR):
        host = LogHost(fail_at=3)
        scheduler = impl(config)
        engine = Engine(scheduler, host, clock=None, record=False, max_iterations=guard)
        engine.submit(Request("a", list(range(10, 30)), 5))
        engine.step()
        engine.step()
        with pytest.raises(RuntimeError, match="device lost"):
            engine.step()
        assert engine.iterations == 2
        _drive(engine, 100, {})
        m = scheduler.metrics()
        assert (m.finished, m.failed, m.decode_tokens) == (1, 0, 4)
        assert host.log == [("new", "a"), ("FINISHED", "a")]


def test_a_stall_and_the_iteration_guard_raise(impl: Any) -> None:
    small = SchedulerConfig(memory_components=[MemoryComponent("kv", 10, 0, 1, 0)])
    engine = Engine(impl(small), LogHost(), clock=None, record=False)
    # A request that could never fit is refused when it arrives (it would stall the engine).
    with pytest.raises(RequestNeverFits, match="can never be admitted"):
        engine.submit(Request("huge", list(range(100)), 2))
    assert engine.open_ids() == []
    # Measured memory that leaves no room for what waits stalls the bare step.
    engine.submit(Request("small", [1, 2, 3], 2))
    assert engine.preempt([10]) == []
    with pytest.raises(EngineStalled, match="empty plan with 1 requests"):
        engine.step()
    engine = Engine(impl(SchedulerConfig()), LogHost(), clock=None, record=False,
                    max_iterations=3)
    engine.submit(Request("long", [1, 2, 3], 50))
    for _ in range(3):
        assert engine.step()
    with pytest.raises(RuntimeError, match="no completion after 3 iterations"):
        engine.step()
