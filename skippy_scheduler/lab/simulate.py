"""The deterministic lab run (§5.4): the engine on a virtual clock with a model-free host.

`simulate` drives any scheduler with the public API (native or twin, see `backend.py`) through
the `Engine`, with a `CostModelHost` that samples the token 1 for every sampling row and a
`VirtualClock` that charges each plan its `StepCost` cost, and returns a
`SimulationReport` of per-request timings. Time only moves by the cost model, so two runs of
the same inputs give identical reports (and byte-identical traces, §5.7).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

from ..cost_model import LAB_COST, StepCost
from ..engine import CostModelHost, Engine, EngineStalled, VirtualClock, percentile
from ..types import IterationPhase
from .backend import Backend, resolve_backend
from .model import SimRequest

__all__ = ["RequestMetrics", "SimulationError", "SimulationReport", "percentile", "simulate",
           "validate_requests"]


class SimulationError(RuntimeError):
    """The simulation could not continue (a submit was refused or the scheduler stalled)."""


@dataclass
class RequestMetrics:
    """Timeline of one request in virtual µs; None means it never happened."""

    arrival_us: float
    first_scheduled_us: float | None = None  # first appearance in a plan (not admission)
    first_token_us: float | None = None
    completed_us: float | None = None
    generated: int = 0
    max_inter_token_gap_us: float | None = None
    last_token_us: float | None = None

    @property
    def queue_wait_us(self) -> float | None:
        return None if self.first_scheduled_us is None else self.first_scheduled_us - self.arrival_us

    @property
    def ttft_us(self) -> float | None:
        return None if self.first_token_us is None else self.first_token_us - self.arrival_us

    @property
    def latency_us(self) -> float | None:
        return None if self.completed_us is None else self.completed_us - self.arrival_us

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(queue_wait_us=self.queue_wait_us, ttft_us=self.ttft_us,
                   latency_us=self.latency_us)
        return out


@dataclass
class SimulationReport:
    requests: dict[str, RequestMetrics] = field(default_factory=dict)  # ordered by id
    makespan_us: float = 0
    iterations: int = 0
    prefill_iterations: int = 0
    decode_iterations: int = 0
    mixed_iterations: int = 0
    mean_batch_size: float = 0.0
    mean_token_occupancy: float = 0.0  # fraction of max_tokens_per_iteration

    @property
    def throughput_rps(self) -> float:
        return len(self.requests) * 1e6 / self.makespan_us if self.makespan_us else 0.0

    def _present(self, attr: str) -> list[float]:
        return [v for v in (getattr(m, attr) for m in self.requests.values()) if v is not None]

    def summary(self) -> dict[str, Any]:
        """The model-outcome figures of one §5.6 row, in µs and fractions (unformatted)."""
        gaps = [m.max_inter_token_gap_us or 0 for m in self.requests.values()]
        ttft = self._present("ttft_us")
        return {
            "requests": len(self.requests),
            "makespan_us": self.makespan_us,
            "request_s": self.throughput_rps,
            "p95_queue_us": percentile(self._present("queue_wait_us"), 95),
            "p50_ttft_us": percentile(ttft, 50),
            "p95_ttft_us": percentile(ttft, 95),
            "p95_latency_us": percentile(self._present("latency_us"), 95),
            "p95_max_itl_us": percentile(gaps, 95),
            "mean_batch": self.mean_batch_size,
            "mean_token_occupancy": self.mean_token_occupancy,
            "prefill_iterations": self.prefill_iterations,
            "decode_iterations": self.decode_iterations,
            "mixed_iterations": self.mixed_iterations,
            "iterations": self.iterations,
        }

    def as_dict(self) -> dict[str, Any]:
        return {**self.summary(),
                "per_request": {rid: m.as_dict() for rid, m in self.requests.items()}}


def validate_requests(requests: Iterable[SimRequest]) -> list[SimRequest]:
    out = list(requests)
    if not out:
        raise ValueError("simulation needs at least one request")
    seen: set[str] = set()
    for request in out:
        if not isinstance(request, SimRequest):
            raise TypeError(f"expected SimRequest, got {type(request).__name__}")
        if request.id in seen:
            raise ValueError(f"duplicate simulated request id: {request.id}")
        seen.add(request.id)
        if request.prompt_tokens == 0:
            raise ValueError(f"request {request.id} has no prompt tokens")
        if request.output_tokens == 0:
            raise ValueError(f"request {request.id} has no output tokens")
        if request.prefix_tokens > request.prompt_tokens:
            raise ValueError(f"request {request.id} has more prefix tokens "
                             f"({request.prefix_tokens}) than prompt tokens ({request.prompt_tokens})")
    return out


# The trace's phase names (docs/lab.md), by phase value: the format does not follow the enum's
# member spelling.
_PHASE_NAMES = {0: "Prefill", 1: "Recompute", 2: "Decode"}


def _phase_name(phase: IterationPhase) -> str:
    return _PHASE_NAMES[phase.value]


def _fmt(value: object) -> str:
    """A trace value: plain integer µs, `None` when it never happened. Fractional values (a
    cost model with non-integer constants) print with at most three decimals."""
    if value is None:
        return "None"
    if isinstance(value, float):
        if value.is_integer():
            return str(int(value))
        return f"{value:.3f}".rstrip("0").rstrip(".")
    return str(value)


class _TraceWriter:
    """Appends the §5.7 line of every plan while it is live (the rows need `plan.work`)."""

    def __init__(self, lines: list[str]) -> None:
        self.lines = lines
        self.iteration = 0

    def __call__(self, plan: Any, start: float, duration: float) -> None:
        rows = " ".join(
            f"{w.sequence_id}:{_phase_name(w.phase)}:{len(w.tokens)}@{w.positions[0]}"
            f"{'*' if w.sample_last else ''}" for w in plan.work)
        self.lines.append(f"it={self.iteration} t={_fmt(start)} dur={_fmt(duration)} "
                          f"admitted={plan.admitted} tokens={plan.token_count} | {rows}")
        self.iteration += 1


def simulate(config: Any, cost: StepCost | None, requests: Iterable[SimRequest], *,
             backend: str | Backend | None = "auto", admission: Any = None,
             preemption: Any = None,
             trace: list[str] | None = None) -> SimulationReport:
    """Run `requests` through a fresh scheduler under `cost` (§5.4). Appends the §5.7 trace
    lines to `trace` when given."""
    cost = cost or LAB_COST
    reqs = sorted(validate_requests(requests), key=lambda r: (r.arrival_us, r.id))
    config = config.normalized()
    scheduler = resolve_backend(backend).make(config, admission=admission, preemption=preemption)

    def refuse(request: Any, exc: BaseException) -> None:
        raise SimulationError(f"submit of {request.id} failed: {exc}") from exc

    engine = Engine(scheduler, CostModelHost(token=1), clock=VirtualClock(cost),
                    on_plan=_TraceWriter(trace) if trace is not None else None,
                    on_reject=refuse)
    try:
        run = engine.run(reqs)
    except EngineStalled as exc:
        raise SimulationError(f"scheduler stalled: {exc}") from exc

    report = SimulationReport()
    for r in sorted(run.records, key=lambda r: r.id):
        report.requests[r.id] = RequestMetrics(
            arrival_us=r.arrival_us, first_scheduled_us=r.first_scheduled_us,
            first_token_us=r.first_token_us, completed_us=r.finished_us,
            generated=len(r.tokens), max_inter_token_gap_us=r.max_itl_us,
            last_token_us=r.token_times_us[-1] if r.token_times_us else None)
    report.makespan_us = run.makespan_us
    report.iterations = run.iterations
    report.prefill_iterations, report.decode_iterations, report.mixed_iterations = run.phase_mix()
    its = run.iteration_arrays()
    if report.iterations:
        capacity = config.max_tokens_per_iteration
        report.mean_batch_size = int(its["rows"].sum()) / report.iterations
        # Summed in iteration order, one fraction at a time (the figures are compared exactly).
        report.mean_token_occupancy = sum(t / capacity for t in its["tokens"].tolist()) \
            / report.iterations
    if trace is not None:
        for rid, m in report.requests.items():
            trace.append(f"req {rid}: arrival={_fmt(m.arrival_us)} first_sched={_fmt(m.first_scheduled_us)} "
                         f"first_tok={_fmt(m.first_token_us)} done={_fmt(m.completed_us)} "
                         f"gen={m.generated} max_gap={_fmt(m.max_inter_token_gap_us)}")
    return report
