"""Workload suite: one seeded trace, replayed under several admission policies and planning
modes, with latency percentiles, goodput, batching and cache figures per run.

The loop is the §5.4 loop made fast: per-request state lives in numpy arrays and plan rows are
mapped back to requests through their token ids (see `workload.py`): a row that ends at the end
of a sequence's replay ends with that request's marker token, and the fake runtime samples the
marker too, so decode rows carry it. Only non-final prompt chunks need the row object.

Models (kept deliberately simple):
* Prefix cache: one `UnifiedRadixCache` per run, namespace "stage-0". When the first request
  of a family produces its first token, the family prefix becomes resident (never evicted).
  At submit time a request's prompt is peeked (no recency change); a hit becomes a prefix
  restore of the matched tokens plus a one-stage affinity (saved cost = matched x
  prefill_token_us). The affinity is frozen at submit, as in the scheduler (§3.5).
* Memory (optional, `kv_capacity_tokens`): one component "kv-cells" at 1 byte per KV cell.
  Admission reserves prompt + min(output, reserve_output_tokens) cells (an optimistic
  reservation). After each iteration the runtime "measures" the cells actually held (for each
  running request, the position after its last fed token) and reports them through
  `preempt_for_component_pressure`; the scheduler preempts while that is over capacity, and a
  preempted request drops its cells and later recomputes.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from .backend import Backend, resolve_backend, types_module
from .model import RuntimeCostModel
from .progress import Progress
from .workload import MARKER_BASE, Workload

NAMESPACE = "stage-0"
PHASE_DECODE = 2  # value of IterationPhase.Decode in plan.phases

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
    max_active: int = 64
    max_tokens: int = 2_048
    chunk: int = 512
    kv_capacity_tokens: int = 0  # 0 = no memory component
    reserve_output_tokens: int = 32
    ttft_target_ms: float = 500.0
    itl_target_ms: float = 50.0
    record_series: bool = False

    def config(self, mode: str):
        if mode not in MODES:
            raise ValueError(f"unknown planning mode {mode!r} (choose from {', '.join(MODES)})")
        types = types_module()
        components = []
        if self.kv_capacity_tokens:
            components = [types.MemoryComponent("kv-cells", self.kv_capacity_tokens, 0, 1, 0)]
        return types.SchedulerConfig(
            max_active_sequences=self.max_active,
            sequence_id_limit=max(256, self.max_active + 16),
            max_waiting_sequences=(1 << 62),
            max_tokens_per_iteration=self.max_tokens,
            prefill_chunk_tokens=self.chunk,
            max_consecutive_prefill_iterations=1 if mode == "mixed" else None,
            mixed_prefill_decode=(mode == "mixed"),
            memory_components=components,
        )


def nearest_rank(values: np.ndarray, p: float) -> float:
    """Same definition as the lab (§5.6): sorted[ceil(n p / 100) - 1], 0 for no values."""
    if len(values) == 0:
        return 0.0
    k = min(max(int(np.ceil(len(values) * p / 100)) - 1, 0), len(values) - 1)
    return float(np.partition(values, k)[k])


@dataclass
class SuiteRun:
    policy: str
    mode: str
    figures: dict = field(default_factory=dict)
    series: dict | None = None  # per-iteration arrays (time_s, batch, tokens, waiting)
    ttft_us: np.ndarray | None = None


class _GapStore:
    def __init__(self) -> None:
        self.parts: list[np.ndarray] = []

    def add(self, gaps: np.ndarray) -> None:
        if len(gaps):
            self.parts.append(gaps)

    def values(self) -> np.ndarray:
        return np.concatenate(self.parts) if self.parts else np.zeros(0)


def run_policy(workload: Workload, policy: str, mode: str, options: SuiteOptions | None = None,
               cost: RuntimeCostModel | None = None, *, backend: str | Backend | None = "auto",
               progress: bool | None = None) -> SuiteRun:
    options = options or SuiteOptions()
    cost = cost or RuntimeCostModel()
    types = types_module()
    from ..radix import UnifiedRadixCache

    backend = resolve_backend(backend)
    config = options.config(mode)
    sched = backend.make(config, admission=make_admission(policy))
    n = workload.n
    arrival = workload.arrival_us.astype(np.float64)
    out_len = workload.output_len
    prompt_len = workload.prompt_len
    family = workload.family
    ids = [workload.request_id(r) for r in range(n)]
    index_of = {rid: r for r, rid in enumerate(ids)}
    cache = UnifiedRadixCache()
    materialized = np.zeros(max(len(workload.family_prefix), 1), dtype=bool)
    has_restore = np.zeros(n, dtype=bool)
    prefill_cost = max(0, round(cost.prefill_token_us))
    restore_kind = types.PrefixRestoreKind.ResidentKv
    affinity_types = (types.CacheAffinity, types.StageCacheAffinity)

    first_sched = np.full(n, np.nan)
    first_tok = np.full(n, np.nan)
    last_tok = np.full(n, np.nan)
    done = np.full(n, np.nan)
    max_gap = np.zeros(n)
    gen = np.zeros(n, dtype=np.int64)
    fed = np.zeros(n, dtype=np.int64)  # KV cells a running request holds (memory model)
    gaps = _GapStore()
    series_t: list[float] = []
    series_rows: list[int] = []
    series_tokens: list[int] = []
    series_waiting: list[int] = []

    prefix_hits = readmit_hits = preemptions = 0
    usage = 0
    now = 0.0
    nxt = submitted = completed = 0
    iterations = batch_sum = token_sum = 0
    bar = Progress(n, f"{policy}/{mode}", enabled=progress)
    wall_start = time.perf_counter()

    def submit(r: int) -> None:
        nonlocal prefix_hits
        prompt = workload.prompt(r)
        seq = types.Sequence(ids[r], prompt, int(out_len[r]), None, int(workload.priority[r]))
        f = int(family[r])
        if f >= 0 and materialized[f]:
            match = cache.peek_resident(NAMESPACE, prompt)
            if match is not None and match.matched_tokens > 0:
                matched = min(match.matched_tokens, len(prompt))
                seq = seq.with_prefix_restore(types.PrefixRestore(f"family-{f}", matched,
                                                                  restore_kind))
                seq = seq.with_cache_affinity(affinity_types[0].from_stage(affinity_types[1](
                    stage_index=0, matched_tokens=matched, prefill_cost_per_token=prefill_cost,
                    restore_cost=0, cache_epoch=cache.epoch())))
                has_restore[r] = True
                prefix_hits += 1
        if options.kv_capacity_tokens:
            seq = seq.with_admission_tokens(len(prompt) + min(int(out_len[r]),
                                                              options.reserve_output_tokens))
        sched.submit(seq)

    while completed < n:
        while nxt < n and arrival[nxt] <= now:
            submit(nxt)
            nxt += 1
            submitted += 1
        if submitted == completed:
            now = max(now, arrival[nxt])
            continue
        plan = sched.plan_iteration()
        rows = len(plan)
        if rows == 0:
            raise RuntimeError(f"scheduler stalled at {now:.0f} µs ({policy}/{mode})")
        ends = plan.row_offsets[1:] - 1
        owner = plan.tokens[ends].astype(np.int64) - MARKER_BASE
        unknown = np.flatnonzero(owner < 0)
        if len(unknown):  # non-final prompt chunks: read the row objects
            work = plan.work
            for i in unknown.tolist():
                owner[i] = index_of[work[i].sequence_id]
        fresh = owner[np.isnan(first_sched[owner])]
        first_sched[fresh] = now
        decode = int(np.count_nonzero(plan.phases == PHASE_DECODE))
        token_count = plan.token_count
        duration = cost.duration_us(token_count - decode, decode)
        start = now
        now += duration

        sample_rows = plan.sample_rows
        sampled = owner[sample_rows]
        previous = last_tok[sampled]
        seen = ~np.isnan(previous)
        if seen.any():
            g = now - previous[seen]
            gaps.add(g)
            hit = sampled[seen]
            max_gap[hit] = np.maximum(max_gap[hit], g)
        firsts = sampled[~seen]
        first_tok[firsts] = now
        last_tok[sampled] = now
        gen[sampled] += 1
        for r in firsts[family[firsts] >= 0].tolist():  # a family prefix now exists in KV
            f = int(family[r])
            if not materialized[f]:
                materialized[f] = True
                cache.insert_resident(NAMESPACE, workload.family_prompt_prefix(f),
                                      int(workload.family_prefix[f]), f"family-{f}")

        k = len(sample_rows)
        outputs = plan.outputs
        outputs.request_indexes[:k] = sample_rows
        outputs.predicted_tokens[:k] = sampled + MARKER_BASE
        outputs.count = k
        sched.observe_iteration_duration(plan, duration / 1e6)
        telemetry = sched.complete_iteration(plan)

        finished = sampled[gen[sampled] >= out_len[sampled]]
        done[finished] = now
        completed += len(finished)
        if options.kv_capacity_tokens:
            new_fed = plan.positions[ends].astype(np.int64) + 1
            usage += int((new_fed - fed[owner]).sum())
            fed[owner] = new_fed
            usage -= int(fed[finished].sum())
            fed[finished] = 0
            for rid in sched.preempt_for_component_pressure([usage]):
                r = index_of[rid]
                usage -= int(fed[r])
                fed[r] = 0
                preemptions += 1
                readmit_hits += bool(has_restore[r])

        iterations += 1
        batch_sum += rows
        token_sum += token_count
        if options.record_series:
            series_t.append(start / 1e6)
            series_rows.append(rows)
            series_tokens.append(token_count)
            series_waiting.append(telemetry.waiting_sequences)
        if iterations % 512 == 0:
            bar.update(completed)
    bar.close()
    wall = time.perf_counter() - wall_start

    metrics = sched.metrics()
    ttft = first_tok - arrival
    queue = first_sched - arrival
    itl = gaps.values()
    tpot = np.where(gen > 1, (done - first_tok) / np.maximum(gen - 1, 1), 0.0)
    good = (ttft <= options.ttft_target_ms * 1e3) & (tpot <= options.itl_target_ms * 1e3)
    makespan_s = now / 1e6
    figures = {
        "policy": policy,
        "mode": mode,
        "requests": n,
        "wall_s": wall,
        "iterations": iterations,
        "makespan_s": makespan_s,
        "throughput_rps": n / makespan_s if makespan_s else 0.0,
        "output_tokens_per_s": float(gen.sum()) / makespan_s if makespan_s else 0.0,
        "goodput_rps": float(good.sum()) / makespan_s if makespan_s else 0.0,
        "goodput_fraction": float(good.mean()),
        "mean_batch": batch_sum / iterations if iterations else 0.0,
        "token_occupancy_pct": 100.0 * token_sum / (iterations * config.max_tokens_per_iteration)
        if iterations else 0.0,
        "preemptions": preemptions,
        "recomputed_tokens": int(metrics.recompute_tokens),
        "prefix_hits_first": prefix_hits,
        "prefix_hit_rate_first": prefix_hits / n,
        "readmissions": preemptions,
        "prefix_hits_readmit": readmit_hits,
        "prefix_hit_rate_readmit": readmit_hits / preemptions if preemptions else 0.0,
    }
    for name, values in (("queue", queue), ("ttft", ttft), ("itl", itl)):
        for p in (50, 90, 99):
            figures[f"p{p}_{name}_ms"] = nearest_rank(values, p) / 1e3
    series = None
    if options.record_series:
        series = {"time_s": np.asarray(series_t), "batch": np.asarray(series_rows),
                  "tokens": np.asarray(series_tokens), "waiting": np.asarray(series_waiting),
                  "max_tokens": config.max_tokens_per_iteration}
    return SuiteRun(policy, mode, figures, series, ttft)


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
