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
from .model import RuntimeCostModel, new_sequence
from .progress import Progress
from .workload import MARKER_BASE, SUFFIX_BASE, SUFFIX_STRIDE, Workload

NAMESPACE = "stage-0"
PHASE_PREFILL = 0  # values of IterationPhase in plan.phases
PHASE_DECODE = 2

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
    per_request: dict | None = None  # arrays by request index: first_scheduled_us, ...


class _Events:
    """Append-only log of (time, owners) batches, turned into flat arrays at the end."""

    def __init__(self) -> None:
        self.owners: list[np.ndarray] = []
        self.times: list[float] = []
        self.counts: list[int] = []

    def add(self, now: float, owners: np.ndarray) -> None:
        self.owners.append(owners)
        self.times.append(now)
        self.counts.append(len(owners))

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        if not self.owners:
            return np.zeros(0, dtype=np.int64), np.zeros(0)
        owners = np.concatenate(self.owners).astype(np.int64)
        times = np.repeat(np.asarray(self.times), np.asarray(self.counts))
        return owners, times


class _SampleLog(_Events):
    """Sampled tokens per iteration, kept as raw int32 bytes (the cheapest copy of a plan
    view); a sampled token is its request's marker, so owners come out at the end."""

    def add_tokens(self, now: float, token_bytes: bytes, count: int) -> None:
        self.owners.append(token_bytes)
        self.times.append(now)
        self.counts.append(count)

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        tokens = np.frombuffer(b"".join(self.owners), dtype=np.int32)
        owners = tokens.astype(np.int64) - MARKER_BASE
        times = np.repeat(np.asarray(self.times), np.asarray(self.counts, dtype=np.int64))
        return owners, times


@dataclass
class _TokenTimeline:
    first_token: np.ndarray
    last_token: np.ndarray
    generated: np.ndarray
    max_gap: np.ndarray
    gaps: np.ndarray  # every inter-token gap of every request, µs


def _token_timeline(n: int, events: _Events) -> _TokenTimeline:
    """Per-request token times from the sample log (events are in time order)."""
    owners, times = events.arrays()
    first = np.full(n, np.nan)
    last = np.full(n, np.nan)
    generated = np.zeros(n, dtype=np.int64)
    max_gap = np.zeros(n)
    if len(owners) == 0:
        return _TokenTimeline(first, last, generated, max_gap, np.zeros(0))
    order = np.argsort(owners, kind="stable")
    o, t = owners[order], times[order]
    starts = np.flatnonzero(np.r_[True, o[1:] != o[:-1]])
    stops = np.r_[starts[1:], len(o)] - 1
    first[o[starts]] = t[starts]
    last[o[stops]] = t[stops]
    generated[o[starts]] = stops - starts + 1
    gaps = np.r_[0.0, np.diff(t)]
    gaps[starts] = 0.0  # a request's first token has no gap
    max_gap[o[starts]] = np.maximum.reduceat(gaps, starts)
    keep = np.ones(len(o), dtype=bool)
    keep[starts] = False
    return _TokenTimeline(first, last, generated, max_gap, gaps[keep])


