"""Workload suite: one seeded trace, replayed under several admission policies and planning
modes, with latency percentiles, goodput, batching and cache figures per run.

Each run is the `Engine` on a `VirtualClock` with `SuiteHost`, a model-free runtime that adds
two models to `CostModelHost` (kept deliberately simple):
* Prefix cache: one `UnifiedRadixCache` per run, namespace "stage-0". When the first request
  of a family produces its first token, the family prefix becomes resident (never evicted).
  At submit a request's prompt is peeked (no recency change); a hit becomes a prefix restore
  of the matched tokens plus a one-stage affinity (saved cost = matched x prefill_token_us).
  The affinity is frozen at submit, as in a scheduler without a prefix store (§3.5).
* Memory (optional, `kv_capacity_tokens`): one component "kv-cells" at 1 byte per KV cell.
  Admission reserves prompt + min(output, reserve_output_tokens) cells (an optimistic
  reservation). After each iteration the runtime "measures" the cells actually held (for each
  running request, the position after its last fed token) and the engine reports them through
  `preempt_for_component_pressure`; a preempted request drops its cells and later recomputes.
The fake model predicts each sampling row's last input token: a workload prompt ends with its
request's marker token, so every request samples its own marker (`workload.py`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from ..cache_policy import CacheAffinity, StageCacheAffinity
from ..cost_model import RuntimeCostModel
from ..engine import CostModelHost, Engine, EngineStalled, VirtualClock, percentile
from ..radix import UnifiedRadixCache
from ..types import MemoryComponent, PrefixRestore, PrefixRestoreKind, SchedulerConfig, Sequence
from .backend import Backend, resolve_backend
from .progress import Progress
from .workload import Workload

NAMESPACE = "stage-0"
PHASE_PREFILL = 0  # IterationPhase.Prefill.value in plan.phases

POLICIES = ("fcfs", "cache-aware-noaging", "cache-aware-aging", "priority")
MODES = ("phase", "mixed")


def make_admission(name: str):
    from .. import policies

    if name == "fcfs":
        return policies.FcfsAdmission()
    if name == "cache-aware-noaging":
        return policies.CacheAwareAdmission(aging_cost_per_turn=0)
    if name == "cache-aware-aging":
        return policies.CacheAwareAdmission()
    if name == "priority":
        return policies.PriorityAdmission()
    raise ValueError(f"unknown admission policy {name!r} (choose from {', '.join(POLICIES)})")


@dataclass(frozen=True)
class SuiteOptions:
    max_active: int = 32
    max_tokens: int = 2_048
    chunk: int = 512
    kv_capacity_tokens: int = 0  # 0 = no memory component
    reserve_output_tokens: int = 32
    ttft_target_ms: float = 50.0  # goodput targets, in the cost model's virtual time
    itl_target_ms: float = 1.5
    record_series: bool = False

    def config(self, mode: str):
        if mode not in MODES:
            raise ValueError(f"unknown planning mode {mode!r} (choose from {', '.join(MODES)})")
        components = []
        if self.kv_capacity_tokens:
            components = [MemoryComponent("kv-cells", self.kv_capacity_tokens, 0, 1, 0)]
        return SchedulerConfig(
            max_active_sequences=self.max_active,
            sequence_id_limit=max(256, self.max_active + 16),
            max_waiting_sequences=(1 << 62),
            max_tokens_per_iteration=self.max_tokens,
            prefill_chunk_tokens=self.chunk,
            max_consecutive_prefill_iterations=1 if mode == "mixed" else None,
            mixed_prefill_decode=(mode == "mixed"),
            memory_components=components,
        )


@dataclass
class SuiteRun:
    policy: str
    mode: str
    figures: dict = field(default_factory=dict)
    series: dict | None = None  # per-iteration arrays (time_s, batch, tokens, waiting)
    ttft_us: np.ndarray | None = None
    per_request: dict | None = None  # arrays by request index: first_scheduled_us, ...


def nearest_rank(values: np.ndarray, p: float) -> float:
    """The package's one percentile definition (nearest rank, §5.6), as a float."""
    return float(percentile(values, p))


class SuiteRequest:
    """Request `r` of a workload, built into a Sequence only when it arrives."""

    __slots__ = ("id", "arrival_us", "r", "_workload", "_reserve")

    def __init__(self, workload: Workload, r: int, arrival_us: float, reserve: Optional[int]):
        self.id = workload.request_id(r)
        self.arrival_us = arrival_us
        self.r = r
        self._workload = workload
        self._reserve = reserve

    def to_sequence(self) -> Sequence:
        w = self._workload
        r = self.r
        max_tokens = int(w.output_len[r])
        seq = Sequence(self.id, w.prompt(r).tolist(), max_tokens, None, int(w.priority[r]))
        if self._reserve is not None:
            seq = seq.with_admission_tokens(int(w.prompt_len[r]) + min(max_tokens, self._reserve))
        return seq


