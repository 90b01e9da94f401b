"""The deterministic lab loop (§5.4): submit arrivals, plan, charge virtual time, sample 1s.

`simulate` drives any scheduler with the public API (native or twin, see `backend.py`) and
returns a `SimulationReport` with per-request timings. Every sampled token is the constant 1,
time only moves by the cost model, so two runs of the same inputs give identical reports.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Iterable, Sequence as _Seq

from .backend import Backend, resolve_backend, types_module
from .model import RuntimeCostModel, SimRequest, new_sequence


class SimulationError(RuntimeError):
    """The simulation could not continue (a submit was refused or the scheduler stalled)."""


def percentile(values: _Seq[float], p: float):
    """Nearest-rank percentile: index ceil(len * p / 100) - 1 of the sorted values, clamped;
    an empty list gives 0."""
    if not values:
        return 0
    ordered = sorted(values)
    index = math.ceil(len(ordered) * p / 100) - 1
    return ordered[min(max(index, 0), len(ordered) - 1)]


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
    def queue_wait_us(self):
        return None if self.first_scheduled_us is None else self.first_scheduled_us - self.arrival_us

    @property
    def ttft_us(self):
        return None if self.first_token_us is None else self.first_token_us - self.arrival_us

    @property
    def latency_us(self):
        return None if self.completed_us is None else self.completed_us - self.arrival_us

    def as_dict(self) -> dict:
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

    def _present(self, attr: str) -> list:
        return [v for v in (getattr(m, attr) for m in self.requests.values()) if v is not None]

    def summary(self) -> dict:
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

    def as_dict(self) -> dict:
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


def to_sequence(request: SimRequest, types=None):
    """The scheduler Sequence a simulated request submits as (§5.2)."""
    types = types or types_module()
    seq = new_sequence(types, request.id, request.prompt_ids(), request.output_tokens,
                       request.priority)
    if request.prefix_tokens > 0:
        seq = seq.with_prefix_restore(types.PrefixRestore(
            f"sim-prefix-{request.id}", request.prefix_tokens, types.PrefixRestoreKind.ResidentKv))
    return seq.with_cache_affinity(request.cache_affinity)


def _phase_name(phase) -> str:
    return getattr(phase, "name", str(phase))


def _fmt(value) -> str:
    """A trace value: plain integer µs, `None` when it never happened. Fractional values (a
    cost model with non-integer constants) print with at most three decimals."""
    if value is None:
        return "None"
    if isinstance(value, float):
        if value.is_integer():
            return str(int(value))
        return f"{value:.3f}".rstrip("0").rstrip(".")
    return str(value)


def complete_with_ones(scheduler, plan, sampled: list[int], types):
    """Report token 1 for every sampling row, through the plan's output block when it has one."""
    outputs = getattr(plan, "outputs", None)
    if outputs is not None:
        k = len(sampled)
        outputs.request_indexes[:k] = sampled
        outputs.predicted_tokens[:k] = 1
        outputs.count = k
        return scheduler.complete_iteration(plan)
    return scheduler.complete_iteration(plan, [types.IterationPrediction(i, 1) for i in sampled])


