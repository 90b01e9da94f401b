"""The lab's model of staged serving (docs/lab.md, "Staged serving"): P stages, G groups.

A model split into P stages runs each plan on stage 0, then stage 1, ... then the last stage,
whose samples travel back to the driver; between two stages (and from the last stage back to
the driver when P > 1) a plan pays a hop latency. A stage works on one plan at a time, first
come first served, so with several plans in flight the stages work at once.

A sequence's decode row needs the token its previous plan sampled, so a plan's sequences cannot
be in the next plan until it has left the last stage. Real staged serving forms such groups in
one scheduler (`disjoint_inflight_plans`, docs/behaviour.md §2.11a); here the groups are
modelled apart: the requests are dealt to G groups in arrival order (request i to group
i mod G), each group is a real scheduler (native or twin) with the whole configuration (the step budget is per
group), and a group makes its next plan when its previous one has come back, plus the driver's
overhead. Up to G plans are in flight; the pipeline fills when G >= P.

Time is virtual: a plan costs stage k `costs[k].duration_us(prefill tokens, decode rows)`; a
sampled token is timed when its plan leaves the last stage (plus the hop back). With P = 1 and
G = 1 (no hop, no overhead) this is the lab's `simulate` run step for step.

Each group runs on an `Engine` of its own (the same step path as every other driver) with the
lab's `CostModelHost`: the group's clock charges a plan its trip through the stages shared by
all groups (waiting for a busy stage included), and an observer times the samples, the plans
and the ends. The driver only picks whose turn it is (the group whose last plan came back
first) and hands each group its requests as their arrival comes.

The closed form for a steady decode of b rows per group: a group's round trip is
C = sum_k s_k + H*hop + overhead (s_k = stage k's cost of b decode rows, H = P hops for P > 1,
none for P = 1), and the slowest stage must serve G plans per round, so the inter-token gap is
max(C, G * max_k s_k) and the output rate G*b / that gap.
"""
from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterable, NoReturn, Optional, Sequence as Seq

from ..cost_model import StepCost, check_clock_cost
from ..engine import BaseObserver, CostModelHost, Engine, EngineStalled, percentile
from ..types import IterationTelemetry
from .backend import Backend, resolve_backend
from .model import SimRequest
from .simulate import SimulationError, validate_requests

__all__ = ["StagedPipeline", "StagedReport", "closed_form", "run_staged", "staged_table"]

MAX_STAGES = 64