class SuiteHost(CostModelHost):
    """The suite's model-free runtime: echo sampling, a family prefix cache and KV accounting."""

    def __init__(self, workload: Workload, cost: RuntimeCostModel, memory: bool) -> None:
        super().__init__(token=None)
        self.workload = workload
        self.family_of = workload.family.tolist()
        self.index_of = {workload.request_id(r): r for r in range(workload.n)}
        self.cache = UnifiedRadixCache()
        self.materialized = np.zeros(max(len(workload.family_prefix), 1), dtype=bool)
        self.has_restore = np.zeros(workload.n, dtype=bool)
        self.prefix_hits = 0
        self.prefill_cost = max(0, round(cost.prefill_token_us))
        self.memory = memory
        self.fed = np.zeros(workload.n, dtype=np.int64)  # KV cells a running request holds
        self.usage = 0

    def prepare_sequence(self, seq: Sequence) -> Sequence:
        r = self.index_of[seq.id]
        f = self.family_of[r]
        if f < 0 or not self.materialized[f]:
            return seq
        prompt = seq.prompt_tokens
        match = self.cache.peek_resident(NAMESPACE, prompt)
        if match is None or match.matched_tokens <= 0:
            return seq
        matched = min(match.matched_tokens, len(prompt))
        self.has_restore[r] = True
        self.prefix_hits += 1
        seq = seq.with_prefix_restore(PrefixRestore(f"family-{f}", matched,
                                                    PrefixRestoreKind.ResidentKv))
        return seq.with_cache_affinity(CacheAffinity.from_stage(StageCacheAffinity(
            stage_index=0, matched_tokens=matched, prefill_cost_per_token=self.prefill_cost,
            restore_cost=0, cache_epoch=self.cache.epoch())))

    def execute(self, plan: Any) -> None:
        super().execute(plan)
        phases = bytes(plan.phases)
        if PHASE_PREFILL in phases:
            # A first token means the prompt is in KV: its family prefix becomes resident.
            ids = plan.sequence_ids
            w = self.workload
            for i in plan.sample_rows.tolist():
                if phases[i] == PHASE_PREFILL:
                    f = self.family_of[self.index_of[ids[i]]]
                    if f >= 0 and not self.materialized[f]:
                        self.materialized[f] = True
                        self.cache.insert_resident(NAMESPACE, w.family_prompt_prefix(f),
                                                   int(w.family_prefix[f]), f"family-{f}")
        if self.memory:
            index_of = self.index_of
            owner = np.fromiter((index_of[i] for i in plan.sequence_ids), dtype=np.int64,
                                count=len(plan))
            held = plan.positions[plan.row_offsets[1:] - 1].astype(np.int64) + 1
            self.usage += int((held - self.fed[owner]).sum())
            self.fed[owner] = held

    def release(self, sequence_id: str, reason: object = None) -> None:
        if self.memory:
            r = self.index_of[sequence_id]
            self.usage -= int(self.fed[r])
            self.fed[r] = 0

    def memory_used(self) -> Optional[list[int]]:
        return [self.usage] if self.memory else None


