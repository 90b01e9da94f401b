"""Warm the slack rule's cost model before serving (docs/behaviour.md §2.13, "The first steps").

The slack rule sizes every step by a cost model that the engine refits from the steps it runs
(engine/cost_fit.py). A server that starts from the generic prior plans its first steps blind:
the prior knows no cost per prefill row or per context position and prices a decode row at a
guess, and the first refits, from 8 and 16 steps, cannot yet tell the terms apart. When the
first burst of traffic arrives at once, those are the steps that break its streams' gaps.

The server runs it when told to (`serve --cost-warmup`, off by default: BENCHMARKS.md, "A fitted
model from the first step", measured no gain in the share within an SLO).
`warm_cost_model` runs, on a thread of its own that exits when it is done (`_on_own_thread`
says why), a short synthetic burst through the host before the server takes
requests, on an engine and scheduler of its own with the server's settings: `lanes` prompts of
lengths spread from a few tokens to `longest`, all arriving at once, each generating a few
tokens, so the steps it times have what real bursts have (several prompts' chunks, beside
decode rows, at positions deep into the prompts). The fitter it returns holds those steps and
the model fitted from them; the server's engine takes it over, and its own steps then push the
warm-up's out of the window as usual.

The warm-up's engine sees the host through `_BareHost`: execute and release only, every
release as a cancellation and, on a host with resident prefixes, without keeping the cells, so
nothing it runs is kept as a resident prefix, announced as a KV event, or left in a lane
(`warm_cost_model` checks the host is idle afterwards when it can tell).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

import numpy as np

from ..cost_model import StepCost
from ..types import PlanningRule, ReleaseReason, SchedulerConfig
from .contract import PrefixHoldingHost, StateReportingHost
from .cost_fit import StepCostFitter
from .core import Engine, Request

FIRST_TOKEN = 3  # prompts avoid the low ids where vocabularies keep their special tokens
WARMUP_LANES = 16  # prompts in the burst, at most (and at most the server's lanes)
WARMUP_OUTPUT_TOKENS = 16  # tokens each prompt generates
WARMUP_LONGEST = 768  # the longest prompt, at most (and at most half a lane's context)
WARMUP_SHORTEST = 16


@dataclass(frozen=True)
class WarmUp:
    """What `warm_cost_model` did: `steps` timed in `seconds`, `prompt_tokens` prefilled over
    `prompts` prompts, and the model fitted from them (`fitter.cost`)."""

    fitter: StepCostFitter
    steps: int
    seconds: float
    prompts: int
    prompt_tokens: int

    @property
    def cost(self) -> StepCost:
        return self.fitter.cost

    def describe(self) -> str:
        c = self.cost
        return (f"cost model warmed up: {self.steps} steps of {self.prompts} prompts "
                f"({self.prompt_tokens} tokens) in {self.seconds:.1f} s; a step "
                f"{c.base_us / 1e3:.2f} ms + {c.per_prefill_token_us:.0f} µs a prompt token + "
                f"{c.per_prefill_row_us / 1e3:.2f} ms a further prompt + "
                f"{c.per_prefill_position_us / 1e3:.3f} µs a prompt token per position before "
                f"it + (with decode rows) {c.decode_base_us / 1e3:.2f} ms + "
                f"{c.per_decode_row_us:.0f} µs a decode row")


class _BareHost:
    """`host`'s execute and release and nothing else: the warm-up's engine attaches no prefix
    store and holds no cold prompt; every end is told as a cancellation, and a host that holds
    resident prefixes (`PrefixHoldingHost`) is asked not to keep the cells (its `release` takes
    `keep=False`, as `LlamaHost`'s does)."""

    __slots__ = ("_host", "_keeps")

    def __init__(self, host: Any) -> None:
        self._host = host
        self._keeps = isinstance(host, PrefixHoldingHost) and host.prefix_store is not None

    def execute(self, plan: Any) -> object:
        return self._host.execute(plan)

    def release(self, sequence_id: str, reason: ReleaseReason) -> object:
        if reason is not ReleaseReason.PREEMPTED:
            reason = ReleaseReason.CANCELLED
        if self._keeps:
            return self._host.release(sequence_id, reason, keep=False)
        return self._host.release(sequence_id, reason)


def _on_own_thread(work: Callable[[], object], cancel: Callable[[], object]) -> None:
    """Run `work` on a new thread and wait for it (its exception raised here). llama.cpp's CPU
    backend computes with an OpenMP team per calling thread, kept while that thread lives: a
    warm-up run on the caller's thread would leave a team there beside the engine thread's, and
    the two contend for the cores (a one-row decode of the bench model took 13.7 ms a step
    instead of 8.0 ms through a whole trace replay). A thread that exits takes its team with it.
    Interrupted while waiting (Ctrl-C at startup), it calls `cancel` and waits for the thread
    to return before raising, so the caller never closes the model under a running decode."""
    failure: list[BaseException] = []

    def run() -> None:
        try:
            work()
        except BaseException as exc:  # handed to the caller
            failure.append(exc)

    thread = threading.Thread(target=run, name="skippy-warmup", daemon=True)
    thread.start()
    try:
        thread.join()
    except BaseException:
        cancel()
        while thread.is_alive():
            try:
                thread.join()
            except BaseException:  # a second signal: still wait, the decode is running
                continue
        raise
    if failure:
        raise failure[0]


def burst_lengths(lanes: int, longest: int, shortest: int = WARMUP_SHORTEST) -> list[int]:
    """`lanes` prompt lengths spread evenly over [shortest, longest], interleaved (long and
    short alternate in arrival order, as a real burst's do)."""
    if lanes < 1:
        raise ValueError(f"lanes must be at least 1, got {lanes}")
    shortest = max(1, min(shortest, longest))
    spread = np.linspace(shortest, longest, lanes).round().astype(int).tolist()
    order = [spread[i // 2] if i % 2 == 0 else spread[lanes - 1 - i // 2] for i in range(lanes)]
    return [int(n) for n in order]


def warm_cost_model(host: Any, scheduler_factory: Any, config: SchedulerConfig, *,
                    n_vocab: int, lane_tokens: int, lanes: Optional[int] = None,
                    output_tokens: int = WARMUP_OUTPUT_TOKENS,
                    longest: Optional[int] = None, seed: int = 0) -> WarmUp:
    """Time a synthetic burst on `host` with a scheduler made by `scheduler_factory(config)`
    (the slack rule, the server's batch and lanes) and return the fitter that holds its steps.

    `lane_tokens` is the context each lane holds; the longest prompt is at most half of it (and
    `WARMUP_LONGEST`), so prompt and output always fit a lane. Raises ValueError for settings
    that give no burst, RuntimeError when the host is left holding a sequence afterwards."""
    if config.planning_rule is not PlanningRule.SLACK:
        raise ValueError("the warm-up fits the slack rule's cost model: the config must use "
                         "PlanningRule.SLACK")
    if n_vocab <= FIRST_TOKEN:
        raise ValueError(f"n_vocab must be above {FIRST_TOKEN}, got {n_vocab}")
    if output_tokens < 1:
        raise ValueError(f"output_tokens must be at least 1, got {output_tokens}")
    n = min(config.max_active_sequences, WARMUP_LANES) if lanes is None else lanes
    top = min(WARMUP_LONGEST, (lane_tokens - output_tokens) // 2) if longest is None else longest
    if n < 1 or top < 1:
        raise ValueError(f"no warm-up burst fits {n} lanes of {lane_tokens} tokens")
    # Its own scheduler: no prefix store, no cold prompt held, one plan at a time (the bare
    # host runs plans only as they are made), the rest as the server's.
    scheduler = scheduler_factory(replace(config, cold_prefix_hold_tokens=0,
                                          max_inflight_plans=1, disjoint_inflight_plans=False))
    engine = Engine(scheduler, _BareHost(host), clock="wall", record=False)
    fitter = engine.cost_fitter
    assert fitter is not None  # the slack rule with a clock always has one
    rng = np.random.default_rng(seed)
    lengths = burst_lengths(n, top)
    requests = [Request(f"warmup-{i}", rng.integers(FIRST_TOKEN, n_vocab, size=length).tolist(),
                        output_tokens) for i, length in enumerate(lengths)]
    store = host.prefix_store if isinstance(host, PrefixHoldingHost) else None
    entries = store.entries if store is not None else 0
    start = time.perf_counter()
    _on_own_thread(lambda: engine.run(requests),
                   lambda: [engine.cancel(r.id) for r in requests])
    seconds = time.perf_counter() - start
    if store is not None and store.entries != entries:
        raise RuntimeError(f"the warm-up changed the host's resident prefixes ({entries} "
                           f"entries before, {store.entries} after)")
    if isinstance(host, StateReportingHost):
        left = host.host_state(detail=True)
        if left.active or left.lane_positions:
            raise RuntimeError(f"the warm-up left the host holding sequences {left.active} "
                               f"(KV positions {dict(left.lane_positions)})")
    fitter.fit()
    return WarmUp(fitter, engine.iterations, seconds, len(lengths), sum(lengths))
