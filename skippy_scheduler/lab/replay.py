"""Trace replay: a production trace driven through the engine under one admission policy.

Each run is the `Engine` on a `VirtualClock` with the lab host (`LabHost`, lab/host.py): echo
sampling, like the workload suite, with

* the bounded block prefix cache (`prefix_cache_tokens`; `BlockPrefixCache`, lab/prefix.py),
  attached to the scheduler, which reads each request's restore from it at submit and re-reads,
  immediately before every admission selection, the waiting requests under the blocks inserted
  or evicted since (natively, counted in `stale_refreshes`);
* the KV-cell memory model (`kv_capacity_tokens`), exactly as in the suite; a preempted
  request's restore is re-read when it re-enters the queue;
* per-tenant service (`TenantService`, lab/tenants.py) when the trace has more than one tenant
  (a trace field or `tenants=K`). Under fair share every sequence carries its tenant
  (`Sequence.tenant`) and the scheduler charges completed rows itself; only a fair-share
  policy run from Python (a non-default inner order) is charged by the host.
"""
from __future__ import annotations

import importlib
from typing import Any, Callable, Hashable, Iterable, Iterator, Mapping, Optional

import numpy as np

from ..cost_model import LAB_COST, StepCost
from ..policies import FairShareAdmission
from ..selection import POLICIES, make_admission as _by_name
from ..types import SchedulerConfig
from .backend import Backend, resolve_backend
from .driver import LabRun, Latency, drive
from .host import LabHost
from .options import DEFAULT_PREFIX_CACHE_TOKENS, MODES, ReplayOptions
from .tails import tail_figures
from .prefix import BlockPrefixCache
from .tenants import NO_TENANT, TenantService, jain_index
from .traces import Trace, TraceRequest

DEFAULT_MODE = "mixed"


def make_admission(name: str, weights: Optional[Mapping[Hashable, float]] = None) -> Any:
    """The admission policy named `name` (the package's one table: `skippy_scheduler.selection`);
    `weights` are fair-share's tenant weights."""
    return _by_name(name, weights if name == "fair-share" else None)


ReplayRun = LabRun  # one replay run: figures, plot series, per-request arrays


def _progress_bar(total: Optional[int], label: str, enabled: Optional[bool]) -> Any:
    import sys

    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled:
        return None
    try:
        tqdm = importlib.import_module("tqdm").tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=label, unit="req", leave=False, mininterval=0.5,
                file=sys.stderr)


def replay_host(sched: Any, options: ReplayOptions, cost: StepCost,
                fair_share: Optional[FairShareAdmission] = None) -> LabHost:
    """The lab host of a replay: the block prefix cache (unless `prefix_cache_tokens` is 0),
    the memory model and tenant service."""
    cap = options.prefix_cache_tokens
    prefix = None if cap == 0 else BlockPrefixCache(sched, cap, max(0, round(cost.per_prefill_token_us)))
    return LabHost(sched, prefix=prefix, memory=options.kv_capacity_tokens > 0,
                   reserve=options.reserve, tenants=TenantService(fair_share))


def _has_tenants(trace: Trace) -> bool:
    """Whether the trace's requests carry tenants (a whole pass over the file unless the last
    one, such as the command's check, was complete)."""
    if trace.tenants is not None:
        return True
    if not trace.stats.complete:
        for _ in trace:
            pass
    return bool(trace.stats.tenants)