def run_policy(workload: Workload, policy: str, mode: str, options: SuiteOptions | None = None,
               cost: RuntimeCostModel | None = None, *, backend: str | Backend | None = "auto",
               progress: bool | None = None) -> SuiteRun:
    """Replay `workload` under one admission policy and planning mode."""
    options = options or SuiteOptions()
    cost = cost or RuntimeCostModel()
    config = options.config(mode)
    sched = resolve_backend(backend).make(config, admission=make_admission(policy))
    n = workload.n
    memory = options.kv_capacity_tokens > 0
    host = SuiteHost(workload, cost, memory)
    reserve = options.reserve_output_tokens if memory else None
    arrivals = workload.arrival_us.tolist()
    bar = Progress(n, f"{policy}/{mode}", enabled=progress)

    def tick(engine: Engine) -> None:
        if engine.iterations % 512 == 0 and engine.iterations:
            bar.update(len(engine.recorder.ids) - engine.outstanding)  # type: ignore[union-attr]

    engine = Engine(sched, host, clock=VirtualClock(cost), before_step=tick)
    wall_start = time.perf_counter()
    try:
        report = engine.run(SuiteRequest(workload, r, arrivals[r], reserve) for r in range(n))
    except EngineStalled as exc:
        raise RuntimeError(f"scheduler stalled ({policy}/{mode}): {exc}") from exc
    bar.close()
    wall = time.perf_counter() - wall_start

    metrics = sched.metrics()
    out_len = workload.output_len
    per = report.arrays()
    timeline = report.timeline()
    if not np.array_equal(timeline.generated, out_len):
        raise RuntimeError("suite bookkeeping lost tokens: generated counts differ from outputs")
    its = report.iteration_arrays()
    iterations = report.iterations
    arrival = per["arrival_us"]
    first_sched = per["first_scheduled_us"]
    ttft = timeline.first_token_us - arrival
    queue = first_sched - arrival
    done = timeline.last_token_us
    gen_all = timeline.generated
    tpot = np.where(gen_all > 1, (done - timeline.first_token_us) / np.maximum(gen_all - 1, 1), 0.0)
    good = (ttft <= options.ttft_target_ms * 1e3) & (tpot <= options.itl_target_ms * 1e3)
    makespan_s = report.makespan_us / 1e6
    preempted = per["preemptions"]
    preemptions = int(preempted.sum())
    readmit_hits = int(preempted[host.has_restore].sum())
    figures = {
        "policy": policy,
        "mode": mode,
        "requests": n,
        "wall_s": wall,
        "iterations": iterations,
        "makespan_s": makespan_s,
        "throughput_rps": n / makespan_s if makespan_s else 0.0,
        "output_tokens_per_s": float(gen_all.sum()) / makespan_s if makespan_s else 0.0,
        "goodput_rps": float(good.sum()) / makespan_s if makespan_s else 0.0,
        "goodput_fraction": float(good.mean()),
        "mean_batch": int(its["rows"].sum()) / iterations if iterations else 0.0,
        "token_occupancy_pct": 100.0 * int(its["tokens"].sum())
        / (iterations * config.max_tokens_per_iteration) if iterations else 0.0,
        "preemptions": preemptions,
        "recomputed_tokens": int(metrics.recompute_tokens),
        "prefix_hits_first": host.prefix_hits,
        "prefix_hit_rate_first": host.prefix_hits / n,
        "readmissions": preemptions,
        "prefix_hits_readmit": readmit_hits,
        "prefix_hit_rate_readmit": readmit_hits / preemptions if preemptions else 0.0,
        "p99_max_itl_ms": nearest_rank(timeline.max_gap_us, 99) / 1e3,
    }
    for name, values in (("queue", queue), ("ttft", ttft), ("itl", timeline.gaps_us)):
        for p in (50, 90, 99):
            figures[f"p{p}_{name}_ms"] = nearest_rank(values, p) / 1e3
    series = None
    if options.record_series:
        series = {"time_s": its["start_us"] / 1e6, "batch": its["rows"],
                  "tokens": its["tokens"], "waiting": its["waiting"],
                  "max_tokens": config.max_tokens_per_iteration}
    per_request = {"first_scheduled_us": first_sched, "first_token_us": timeline.first_token_us,
                   "completed_us": done, "generated": gen_all,
                   "max_inter_token_gap_us": timeline.max_gap_us,
                   "prefix_restore": host.has_restore}
    return SuiteRun(policy, mode, figures, series, ttft, per_request)

SUITE_COLUMNS = ("policy", "mode", "p50_queue_ms", "p90_queue_ms", "p99_queue_ms",
                 "p50_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "p50_itl_ms", "p90_itl_ms",
                 "p99_itl_ms", "throughput_rps", "goodput_rps", "mean_batch",
                 "token_occupancy_pct", "preemptions", "recomputed_tokens",
                 "prefix_hit_rate_first", "prefix_hit_rate_readmit", "iterations", "wall_s")


def format_suite(runs: list[SuiteRun]) -> str:
    lines = ["\t".join(SUITE_COLUMNS)]
    for run in runs:
        cells = []
        for column in SUITE_COLUMNS:
            value = run.figures[column]
            if isinstance(value, str):
                cells.append(value)
            elif isinstance(value, (int, np.integer)):
                cells.append(str(int(value)))
            elif column.startswith("prefix_hit_rate"):
                cells.append(f"{value:.4f}")
            else:
                cells.append(f"{value:.3f}" if column.endswith("_ms") else f"{value:.2f}")
        lines.append("\t".join(cells))
    return "\n".join(lines) + "\n"


def run_suite(workload: Workload, policies=POLICIES, modes=MODES,
              options: SuiteOptions | None = None, cost: RuntimeCostModel | None = None, *,
              backend: str | Backend | None = "auto", progress: bool | None = None,
              on_run=None) -> list[SuiteRun]:
    runs = []
    for mode in modes:
        for policy in policies:
            run = run_policy(workload, policy, mode, options, cost, backend=backend,
                             progress=progress)
            runs.append(run)
            if on_run is not None:
                on_run(run)
    return runs