def simulate(config, cost: RuntimeCostModel | None, requests: Iterable[SimRequest], *,
             backend: str | Backend | None = "auto", admission=None, preemption=None,
             trace: list[str] | None = None) -> SimulationReport:
    """Run `requests` through a fresh scheduler under `cost` (§5.4). Appends the §5.7 trace
    lines to `trace` when given."""
    cost = cost or RuntimeCostModel()
    reqs = sorted(validate_requests(requests), key=lambda r: (r.arrival_us, r.id))
    types = types_module()
    config = config.normalized()
    capacity = config.max_tokens_per_iteration
    scheduler = resolve_backend(backend).make(config, admission=admission, preemption=preemption)
    decode_phase = types.IterationPhase.Decode

    metrics = {r.id: RequestMetrics(r.arrival_us) for r in reqs}
    lengths = {r.id: r.output_tokens for r in reqs}
    report = SimulationReport()
    now = 0
    next_arrival = 0
    submitted = completed = 0
    batch_sum = 0
    occupancy_sum = 0.0
    while completed < len(reqs):
        while next_arrival < len(reqs) and reqs[next_arrival].arrival_us <= now:
            request = reqs[next_arrival]
            try:
                scheduler.submit(to_sequence(request, types))
            except Exception as exc:  # AdmissionError and friends abort the run
                raise SimulationError(f"submit of {request.id} failed: {exc}") from exc
            next_arrival += 1
            submitted += 1
        if submitted == completed:  # nothing active or waiting: jump to the next arrival
            if next_arrival >= len(reqs):
                raise SimulationError("no pending arrivals but requests are unfinished")
            now = max(now, reqs[next_arrival].arrival_us)
            continue
        plan = scheduler.plan_iteration()
        work = plan.work
        if not work:
            raise SimulationError(f"scheduler stalled at {now} µs with {submitted - completed} "
                                  "unfinished requests")
        decode_rows = 0
        sampled: list[int] = []
        for i, row in enumerate(work):
            m = metrics[row.sequence_id]
            if m.first_scheduled_us is None:
                m.first_scheduled_us = now
            if row.phase == decode_phase:
                decode_rows += 1
            if row.sample_last:
                sampled.append(i)
        start = now
        token_count = plan.token_count  # read while the plan is live
        duration = cost.duration_us(token_count - decode_rows, decode_rows)
        now += duration
        for i in sampled:
            m = metrics[work[i].sequence_id]
            if m.first_token_us is None:
                m.first_token_us = now
            if m.last_token_us is not None:
                gap = now - m.last_token_us
                if m.max_inter_token_gap_us is None or gap > m.max_inter_token_gap_us:
                    m.max_inter_token_gap_us = gap
            m.last_token_us = now
            m.generated += 1
        if trace is not None:
            rows = " ".join(
                f"{w.sequence_id}:{_phase_name(w.phase)}:{len(w.tokens)}@{w.positions[0]}"
                f"{'*' if w.sample_last else ''}" for w in work)
            trace.append(f"it={report.iterations} t={_fmt(start)} dur={_fmt(duration)} "
                         f"admitted={plan.admitted} tokens={token_count} | {rows}")
        scheduler.observe_iteration_duration(plan, duration / 1e6)
        telemetry = complete_with_ones(scheduler, plan, sampled, types)
        # A request is complete once the scheduler no longer knows it. Only a sampling row can
        # end a sequence: it finishes when its output is full (every token is 1, never an end
        # signal), so those are the ones asked about; should the scheduler's finished + failed
        # count say more ended, every sampled id is asked (a snapshot copies the prompt).
        ended = [work[i].sequence_id for i in sampled]
        full = [rid for rid in ended if metrics[rid].generated >= lengths[rid]]
        gone = telemetry.finished + telemetry.failed
        for rid in sorted(set(ended if gone > completed + len(full) else full)):
            m = metrics[rid]
            if m.completed_us is None and scheduler.sequence(rid) is None:
                m.completed_us = now
                completed += 1
        prompt_rows = len(work) - decode_rows
        if prompt_rows and decode_rows:
            report.mixed_iterations += 1
        elif prompt_rows:
            report.prefill_iterations += 1
        else:
            report.decode_iterations += 1
        report.iterations += 1
        batch_sum += len(work)
        occupancy_sum += token_count / capacity
    report.requests = {rid: metrics[rid] for rid in sorted(metrics)}
    report.makespan_us = now
    if report.iterations:
        report.mean_batch_size = batch_sum / report.iterations
        report.mean_token_occupancy = occupancy_sum / report.iterations
    if trace is not None:
        for rid, m in report.requests.items():
            trace.append(f"req {rid}: arrival={_fmt(m.arrival_us)} first_sched={_fmt(m.first_scheduled_us)} "
                         f"first_tok={_fmt(m.first_token_us)} done={_fmt(m.completed_us)} "
                         f"gen={m.generated} max_gap={_fmt(m.max_inter_token_gap_us)}")
    return report
