"""The engine set-ups the overhead report and the benchmarks time (BENCHMARKS.md).

Every workload builds a scheduler (native `Scheduler` or the pure-Python `TwinScheduler`, same
API) on an `Engine` with no clock and no recorder, brings it to a steady state, and returns a
`step()` closure (the engine's step). A step includes the fake host's work: it writes one
sampled token per sampling row into `plan.outputs`, as a batched runtime does.
"""
from __future__ import annotations

from typing import Any, Callable, TypeAlias

import numpy as np

from .._core import IterationPlan, Scheduler
from ..cost_model import StepCost
from ..engine import CostModelHost, Engine, VirtualClock
from ..reference import TwinPlan, TwinScheduler
from ..slack import PlanningRule
from ..types import SchedulerConfig, Sequence

# The two implementations a workload can run on (same API).
SchedulerClass: TypeAlias = "type[Scheduler] | type[TwinScheduler]"

IMPLEMENTATIONS: dict[str, SchedulerClass] = {"native": Scheduler, "twin": TwinScheduler}
LONG_OUTPUT = 1 << 30  # max_tokens of the steady sequences: they never finish while measured
_TOKEN = 7


class BenchHost(CostModelHost):
    """What a batched runtime does after running a plan: one sampled token per sampling row;
    with `end_last` set, the last sampling row's sequence ends (a negative token)."""

    def __init__(self, token: int = _TOKEN) -> None:
        super().__init__(token=token)
        self.end_last = False

    def execute(self, plan: Any) -> None:
        super().execute(plan)
        if self.end_last:
            out = plan.outputs
            if out.count:
                out.predicted_tokens[out.count - 1] = -1


def write_outputs(plan: IterationPlan | TwinPlan, token: int = _TOKEN) -> int:
    """One sampled token per sampling row of `plan` (the bench host's work, for callers that
    hold a plan of their own); returns the number written."""
    BenchHost(token).execute(plan)
    return plan.outputs.count


def _config(**kw: Any) -> SchedulerConfig:
    return SchedulerConfig(**kw)


def _engine(scheduler: Scheduler | TwinScheduler) -> Engine:
    # No clock, no recorder: a step is plan + host + complete and nothing else.
    return Engine(scheduler, BenchHost(), clock=None, record=False)


def decoding_engine(cls: SchedulerClass, n: int, prompt: int, *, extra_active: int = 0,
                    waiting: int = 0, **cfg: Any) -> Engine:
    """An engine whose `n` sequences decode from the first plan (prompts already prefilled)."""
    active = n + extra_active
    s = cls(_config(max_active_sequences=active, sequence_id_limit=active + 16,
                    max_waiting_sequences=max(256, n + waiting + 16),
                    max_tokens_per_iteration=max(2048, active + 256), **cfg))
    engine = _engine(s)
    tokens = [(i * 7919) % 32000 for i in range(prompt)]
    for i in range(n):
        engine.submit(Sequence(f"d{i}", tokens, LONG_OUTPUT).with_prefilled_generation([1]))
    return engine


def _calibrated_step(engine: Engine) -> None:
    """One step that reports a 10 ms duration, so mixed planning knows this decode width."""
    engine.clock, engine.observe = VirtualClock(StepCost(10_000, 0, 0, 0)), True
    engine.step()
    engine.clock, engine.observe = None, False


def steady_decode(cls: SchedulerClass, n: int, prompt: int = 512,
                  **cfg: Any) -> Callable[[], object]:
    """N live decodes; one step = the engine's plan + host outputs + complete."""
    engine = decoding_engine(cls, n, prompt, **cfg)

    def step() -> object:
        engine.step()
        return engine.last_telemetry

    step()
    return step


def steady_decode_inflight(cls: SchedulerClass, n: int, depth: int = 2,
                           prompt: int = 512) -> Callable[[], object]:
    """N live decodes with `depth` plans in flight; one step = one plan made (its deferred
    inputs filled from the previous plan's outputs, §2.11), the host's outputs for it, and the
    oldest plan completed: the same work per token as `steady_decode` at depth 1."""
    engine = decoding_engine(cls, n, prompt, max_inflight_plans=depth)

    def step() -> object:
        done = engine.iterations
        while engine.iterations == done:
            engine.step()
        return engine.last_telemetry

    for _ in range(depth + 2):
        step()
    return step