def run_replay(trace: Trace, policy: str, mode: str = DEFAULT_MODE,
               options: Optional[ReplayOptions] = None, cost: Optional[StepCost] = None,
               *, backend: str | Backend | None = "auto", progress: Optional[bool] = None,
               on_plan: Optional[Callable[[Any, float, float], None]] = None,
               host_hook: Optional[Callable[[LabHost], None]] = None,
               total: Optional[int] = None) -> ReplayRun:
    """Replay `trace` under one admission policy and planning mode.

    progress: a progress bar on stderr (None = only when stderr is a terminal); `total` is its
    number of requests (default: the file's row count). on_plan: the engine's hook, called with
    every plan after the host ran it. host_hook(host): called once before the run (tests)."""
    options = (options or ReplayOptions()).validate()
    cost = cost or LAB_COST
    config = options.config(mode, cost)
    admission = make_admission(policy, options.tenant_weights)
    sched = resolve_backend(backend).make(config, admission=admission)
    # A Python-run policy's resolved copy in the scheduler shares these counters (the host
    # charges them); the native kind keeps its own (the host: tenants only).
    fair = admission if isinstance(admission, FairShareAdmission) else None
    host = replay_host(sched, options, cost, fair)
    if options.slo_told:
        host.slo = (options.ttft_target_ms / 1e3, options.itl_target_ms / 1e3)
    if host_hook is not None:
        host_hook(host)
    if total is None and progress is not False:
        total = trace.count_rows()
    bar = _progress_bar(total, f"{policy}/{mode}", progress)
    shown = [0]

    def update(done: int) -> None:
        bar.update(done - shown[0])
        shown[0] = done

    # Tenant accounting is needed only when requests have tenants (--tenants, or a tenant
    # field on any row: a pass over the file tells, the caller's check pass if it made one).
    host.tenants.enabled = _has_tenants(trace)
    requests = iter(trace)
    first = next(requests, None)
    if first is None:
        raise ValueError(f"{trace.path}: the trace has no requests")

    def chained() -> Iterator[TraceRequest]:
        yield first
        yield from requests

    try:
        report, wall = drive(sched, host, chained(), cost, label=f"{policy}/{mode}",
                             stalled_hint="; a request needs at least prompt + max(min("
                                          "output, --reserve-output-tokens), output - 2) "
                                          "cells of --kv-capacity-tokens",
                             progress=update if bar is not None else None, on_plan=on_plan)
    finally:
        if bar is not None:
            bar.close()
    return _figures(policy, mode, options, config, host, report, wall, sched)


def _figures(policy: str, mode: str, options: ReplayOptions, config: SchedulerConfig,
             host: LabHost, report: Any, wall: float, sched: Any) -> ReplayRun:
    out_len = np.asarray(host.output_len, dtype=np.int64)
    lat = Latency.of(report, out_len, options.ttft_target_ms, options.itl_target_ms, "replay")
    per, timeline, its = lat.per, lat.timeline, lat.its
    n = len(out_len)
    gen = timeline.generated
    makespan_us = report.makespan_us
    makespan_s = makespan_us / 1e6
    busy_us = float(its["duration_us"].sum())
    preemptions = int(per["preemptions"].sum())
    prefix = host.prefix
    store = prefix.store if isinstance(prefix, BlockPrefixCache) else None
    completed = int(np.count_nonzero(~np.isnan(per["finished_us"])))
    figures: dict[str, Any] = {
        "policy": policy,
        "mode": mode,
        "requests": n,
        "completed": completed,
        "wall_s": wall,
        "iterations": report.iterations,
        "makespan_s": makespan_s,
        "utilisation": busy_us / makespan_us if makespan_us else 0.0,
        "throughput_rps": completed / makespan_s if makespan_s else 0.0,
        "output_tokens_per_s": float(gen.sum()) / makespan_s if makespan_s else 0.0,
        "goodput_rps": float(lat.good.sum()) / makespan_s if makespan_s else 0.0,
        "goodput_fraction": float(lat.good.mean()) if n else 0.0,
        "mean_batch": float(its["rows"].mean()) if report.iterations else 0.0,
        "prompt_tokens": host.prompt_tokens,
        "hit_tokens": host.hit_tokens,
        "hit_rate": host.hit_tokens / host.prompt_tokens if host.prompt_tokens else 0.0,
        "evictions": store.evictions if store is not None else 0,
        "evicted_tokens": store.evicted_tokens if store is not None else 0,
        "uncached_blocks": prefix.uncached_blocks if isinstance(prefix, BlockPrefixCache) else 0,
        "stale_refreshes": int(sched.metrics().stale_refreshes),
        "preemptions": preemptions,
        "recomputed_tokens": int(sched.metrics().recompute_tokens),
        "p99_max_itl_ms": lat.p99_max_gap_ms(),
        **slo_figures(lat, options, makespan_s),
    }
    lat.add_percentiles(figures)
    (figures["tenants"], figures["tenant_service_tokens_per_s"],
     figures["jain_index"]) = host.tenants.figures(makespan_us)
    if host.tenants.enabled:  # what the rates are over: "arrivals", or "run" for a burst
        figures["tenant_service_window"] = host.tenants.window
    series = None
    arrival = per["arrival_us"]
    first_sched = per["first_scheduled_us"]
    if options.record_series:
        series = {"time_s": its["start_us"] / 1e6, "waiting": its["waiting"],
                  "batch": its["rows"], "tokens": its["tokens"],
                  "max_tokens": config.max_tokens_per_iteration,
                  "admit_time_s": np.asarray(host.admit_time) / 1e6,
                  "admit_restore": np.asarray(host.admit_restore, dtype=np.int64),
                  "admit_prompt": np.asarray(host.admit_prompt, dtype=np.int64),
                  "arrival_s": arrival / 1e6, "first_scheduled_s": first_sched / 1e6}
    per_request = {"arrival_us": arrival, "first_scheduled_us": first_sched,
                   "first_token_us": timeline.first_token_us,
                   "completed_us": timeline.last_token_us, "generated": gen,
                   "restored_tokens": np.asarray(host.restored, dtype=np.int64),
                   "preemptions": per["preemptions"],
                   "max_inter_token_gap_us": timeline.max_gap_us}
    # A trace without tenants is one group, "all" (its requests' tenant is None); in one with
    # tenants, the rows that name none are the tenant "(none)", as in the tenant table.
    nameless = NO_TENANT if host.tenants.enabled else "all"
    names = [nameless if name is None else name for name in host.tenants.names]
    if host.tenants.enabled:
        per_request["tenant"] = np.asarray([str(names[k]) for k in host.tenant_of])
    run = ReplayRun(policy, mode, figures, series, lat.ttft, per_request)
    run.tails = tail_figures(timeline, options.itl_target_ms,
                             [names[t] if t < len(names) else t for t in host.tenant_of],
                             "tenant")
    return run


