"""What the workload suite and the trace replay share: driving one run of the engine on the
virtual clock with the lab host, and the latency figures every run reports.

A run is the `Engine` on a `VirtualClock(cost)` with a `LabHost`; `drive` returns its report
and the wall time it took. `Latency` holds the per-request arrays the figures are computed
from (queue wait, time to first token, time per output token, goodput), and
`add_percentiles` writes the nearest-rank percentiles (§5.6) of queue wait, TTFT and the
inter-token gaps into a figures dict.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional

import numpy as np

from ..cost_model import StepCost
from ..engine import Engine, EngineReport, EngineStalled, VirtualClock, percentile
from .host import LabHost, LabRequest

ProgressHook = Callable[[int], None]  # called with the number of requests that have ended


class LabStalled(RuntimeError):
    """A lab run whose scheduler stalled: a request that can never fit the memory model."""


def drive(scheduler: Any, host: LabHost, requests: Iterable[LabRequest], cost: StepCost,
          *, label: str, stalled_hint: str = "", progress: Optional[ProgressHook] = None,
          every: int = 1024,
          on_plan: Optional[Callable[[Any, float, float], None]] = None
          ) -> tuple[EngineReport, float]:
    """Run `requests` to the end; (report, wall seconds). A stall raises `LabStalled` (a
    RuntimeError) naming the run (`label`), followed by `stalled_hint`."""

    def before_step(engine: Engine) -> None:
        if progress is not None and engine.iterations % every == 0 and engine.iterations:
            recorder = engine.recorder
            assert recorder is not None
            progress(len(recorder.ids) - engine.outstanding)

    engine = Engine(scheduler, host, clock=VirtualClock(cost), before_step=before_step,
                    on_plan=on_plan)
    host.clock = engine.clock
    wall_start = time.perf_counter()
    try:
        report = engine.run(host.stream(requests))
    except EngineStalled as exc:
        raise LabStalled(f"scheduler stalled ({label}): {exc}{stalled_hint}") from exc
    return report, time.perf_counter() - wall_start


@dataclass
class LabRun:
    """One run of a lab driver (a suite run or a trace replay) under one policy and mode."""

    policy: str
    mode: str
    figures: dict[str, Any] = field(default_factory=dict)
    series: Optional[dict[str, Any]] = None  # per-iteration (and per-admission) plot arrays
    ttft_us: Optional[np.ndarray] = None
    per_request: Optional[dict[str, np.ndarray]] = None  # arrays by submission index
    tails: dict[str, Any] = field(default_factory=dict)  # lab/tails.py (printed on request)


def nearest_rank(values: np.ndarray, p: float) -> float:
    """The package's one percentile definition (nearest rank, §5.6), as a float."""
    return float(percentile(values, p))


@dataclass
class Latency:
    """Per-request latency arrays of a run, by submission index (µs of virtual time)."""

    per: dict[str, np.ndarray]  # the report's per-request arrays
    timeline: Any  # the report's TokenTimeline
    its: dict[str, np.ndarray]  # the report's per-iteration arrays
    queue: np.ndarray  # first scheduled - arrival
    ttft: np.ndarray  # first token - arrival
    good: np.ndarray  # met both goodput targets (TTFT and time per output token)

    @classmethod
    def of(cls, report: EngineReport, expected_tokens: np.ndarray, ttft_target_ms: float,
           itl_target_ms: float, what: str) -> "Latency":
        per = report.arrays()
        timeline = report.timeline()
        if not np.array_equal(timeline.generated, expected_tokens):
            raise RuntimeError(f"{what} bookkeeping lost tokens: generated counts differ from "
                               "the requests' output lengths")
        arrival = per["arrival_us"]
        first = timeline.first_token_us
        ttft = first - arrival
        gen = timeline.generated
        tpot = np.where(gen > 1, (timeline.last_token_us - first) / np.maximum(gen - 1, 1), 0.0)
        good = (ttft <= ttft_target_ms * 1e3) & (tpot <= itl_target_ms * 1e3)
        return cls(per, timeline, report.iteration_arrays(), per["first_scheduled_us"] - arrival,
                   ttft, good)

    def add_percentiles(self, figures: dict[str, Any]) -> None:
        """p50/p90/p99 of queue wait, TTFT and the inter-token gaps, ms; a gap percentile is
        None (JSON null, `-` in a table) when no request had a gap (every one generated at
        most one token): undefined, not 0."""
        for name, values in (("queue", self.queue), ("ttft", self.ttft),
                             ("itl", self.timeline.gaps_us)):
            for p in (50, 90, 99):
                figures[f"p{p}_{name}_ms"] = (nearest_rank(values, p) / 1e3 if len(values)
                                              else None)

    def p99_max_gap_ms(self) -> Optional[float]:
        """p99 over requests of each one's largest inter-token gap, ms; None when no request
        had a gap."""
        if not len(self.timeline.gaps_us):
            return None
        return nearest_rank(self.timeline.max_gap_us, 99) / 1e3