@dataclass(frozen=True)
class StagedPipeline:
    """P stages (one cost model each), the hop latency (µs) and the driver's overhead per plan."""

    costs: tuple[StepCost, ...]
    hop_us: float = 0.0
    overhead_us: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.costs, tuple) or not 1 <= len(self.costs) <= MAX_STAGES:
            raise ValueError(f"a pipeline needs a tuple of 1-{MAX_STAGES} stage cost models")
        for c in self.costs:
            check_clock_cost("a stage cost", c)
        for name in ("hop_us", "overhead_us"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < float("inf"):
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")

    @classmethod
    def uniform(cls, stages: int, cost: StepCost, hop_us: float = 0.0,
                overhead_us: float = 0.0) -> "StagedPipeline":
        """`stages` stages of one cost each (the whole model's cost split evenly is the
        caller's choice: this does not divide it)."""
        if isinstance(stages, bool) or not isinstance(stages, int):
            raise TypeError("stages must be an int")
        return cls(tuple([cost] * stages), hop_us, overhead_us)

    @property
    def stages(self) -> int:
        return len(self.costs)

    @property
    def hops(self) -> int:
        """Hops per round trip: P - 1 forward and one back to the driver; none for one stage."""
        return self.stages if self.stages > 1 else 0


def closed_form(pipeline: StagedPipeline, groups: int, rows: int) -> dict[str, float]:
    """Round trip, inter-token gap (µs) and output tokens/s of a steady decode of `rows` decode
    rows in each of `groups` groups (module docstring)."""
    s = [c.duration_us(0, rows) for c in pipeline.costs]
    trip = sum(s) + pipeline.hops * pipeline.hop_us + pipeline.overhead_us
    gap = max(trip, groups * max(s))
    return {"round_trip_us": trip, "slowest_stage_us": max(s), "gap_us": gap,
            "tokens_s": groups * rows * 1e6 / gap, "full": float(groups * max(s) >= trip)}


@dataclass
class StagedReport:
    """Per-request token times (virtual µs) of one staged run, and the figures of the table."""

    stages: int
    groups: int
    token_times: dict[str, list[float]] = field(default_factory=dict)  # ordered by id
    arrival_us: dict[str, float] = field(default_factory=dict)
    completed_us: dict[str, float] = field(default_factory=dict)
    makespan_us: float = 0.0
    plans: int = 0

    def gaps(self) -> list[float]:
        return [b - a for t in self.token_times.values() for a, b in zip(t, t[1:])]

    def summary(self) -> dict[str, float]:
        """Output tokens/s over the whole run (first arrival to last token), and the decode
        rate (tokens after each request's first, over first to last token), mean and p99 gap."""
        tokens = sum(len(t) for t in self.token_times.values())
        firsts = [t[0] for t in self.token_times.values() if t]
        lasts = [t[-1] for t in self.token_times.values() if t]
        span = max(lasts) - min(firsts) if firsts else 0.0
        gaps = self.gaps()
        return {"tokens": tokens, "makespan_us": self.makespan_us,
                "tokens_s": tokens * 1e6 / self.makespan_us if self.makespan_us else 0.0,
                "decode_tokens_s": (tokens - len(firsts)) * 1e6 / span if span else 0.0,
                "mean_gap_us": sum(gaps) / len(gaps) if gaps else 0.0,
                "p99_gap_us": float(percentile(gaps, 99)), "plans": self.plans}


class _StageLine:
    """The P stages every group's plans go through: when each stage is next free."""

    __slots__ = ("costs", "hop_us", "back_us", "free")

    def __init__(self, pipeline: StagedPipeline) -> None:
        self.costs = pipeline.costs
        self.hop_us = pipeline.hop_us
        self.back_us = pipeline.hop_us if pipeline.stages > 1 else 0.0  # last stage -> driver
        self.free = [0.0] * pipeline.stages

    def run(self, t: float, prefill: int, decode: int) -> float:
        """A plan that leaves the driver at `t`: when its samples are back at the driver."""
        free = self.free
        for k, cost in enumerate(self.costs):
            if k:
                t += self.hop_us
            start = max(t, free[k])
            t = free[k] = start + cost.duration_us(prefill, decode)
        return t + self.back_us


class _GroupClock:
    """One group's engine clock (an `engine.Clock`). The driver moves it to the group's turn
    (`turn`); a plan is charged its trip through the shared stages, waits for busy ones
    included, so `now()` after a step is when its samples came back."""

    def __init__(self, line: _StageLine) -> None:
        self._line = line
        self._now = 0.0

    def turn(self, t: float) -> None:
        self._now = t

    def start(self) -> None:
        return None  # time is the driver's: the group's first turn sets it

    def now(self) -> float:
        return self._now

    def charge(self, prompt_tokens: int, decode_rows: int, measured_us: float) -> float:
        start = self._now
        self._now = self._line.run(start, prompt_tokens, decode_rows)
        return self._now - start

    def wait_until(self, t_us: float, wake: Any = None) -> None:
        self._now = max(self._now, t_us)


class _StageTimes(BaseObserver):
    """An engine observer writing the report: each sample's time, each plan, each end."""

    wants_samples = True

    def __init__(self, report: StagedReport, clock: _GroupClock) -> None:
        self._report = report
        self._clock = clock

    def sampled(self, flight: Any, rows: list[int], tokens: Any, end_us: float) -> None:
        times = self._report.token_times
        ids = flight.plan.sequence_ids
        for row in rows:
            times[ids[row]].append(end_us)

    def completed(self, flight: Any, duration_us: float, telemetry: IterationTelemetry) -> None:
        report, t = self._report, self._clock.now()
        report.plans += 1
        for rid in list(telemetry.finished_ids) + list(telemetry.failed_ids):
            report.completed_us[rid] = t
        report.makespan_us = max(report.makespan_us, t)


def _refuse(request: Any, exc: BaseException) -> NoReturn:
    raise exc  # a refused submit ends the run (run_staged names the request)


class _Group:
    """One sequence group: an engine on its own scheduler, its clock, its requests to come."""

    __slots__ = ("engine", "clock", "pending")

    def __init__(self, scheduler: Any, line: _StageLine, report: StagedReport) -> None:
        self.clock = _GroupClock(line)
        # The model's durations include waiting for busy stages: not what the scheduler's
        # calibration measures, so nothing is observed (observe=False).
        self.engine = Engine(scheduler, CostModelHost(token=1), clock=self.clock, record=False,
                             observe=False, on_reject=_refuse)
        self.engine.observers.append(_StageTimes(report, self.clock))
        self.pending: deque[SimRequest] = deque()  # not submitted yet, by arrival

    def next_arrival(self) -> float:
        return float(self.pending[0].arrival_us)


def run_staged(config: Any, pipeline: StagedPipeline, groups: int,
               requests: Iterable[SimRequest], *,
               backend: str | Backend | None = "auto") -> StagedReport:
    """Run `requests` through a P-stage pipeline with `groups` groups (module docstring).

    Each group runs on an `Engine` of its own, one plan at a time (the groups are the plans in
    flight), so `config.max_inflight_plans` must be 1."""
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
        raise ValueError(f"groups must be an int >= 1, got {groups!r}")
    reqs = sorted(validate_requests(requests), key=lambda r: (r.arrival_us, r.id))
    config = config.normalized()
    if config.max_inflight_plans != 1:
        raise ValueError("the staged model runs one plan per group at a time (the groups are "
                         "its plans in flight): max_inflight_plans must be 1, got "
                         f"{config.max_inflight_plans}")
    make = resolve_backend(backend).make
    report = StagedReport(pipeline.stages, groups)
    line = _StageLine(pipeline)
    team = [_Group(make(config), line, report) for _ in range(min(groups, len(reqs)))]
    for i, r in enumerate(reqs):
        team[i % len(team)].pending.append(r)
    for r in sorted(reqs, key=lambda r: r.id):
        report.token_times[r.id] = []
        report.arrival_us[r.id] = float(r.arrival_us)
    heap = [(g.next_arrival(), i) for i, g in enumerate(team)]
    heapq.heapify(heap)
    while heap:
        now, gi = heapq.heappop(heap)
        g = team[gi]
        engine = g.engine
        g.clock.turn(now)
        while g.pending and g.pending[0].arrival_us <= now:
            r = g.pending.popleft()
            try:
                engine.submit(r)
            except Exception as exc:
                raise SimulationError(f"submit of {r.id} failed: {exc}") from exc
        if not engine.outstanding:
            if g.pending:
                heapq.heappush(heap, (g.next_arrival(), gi))
            continue
        try:
            engine.step()  # plan, the trip through the stages, complete
        except EngineStalled as exc:
            raise SimulationError(f"group {gi} made an empty plan at {now} µs with "
                                  f"{engine.outstanding} requests live") from exc
        if engine.outstanding or g.pending:
            nxt = g.clock.now() + pipeline.overhead_us
            if not engine.outstanding:
                nxt = max(nxt, g.next_arrival())
            heapq.heappush(heap, (nxt, gi))
    return report


def staged_table(config: Any, cost: StepCost, requests: Seq[SimRequest],
                 stages: Seq[int] = (1, 2, 3, 4), hop_us: float = 0.0,
                 overhead_us: float = 0.0, split: bool = True,
                 backend: str | Backend | None = "auto") -> list[dict[str, Any]]:
    """One row per (P, G <= P): simulated figures beside the closed form. With `split`, each
    stage costs 1/P of `cost`'s per-token and per-row terms (the layers are divided), keeping
    the whole iteration overhead on every stage; without it every stage costs `cost`."""
    rows: list[dict[str, Any]] = []
    decode = max(r.output_tokens for r in requests) > 1
    # A group decodes at most this many rows at once (its scheduler's limits): a larger burst
    # runs in waves of them, which is what the closed form's b is.
    limits = config.normalized()
    most = min(limits.max_active_sequences, limits.max_tokens_per_iteration)
    for p in stages:
        stage_cost = _split_cost(cost, p) if split else cost
        pipe = StagedPipeline.uniform(p, stage_cost, hop_us, overhead_us)
        for g in range(1, p + 1):
            sim = run_staged(config, pipe, g, requests, backend=backend).summary()
            per_group = min(-(-len(requests) // g), most) if decode else 0
            form = closed_form(pipe, g, per_group)
            rows.append({"stages": p, "groups": g, **sim,
                         "form_gap_us": form["gap_us"], "form_tokens_s": form["tokens_s"],
                         "full": bool(form["full"])})
    return rows


def _split_cost(cost: StepCost, p: int) -> StepCost:
    return StepCost(base_us=cost.base_us, per_prefill_token_us=cost.per_prefill_token_us / p,
                    decode_base_us=cost.decode_base_us / p,
                    per_decode_row_us=cost.per_decode_row_us / p)


def format_staged(rows: Seq[dict[str, Any]], header: Optional[list[str]] = None) -> str:
    """The staged table, tab-separated under '#' comment lines."""
    lines = [f"# {h}" for h in (header or [])]
    lines.append("stages\tgroups\ttokens_s\tdecode_tokens_s\tform_tokens_s\tmean_gap_us\t"
                 "p99_gap_us\tform_gap_us\tpipeline")
    for r in rows:
        lines.append(f"{r['stages']}\t{r['groups']}\t{r['tokens_s']:.0f}\t"
                     f"{r['decode_tokens_s']:.0f}\t{r['form_tokens_s']:.0f}\t"
                     f"{r['mean_gap_us']:.1f}\t{r['p99_gap_us']:.1f}\t{r['form_gap_us']:.1f}\t"
                     f"{'full' if r['full'] else 'not full'}")
    return "\n".join(lines) + "\n"
