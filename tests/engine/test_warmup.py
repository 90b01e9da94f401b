"""The cost model's warm-up before serving (engine/warmup.py): a synthetic burst through the
host on an engine of its own, nothing left behind, the fitter handed to the serving engine."""
from __future__ import annotations

import threading
import time

import pytest

from skippy_scheduler import PlanningRule, SchedulerConfig
from skippy_scheduler.cost_model import StepCost
from skippy_scheduler.engine import Engine, Request
from skippy_scheduler.engine.cost_fit import StepCostFitter
from skippy_scheduler.engine.warmup import burst_lengths, warm_cost_model
from skippy_scheduler.selection import make_scheduler
from skippy_scheduler.types import ReleaseReason

PER_TOKEN_S = 20e-6
PER_ROW_S = 100e-6


class TimedHost:
    """Each plan sleeps base + per prompt token + per decode row (so the warm-up has real
    durations to fit); next token = last input + 1. Records holdings and release reasons."""

    def __init__(self) -> None:
        self.holding: set[str] = set()
        self.reasons: list[ReleaseReason] = []
        self.plans = 0
        self.threads: set[threading.Thread] = set()

    def execute(self, plan) -> None:
        self.plans += 1
        self.threads.add(threading.current_thread())
        ids = plan.sequence_ids
        self.holding.update(ids)
        counts = (plan.row_offsets[1:] - plan.row_offsets[:-1]).tolist()
        time.sleep(1e-3 + sum(PER_TOKEN_S * c if c > 1 else PER_ROW_S for c in counts))
        ends = plan.row_offsets[1:]
        out = plan.outputs
        k = 0
        for r in plan.sample_rows.tolist():
            out.request_indexes[k] = r
            out.predicted_tokens[k] = int(plan.tokens[ends[r] - 1]) % 200 + 3
            k += 1
        out.count = k

    def release(self, sequence_id: str, reason: ReleaseReason) -> None:
        self.holding.discard(sequence_id)
        self.reasons.append(reason)


def _config(**kw) -> SchedulerConfig:
    base = dict(max_active_sequences=8, max_tokens_per_iteration=256, prefill_chunk_tokens=128,
                planning_rule=PlanningRule.SLACK, itl_target=0.05)
    base.update(kw)
    return SchedulerConfig(**base)


@pytest.mark.parametrize("implementation", ["native", "twin"])
def test_warm_up_times_a_burst_and_leaves_nothing(implementation):
    host = TimedHost()
    warm = warm_cost_model(host, lambda c: make_scheduler(c, implementation=implementation),
                           _config(), n_vocab=256, lane_tokens=512)
    assert warm.prompts == 8 and warm.prompt_tokens == sum(burst_lengths(8, 248))
    assert warm.steps == host.plans and warm.steps >= 8
    assert not host.holding  # every sequence released
    # Nothing is kept as a resident prefix: every end is told as a cancellation.
    assert host.reasons and set(host.reasons) == {ReleaseReason.CANCELLED}
    assert len(warm.fitter) == min(warm.steps, 64)
    # Fitted from the host's own steps: the decode rows' cost is far below the generic prior's.
    assert warm.cost != StepCost()
    assert warm.cost.per_decode_row_us < StepCost().per_decode_row_us
    assert "cost model warmed up" in warm.describe()
    # On a thread of its own, gone once it returns (llama.cpp's CPU backend keeps a compute
    # team per thread that has decoded: the caller's thread must not become one).
    (thread,) = host.threads
    assert thread is not threading.current_thread() and not thread.is_alive()


class FailingHost(TimedHost):
    def execute(self, plan) -> None:
        if self.plans == 3:
            raise MemoryError("the device is full")
        super().execute(plan)


def test_a_server_config_with_plans_in_flight_warms_up_one_plan_at_a_time():
    host = TimedHost()  # runs plans only as they are made (no execute_async)
    warm = warm_cost_model(host, make_scheduler,
                           _config(max_inflight_plans=2, disjoint_inflight_plans=True),
                           n_vocab=256, lane_tokens=512)
    assert warm.steps == host.plans >= 8 and not host.holding


def test_a_failure_on_the_warm_up_thread_reaches_the_caller():
    with pytest.raises(MemoryError, match="the device is full"):
        warm_cost_model(FailingHost(), make_scheduler, _config(), n_vocab=256, lane_tokens=512)


def test_the_serving_engine_takes_the_fitter_and_its_model():
    host = TimedHost()
    warm = warm_cost_model(host, make_scheduler, _config(), n_vocab=256, lane_tokens=512)
    scheduler = make_scheduler(_config())
    engine = Engine(scheduler, host, clock="wall", record=False)
    assert engine.cost_fitter is not None and engine.cost_fitter is not warm.fitter
    engine.cost_fitter = warm.fitter
    assert engine.cost_fitter is warm.fitter
    assert scheduler.step_cost == warm.cost
    before = len(warm.fitter)
    engine.run([Request("r", list(range(3, 40)), 4)])
    assert len(warm.fitter) >= min(before + 4, 64)  # the engine's steps join the warm-up's


def test_cost_fitter_refuses_what_cannot_take_it():
    reference = Engine(make_scheduler(_config(planning_rule=PlanningRule.REFERENCE)),
                       TimedHost(), clock="wall")
    assert reference.cost_fitter is None
    with pytest.raises(ValueError, match="fits no cost model"):
        reference.cost_fitter = StepCostFitter(StepCost())
    slack = Engine(make_scheduler(_config()), TimedHost(), clock="wall")
    with pytest.raises(TypeError, match="StepCostFitter"):
        slack.cost_fitter = StepCost()  # type: ignore[assignment]


def test_warm_up_refuses_bad_settings_before_running():
    host = TimedHost()
    with pytest.raises(ValueError, match="PlanningRule.SLACK"):
        warm_cost_model(host, make_scheduler, _config(planning_rule=PlanningRule.REFERENCE),
                        n_vocab=256, lane_tokens=512)
    with pytest.raises(ValueError, match="n_vocab"):
        warm_cost_model(host, make_scheduler, _config(), n_vocab=3, lane_tokens=512)
    with pytest.raises(ValueError, match="no warm-up burst"):
        warm_cost_model(host, make_scheduler, _config(), n_vocab=256, lane_tokens=16)
    with pytest.raises(ValueError, match="output_tokens"):
        warm_cost_model(host, make_scheduler, _config(), n_vocab=256, lane_tokens=512,
                        output_tokens=0)
    assert host.plans == 0


def test_burst_lengths_spread_and_interleave():
    assert burst_lengths(1, 100) == [16]
    assert burst_lengths(4, 76) == [16, 76, 36, 56]
    lengths = burst_lengths(16, 768)
    assert sorted(lengths) == sorted(set(lengths)) and min(lengths) == 16 and max(lengths) == 768
    assert burst_lengths(3, 5) == [5, 5, 5]  # a context too small for the floor: the top
    with pytest.raises(ValueError):
        burst_lengths(0, 100)