def slo_figures(lat: Latency, options: ReplayOptions, makespan_s: float) -> dict[str, Any]:
    """The run against the SLO its targets make (first token within ttft_target_ms, every
    gap within itl_target_ms: the largest, not the mean the goodput above bounds): the share
    within it, those per second, and the misses by reason (only the first token late, only a
    gap over, both)."""
    late = lat.ttft > options.ttft_target_ms * 1e3
    gappy = lat.timeline.max_gap_us > options.itl_target_ms * 1e3
    n = len(late)
    within = int(np.count_nonzero(~late & ~gappy))
    return {"slo_fraction": within / n if n else 0.0,
            "slo_goodput_rps": within / makespan_s if makespan_s else 0.0,
            "slo_missed_ttft": int(np.count_nonzero(late & ~gappy)),
            "slo_missed_gaps": int(np.count_nonzero(gappy & ~late)),
            "slo_missed_both": int(np.count_nonzero(late & gappy))}


def run_replays(trace: Trace, policies: Iterable[str] = POLICIES, mode: str = DEFAULT_MODE,
                options: Optional[ReplayOptions] = None, cost: Optional[StepCost] = None,
                *, backend: str | Backend | None = "auto", progress: Optional[bool] = None,
                on_run: Optional[Callable[[ReplayRun], None]] = None,
                total: Optional[int] = None) -> list[ReplayRun]:
    """`run_replay` for each policy in turn; `on_run(run)` as each one finishes."""
    runs = []
    for policy in policies:
        run = run_replay(trace, policy, mode, options, cost, backend=backend, progress=progress,
                         total=total)
        runs.append(run)
        if on_run is not None:
            on_run(run)
    return runs


__all__ = ["DEFAULT_MODE", "DEFAULT_PREFIX_CACHE_TOKENS", "MODES", "POLICIES", "ReplayOptions",
           "ReplayRun", "jain_index", "make_admission", "replay_host", "run_replay",
           "run_replays"]