def mixed_decode_prefill(cls: SchedulerClass, n: int, prompt: int = 512, chunk: int = 256,
                         steps: int = 3000, **cfg: Any) -> Callable[[], object]:
    """N decode rows plus one `chunk`-token prefill chunk per step (mixed planning, §2.5;
    `cfg` adds config fields, e.g. the slack rule's)."""
    engine = decoding_engine(cls, n, prompt, extra_active=1, mixed_prefill_decode=True,
                             prefill_chunk_tokens=chunk, **cfg)
    _calibrated_step(engine)  # decode-only: calibrates the EWMA for exactly n decode rows
    # One long prompt that stays in prefill for `steps` steps, one chunk per step.
    engine.submit(Sequence("long-prefill", [i % 32000 for i in range(chunk * (steps + 64))], 1))

    def step() -> object:
        engine.step()
        return engine.last_telemetry

    step()
    return step


# The slack rule (§2.13) with a target no step reaches: every step is the same N decode rows plus
# one full chunk as under the reference gate, so the two time the same plans.
SLACK_SAME_PLANS: dict[str, Any] = {"planning_rule": PlanningRule.SLACK, "itl_target": 1e6}


def admission_churn(cls: SchedulerClass, n: int,
                    prompt: int = 512) -> tuple[Callable[[], object], Callable[[], object]]:
    """N active with mixed planning; returns (arrival_step, finish_step), to be called in turn.

    `finish_step`: plan + host + complete, where the host ends the last row's sequence (a
    negative token). `arrival_step`: submit a new `prompt`-token request, then plan (ranks the
    dirty queue, admits it, N-1 decode rows plus its whole prompt as one chunk) + host + complete.
    Both decode-row counts are calibrated first, so every plan is a mixed plan (§2.5).
    """
    engine = decoding_engine(cls, n - 1, prompt, extra_active=1, mixed_prefill_decode=True,
                             prefill_chunk_tokens=prompt)
    host = engine.host
    assert isinstance(host, BenchHost)
    tokens = [(i * 104729) % 32000 for i in range(prompt)]
    arrival = Sequence("a0", tokens, LONG_OUTPUT)  # submit copies it: one object, new id each time
    for k in range(2):  # decode-only plans of n-1, then n rows set the EWMA entries
        if k:
            engine.submit(Sequence("d-extra", tokens, LONG_OUTPUT).with_prefilled_generation([1]))
        _calibrated_step(engine)
    counter = [0]

    def finish_step() -> object:
        host.end_last = True
        engine.step()
        host.end_last = False
        return engine.last_telemetry

    def arrival_step() -> object:
        counter[0] += 1
        arrival.id = f"a{counter[0]}"
        engine.submit(arrival)
        engine.step()
        return engine.last_telemetry

    for _ in range(3):
        finish_step()
        arrival_step()
    return arrival_step, finish_step


def ranking(cls: SchedulerClass, w: int, n_active: int = 64, prompt: int = 512, prefix: int = 256,
            groups: int = 16) -> tuple[Engine, Callable[[], None]]:
    """W waiting behind a full active set; returns (engine, make_dirty).

    Half of the prompts start with one of `groups` shared prefixes of `prefix` tokens; all have
    equal priority; grouping is on (the default). `make_dirty` cancels the oldest waiting request
    and submits a new one, so the queue length stays W and the next plan re-ranks it. The
    engine times its scheduler calls (`engine.last_plan_ns`).
    """
    engine = decoding_engine(cls, n_active, prompt, waiting=w, group_waiting_prefixes=True)
    engine.profile = True
    rng = np.random.default_rng(12345)
    prefixes: list[list[int]] = [rng.integers(0, 32000, prefix).tolist() for _ in range(groups)]
    serial = [0]

    def prompt_for(i: int) -> list[int]:
        tail: list[int] = rng.integers(0, 32000, prompt - prefix if i % 2 == 0 else prompt).tolist()
        return prefixes[(i // 2) % groups] + tail if i % 2 == 0 else tail

    pool = [prompt_for(i) for i in range(64)]
    for i in range(w):
        engine.submit(Sequence(f"w{i}", pool[i % len(pool)], LONG_OUTPUT))
    serial[0] = w
    oldest = [0]

    def make_dirty() -> None:
        engine.cancel(f"w{oldest[0]}")
        oldest[0] += 1
        engine.submit(Sequence(f"w{serial[0]}", pool[serial[0] % len(pool)], LONG_OUTPUT))
        serial[0] += 1

    engine.step()
    return engine, make_dirty


def first_plan_token_count(cls: SchedulerClass, n: int, prompt: int) -> int:
    """Tokens of a steady decode plan: N when each row copies only its pending token."""
    engine = decoding_engine(cls, n, prompt)
    counts: list[int] = []
    engine.on_plan = lambda plan, start, duration: counts.append(plan.token_count)
    for _ in range(4):
        engine.step()
    return counts[-1]
