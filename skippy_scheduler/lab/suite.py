"""Workload suite: one seeded trace, replayed under several admission policies and planning
modes, with latency percentiles, goodput, batching and cache figures per run.

Each run is the `Engine` on a `VirtualClock` with the lab host (`LabHost`, lab/host.py): echo
sampling, the family prefix cache (`FamilyPrefixCache`, lab/prefix.py) and, with
`kv_capacity_tokens`, the KV-cell memory model (admission reserves prompt + min(output,
reserve_output_tokens) cells; after each iteration the cells actually held are reported and
the engine preempts; a preempted request drops its cells and later recomputes).
The fake model predicts each sampling row's last input token: a workload prompt ends with its
request's marker token, so every request samples its own marker (`workload.py`).
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

import numpy as np

from ..cost_model import LAB_COST, StepCost
from ..selection import make_admission as by_name
from ..types import Sequence
from .backend import Backend, resolve_backend
from .driver import LabRun, Latency, drive, nearest_rank
from .host import LabHost
from .options import MODES, SuiteOptions
from .tails import tail_figures
from .prefix import FamilyPrefixCache
from .progress import Progress
from .workload import Workload

POLICIES = ("fcfs", "cache-aware-noaging", "cache-aware-aging", "priority")

__all__ = ["MODES", "POLICIES", "SUITE_COLUMNS", "SuiteOptions", "SuiteRequest", "SuiteRun",
           "format_suite", "make_admission", "nearest_rank", "run_policy", "run_suite",
           "suite_units"]


def make_admission(name: str) -> Any:
    """The admission policy named `name` (the package's one table: `skippy_scheduler.selection`)."""
    return by_name(name)


SuiteRun = LabRun  # one suite run: figures, plot series, per-request arrays


class SuiteRequest:
    """Request `r` of a workload, built into a Sequence only when it arrives."""

    __slots__ = ("id", "arrival_us", "r", "_workload")

    tenant = None  # the suite has one tenant

    def __init__(self, workload: Workload, r: int, arrival_us: float) -> None:
        self.id = workload.request_id(r)
        self.arrival_us = arrival_us
        self.r = r
        self._workload = workload

    @property
    def input_length(self) -> int:
        w = self._workload
        f = int(w.family[self.r])
        return int(w.suffix_len[self.r]) + (int(w.family_prefix[f]) if f >= 0 else 0)

    @property
    def output_length(self) -> int:
        return int(self._workload.output_len[self.r])

    def prompt_array(self) -> np.ndarray:
        return self._workload.prompt(self.r)

    def drop_prompt(self) -> None:
        return None

    def to_sequence(self) -> Sequence:
        w = self._workload
        r = self.r
        return Sequence(self.id, w.prompt(r).tolist(), int(w.output_len[r]), None,
                        int(w.priority[r]))


def run_policy(workload: Workload, policy: str, mode: str, options: SuiteOptions | None = None,
               cost: StepCost | None = None, *, backend: str | Backend | None = "auto",
               progress: bool | None = None) -> SuiteRun:
    """Replay `workload` under one admission policy and planning mode."""
    options = options or SuiteOptions()
    cost = cost or LAB_COST
    config = options.config(mode, cost)
    sched = resolve_backend(backend).make(config, admission=make_admission(policy))
    n = workload.n
    cache = FamilyPrefixCache(workload, max(0, round(cost.per_prefill_token_us)))
    host = LabHost(sched, prefix=cache, memory=options.kv_capacity_tokens > 0,
                   reserve=options.reserve)
    arrivals = workload.arrival_us.tolist()
    bar = Progress(n, f"{policy}/{mode}", enabled=progress)
    try:
        report, wall = drive(sched, host,
                             (SuiteRequest(workload, r, arrivals[r]) for r in range(n)), cost,
                             label=f"{policy}/{mode}", progress=bar.update, every=512)
    finally:  # cleared on Ctrl-C too, before the interrupt's line
        bar.close()

    metrics = sched.metrics()
    lat = Latency.of(report, workload.output_len, options.ttft_target_ms, options.itl_target_ms,
                     "suite")
    timeline = lat.timeline
    its = lat.its
    iterations = report.iterations
    gen_all = timeline.generated
    makespan_s = report.makespan_us / 1e6
    preempted = lat.per["preemptions"]
    preemptions = int(preempted.sum())
    readmit_hits = int(preempted[cache.has_restore].sum())
    figures = {
        "policy": policy,
        "mode": mode,
        "requests": n,
        "wall_s": wall,
        "iterations": iterations,
        "makespan_s": makespan_s,
        "throughput_rps": n / makespan_s if makespan_s else 0.0,
        "output_tokens_per_s": float(gen_all.sum()) / makespan_s if makespan_s else 0.0,
        "goodput_rps": float(lat.good.sum()) / makespan_s if makespan_s else 0.0,
        "goodput_fraction": float(lat.good.mean()),
        "mean_batch": int(its["rows"].sum()) / iterations if iterations else 0.0,
        "token_occupancy_pct": 100.0 * int(its["tokens"].sum())
        / (iterations * config.max_tokens_per_iteration) if iterations else 0.0,
        "preemptions": preemptions,
        "recomputed_tokens": int(metrics.recompute_tokens),
        "prefix_hits_first": cache.hits,
        "prefix_hit_rate_first": cache.hits / n,
        "readmissions": preemptions,
        "prefix_hits_readmit": readmit_hits,
        # None (JSON null, `-` in the table) without a preemption: a rate of nothing
        "prefix_hit_rate_readmit": readmit_hits / preemptions if preemptions else None,
        "p99_max_itl_ms": lat.p99_max_gap_ms(),
    }
    lat.add_percentiles(figures)
    series = None
    if options.record_series:
        series = {"time_s": its["start_us"] / 1e6, "batch": its["rows"],
                  "tokens": its["tokens"], "waiting": its["waiting"],
                  "max_tokens": config.max_tokens_per_iteration}
    per_request = {"arrival_us": workload.arrival_us, "prompt_tokens": workload.prompt_len,
                   "priority": workload.priority,
                   "first_scheduled_us": lat.per["first_scheduled_us"],
                   "first_token_us": timeline.first_token_us,
                   "completed_us": timeline.last_token_us, "generated": gen_all,
                   "max_inter_token_gap_us": timeline.max_gap_us,
                   "preemptions": lat.per["preemptions"],
                   "prefix_restore": cache.has_restore}
    run = SuiteRun(policy, mode, figures, series, lat.ttft, per_request)
    run.tails = tail_figures(timeline, options.itl_target_ms,
                             [f"priority{p}" for p in workload.priority.tolist()], "priority")
    return run


SUITE_COLUMNS = ("policy", "mode", "p50_queue_ms", "p90_queue_ms", "p99_queue_ms",
                 "p50_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "p50_itl_ms", "p90_itl_ms",
                 "p99_itl_ms", "throughput_rps", "goodput_rps", "mean_batch",
                 "token_occupancy_pct", "preemptions", "recomputed_tokens",
                 "prefix_hit_rate_first", "prefix_hit_rate_readmit", "iterations", "wall_s")


def format_suite(runs: list[SuiteRun]) -> str:
    lines: list[str] = ["\t".join(SUITE_COLUMNS)]
    for run in runs:
        cells = []
        for column in SUITE_COLUMNS:
            value = run.figures[column]
            if value is None:  # undefined (no preemption, no inter-token gap): not 0
                cells.append("-")
            elif isinstance(value, str):
                cells.append(value)
            elif isinstance(value, (int, np.integer)):
                cells.append(str(int(value)))
            elif column.startswith("prefix_hit_rate"):
                cells.append(f"{value:.4f}")
            else:
                cells.append(f"{value:.3f}" if column.endswith("_ms") else f"{value:.2f}")
        lines.append("\t".join(cells))
    return "\n".join(lines) + "\n"


def suite_units(cost: StepCost, options: SuiteOptions) -> str:
    """The suite's legend line: the cost model the virtual times come from, what each kind
    of column counts, and the goodput targets."""
    return (f"virtual time from the cost model {cost} (µs per iteration, docs/lab.md); "
            f"queue, TTFT and inter-token gap (itl) in ms of virtual time (nearest-rank "
            f"percentiles); throughput_rps = requests / makespan; "
            f"goodput_rps = requests/s with TTFT ≤ {options.ttft_target_ms:g} ms and mean "
            f"inter-token gap ≤ {options.itl_target_ms:g} ms (--ttft-target-ms, "
            f"--itl-target-ms); prefix_hit_rate_first = fraction of requests whose first "
            f"admission restored a family prefix, _readmit = fraction of preemptions whose "
            f"request carries one; wall_s = real seconds the run took")


def run_suite(workload: Workload, policies: Iterable[str] = POLICIES,
              modes: Iterable[str] = MODES, options: SuiteOptions | None = None,
              cost: StepCost | None = None, *, backend: str | Backend | None = "auto",
              progress: bool | None = None,
              on_run: Optional[Callable[[SuiteRun], None]] = None) -> list[SuiteRun]:
    runs = []
    for mode in modes:
        for policy in policies:
            run = run_policy(workload, policy, mode, options, cost, backend=backend,
                             progress=progress)
            runs.append(run)
            if on_run is not None:
                on_run(run)
    return runs