def _row_owners(last_tokens: np.ndarray) -> np.ndarray:
    """Request index of each row from its last token: a marker (final prompt token or a
    sampled token) or an own-suffix token name their request; a family-prefix token gives -1."""
    last = last_tokens.astype(np.int64)
    return np.where(last >= MARKER_BASE, last - MARKER_BASE,
                    (last - SUFFIX_BASE) // SUFFIX_STRIDE)


def _first_times(n: int, events: _Events) -> np.ndarray:
    owners, times = events.arrays()
    out = np.full(n, np.nan)
    if len(owners):
        unique, index = np.unique(owners, return_index=True)  # first occurrence = earliest
        out[unique] = times[index]
    return out


def run_policy(workload: Workload, policy: str, mode: str, options: SuiteOptions | None = None,
               cost: RuntimeCostModel | None = None, *, backend: str | Backend | None = "auto",
               progress: bool | None = None) -> SuiteRun:
    """Replay `workload` under one admission policy and planning mode."""
    options = options or SuiteOptions()
    cost = cost or RuntimeCostModel()
    types = types_module()
    from ..radix import UnifiedRadixCache

    backend = resolve_backend(backend)
    config = options.config(mode)
    sched = backend.make(config, admission=make_admission(policy))
    n = workload.n
    arrivals = workload.arrival_us.tolist()
    out_len = workload.output_len
    family = workload.family
    ids = [workload.request_id(r) for r in range(n)]
    index_of = {rid: r for r, rid in enumerate(ids)}
    cache = UnifiedRadixCache()
    materialized = np.zeros(max(len(workload.family_prefix), 1), dtype=bool)
    has_restore = np.zeros(n, dtype=bool)
    prefill_cost = max(0, round(cost.prefill_token_us))
    restore_kind = types.PrefixRestoreKind.ResidentKv
    memory = options.kv_capacity_tokens > 0
    gen = np.zeros(n, dtype=np.int64)  # memory model only: tokens sampled so far
    fed = np.zeros(n, dtype=np.int64)  # memory model only: KV cells a running request holds

    samples = _SampleLog()  # (time, tokens sampled: request markers)
    scheduled = _Events()  # (time, owners of prompt rows): first appearance is a prompt row
    series_t: list[float] = []
    series_rows: list[int] = []
    series_tokens: list[int] = []
    series_waiting: list[int] = []

    prefix_hits = readmit_hits = preemptions = 0
    usage = 0
    now = 0.0
    nxt = 0
    outstanding = 0  # active + waiting, as the scheduler last reported
    iterations = batch_sum = token_sum = 0
    bar = Progress(n, f"{policy}/{mode}", enabled=progress)
    wall_start = time.perf_counter()

    def submit(r: int) -> None:
        nonlocal prefix_hits
        prompt = workload.prompt(r).tolist()
        max_tokens = int(out_len[r])
        seq = new_sequence(types, ids[r], prompt, max_tokens, int(workload.priority[r]))
        f = int(family[r])
        if f >= 0 and materialized[f]:
            match = cache.peek_resident(NAMESPACE, prompt)
            if match is not None and match.matched_tokens > 0:
                matched = min(match.matched_tokens, len(prompt))
                seq = seq.with_prefix_restore(types.PrefixRestore(f"family-{f}", matched,
                                                                  restore_kind))
                seq = seq.with_cache_affinity(types.CacheAffinity.from_stage(
                    types.StageCacheAffinity(stage_index=0, matched_tokens=matched,
                                             prefill_cost_per_token=prefill_cost,
                                             restore_cost=0, cache_epoch=cache.epoch())))
                has_restore[r] = True
                prefix_hits += 1
        if memory:
            seq = seq.with_admission_tokens(len(prompt) + min(max_tokens,
                                                              options.reserve_output_tokens))
        sched.submit(seq)

    while nxt < n or outstanding:
        while nxt < n and arrivals[nxt] <= now:
            submit(nxt)
            nxt += 1
            outstanding += 1
        if not outstanding:
            now = max(now, arrivals[nxt])
            continue
        plan = sched.plan_iteration()
        rows = len(plan)
        if rows == 0:
            raise RuntimeError(f"scheduler stalled at {now:.0f} µs ({policy}/{mode})")
        phases = plan.phases
        tokens = plan.tokens
        outputs = plan.outputs
        token_count = plan.token_count
        decode = bytes(phases).count(PHASE_DECODE)
        if decode == rows:
            # Decode-only: one token per row, and that token is the marker sampled last time,
            # so it is also this iteration's prediction.
            outputs.request_indexes[:rows] = plan.sample_rows
            outputs.predicted_tokens[:rows] = tokens
            outputs.count = rows
            sampled_bytes = bytes(tokens)
            k = rows
            ends = None
        else:
            ends = plan.row_offsets[1:] - 1
            owner = _row_owners(tokens[ends])
            if owner.min() < 0:  # a chunk ending inside a shared family prefix: read the rows
                work = plan.work
                for i in np.flatnonzero(owner < 0).tolist():
                    owner[i] = index_of[work[i].sequence_id]
            scheduled.add(now, owner[phases != PHASE_DECODE])
            sample_rows = plan.sample_rows
            sampled = owner[sample_rows]
            k = len(sample_rows)
            predicted = (sampled + MARKER_BASE).astype(np.int32)
            outputs.request_indexes[:k] = sample_rows
            outputs.predicted_tokens[:k] = predicted
            outputs.count = k
            sampled_bytes = predicted.tobytes()
            firsts = sampled[phases[sample_rows] == PHASE_PREFILL]
            for r in firsts[family[firsts] >= 0].tolist():  # a family prefix is now in KV
                f = int(family[r])
                if not materialized[f]:
                    materialized[f] = True
                    cache.insert_resident(NAMESPACE, workload.family_prompt_prefix(f),
                                          int(workload.family_prefix[f]), f"family-{f}")
        duration = cost.duration_us(token_count - decode, decode)
        start = now
        now += duration
        samples.add_tokens(now, sampled_bytes, k)
        if memory:  # plan arrays are only valid while the plan is live
            if ends is None:
                owner = tokens.astype(np.int64) - MARKER_BASE
                sampled = owner
                new_fed = plan.positions.astype(np.int64) + 1
            else:
                new_fed = plan.positions[ends].astype(np.int64) + 1
        sched.observe_iteration_duration(plan, duration / 1e6)
        telemetry = sched.complete_iteration(plan)
        outstanding = telemetry.active_sequences + telemetry.waiting_sequences
        if memory:
            usage += int((new_fed - fed[owner]).sum())
            fed[owner] = new_fed
            gen[sampled] += 1
            finished = sampled[gen[sampled] >= out_len[sampled]]
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
            bar.update(nxt - outstanding)
    bar.close()
    wall = time.perf_counter() - wall_start

    metrics = sched.metrics()
    arrival = workload.arrival_us.astype(np.float64)
    timeline = _token_timeline(n, samples)
    if not np.array_equal(timeline.generated, out_len):
        raise RuntimeError("suite bookkeeping lost tokens: generated counts differ from outputs")
    first_sched = _first_times(n, scheduled)
    ttft = timeline.first_token - arrival
    queue = first_sched - arrival
    done = timeline.last_token
    gen_all = timeline.generated
    tpot = np.where(gen_all > 1, (done - timeline.first_token) / np.maximum(gen_all - 1, 1), 0.0)
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
        "output_tokens_per_s": float(gen_all.sum()) / makespan_s if makespan_s else 0.0,
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
        "p99_max_itl_ms": nearest_rank(timeline.max_gap, 99) / 1e3,
    }
    for name, values in (("queue", queue), ("ttft", ttft), ("itl", timeline.gaps)):
        for p in (50, 90, 99):
            figures[f"p{p}_{name}_ms"] = nearest_rank(values, p) / 1e3
    series = None
    if options.record_series:
        series = {"time_s": np.asarray(series_t), "batch": np.asarray(series_rows),
                  "tokens": np.asarray(series_tokens), "waiting": np.asarray(series_waiting),
                  "max_tokens": config.max_tokens_per_iteration}
    per_request = {"first_scheduled_us": first_sched, "first_token_us": timeline.first_token,
                   "completed_us": done, "generated": gen_all,
                   "max_inter_token_gap_us": timeline.max_gap, "prefix_restore": has_restore}
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
