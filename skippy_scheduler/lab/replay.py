"""Trace replay: a production trace driven through the engine under one admission policy.

Each run is the `Engine` on a `VirtualClock` with `TraceHost`, a model-free runtime (echo
sampling, like the workload suite's host) with two models:

* **Prefix cache** (`prefix_cache_tokens`): a bounded `PrefixStore` of 512-token blocks. A
  block becomes resident when the prefill that covers it completes (block by block, so a long
  prompt is cacheable before its prefill ends); the last, partial block when the whole prompt
  has been fed. While a request runs it pins the deepest resident block of its prompt, which
  keeps its whole prefix resident; unpinned blocks are evicted least recently used when room is
  needed; a block that cannot be made room for is not cached (and neither are the request's
  later blocks). The store is attached to the scheduler (behaviour.md §2.12), which reads each
  request's restore from it at submit (saved cost = matched × prefill_token_us) and re-reads,
  immediately before every admission selection, the waiting requests under the blocks inserted
  or evicted since — natively, counted in `stale_refreshes` — and pins the restore of an
  admitted request while it runs. At admission the host touches the restored blocks.
* **Memory** (`kv_capacity_tokens`): one component "kv-cells", exactly as in the suite
  (`suite.py`): admission reserves prompt + min(output, reserve_output_tokens) cells; after
  every iteration the cells actually held are reported and the engine preempts. A preempted
  request's restore is re-read when it re-enters the queue.

**Tenants.** With more than one tenant (a trace field or `tenants=K`), the host adds up, per
tenant, the tokens each plan computes for it (prefill and decode rows); the report gives each
tenant's service rate while the trace is arriving (tokens computed from the first arrival to the
last, per second) and Jain's index over those rates. Under fair share every sequence carries its
tenant (`Sequence.tenant`) and the scheduler charges completed rows itself; only a fair-share
policy run from Python (a non-default inner order) is charged by the host.
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Optional

import numpy as np

from ..cost_model import DECODE_PHASE, RuntimeCostModel
from ..engine import CostModelHost, Engine, EngineStalled, VirtualClock, percentile
from ..policies import FairShareAdmission
from ..prefix_store import PrefixStore, StoreEntry, VirtualBackend
from ..types import IterationPhase, SchedulerConfig, Sequence
from .backend import Backend, resolve_backend
from .suite import SuiteOptions, make_admission as _suite_admission
from .traces import BLOCK_TOKENS, Trace, TraceRequest, blocks_for

POLICIES = ("fcfs", "cache-aware-noaging", "cache-aware-aging", "priority", "fair-share")
MODES = ("phase", "mixed")
DEFAULT_MODE = "mixed"
DEFAULT_PREFIX_CACHE_TOKENS = 8 << 20
_PHASE_DECODE = DECODE_PHASE
_PHASE_PREFILL = IterationPhase.Prefill.value


def make_admission(name: str, weights: Optional[dict] = None):
    if name == "fair-share":
        return FairShareAdmission(weights)
    if name not in POLICIES:
        raise ValueError(f"unknown admission policy {name!r} (choose from {', '.join(POLICIES)})")
    return _suite_admission(name)


@dataclass(frozen=True)
class ReplayOptions:
    """Scheduler, runtime-model and report settings of a replay (docs/lab.md)."""

    max_active: int = 32
    max_tokens: int = 2_048
    chunk: int = 512
    kv_capacity_tokens: int = 0  # 0 = no memory component
    reserve_output_tokens: int = 32
    prefix_cache_tokens: Optional[int] = DEFAULT_PREFIX_CACHE_TOKENS  # None = unbounded, 0 = off
    ttft_target_ms: float = 1_000.0
    itl_target_ms: float = 5.0
    tenant_weights: Optional[dict] = None  # fair-share weights by tenant name (default 1)
    record_series: bool = False

    def config(self, mode: str) -> SchedulerConfig:
        return SuiteOptions(max_active=self.max_active, max_tokens=self.max_tokens,
                            chunk=self.chunk,
                            kv_capacity_tokens=self.kv_capacity_tokens).config(mode)

    def validate(self) -> "ReplayOptions":
        for name in ("max_active", "max_tokens", "chunk"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name.replace('_', '-')} must be >= 1")
        if self.kv_capacity_tokens < 0 or self.reserve_output_tokens < 0:
            raise ValueError("memory options must be >= 0")
        if self.prefix_cache_tokens is not None and self.prefix_cache_tokens < 0:
            raise ValueError("prefix-cache-tokens must be >= 0")
        if self.ttft_target_ms < 0 or self.itl_target_ms < 0:
            raise ValueError("goodput targets must be >= 0")
        return self


class _Live:
    """Host-side state of one request from submit until it ends."""

    __slots__ = ("id", "prompt", "n", "out", "tenant", "record", "restore", "progress", "done",
                 "admitted", "preempted", "broken", "fed")

    def __init__(self, request: TraceRequest, prompt: np.ndarray, tenant: int, record: int):
        self.id = request.id
        self.prompt = prompt
        self.n = request.input_length
        self.out = request.output_length
        self.tenant = tenant
        self.record = record  # submission index (= the recorder's index)
        self.restore = 0  # tokens restored at its (latest) admission
        self.progress: Optional[StoreEntry] = None  # deepest resident block it pins while running
        self.done = 0  # leading blocks of its prompt resident through `progress`
        self.admitted = False
        self.preempted = False
        self.broken = False  # a block of its prompt could not be cached
        self.fed = 0  # KV cells it holds (memory model)


class TraceHost(CostModelHost):
    """The replay's runtime model (module docstring): echo sampling, a bounded block prefix
    cache the scheduler reads restores from, KV accounting and per-tenant service."""

    def __init__(self, scheduler: Any, cost: RuntimeCostModel, options: ReplayOptions, *,
                 fair_share: Optional[FairShareAdmission] = None,
                 tenant_names: Optional[list] = None) -> None:
        super().__init__(token=None)
        self.scheduler = scheduler
        self.options = options
        self.clock: Any = None  # set by run_replay: the engine's clock (for time stamps)
        cap = options.prefix_cache_tokens
        self.store: Optional[PrefixStore] = None
        self.prefill_cost = max(0, round(cost.prefill_token_us))
        if cap != 0:
            self.store = PrefixStore(cap, backend=VirtualBackend())
            scheduler.attach_prefix_store(self.store, prefill_cost_per_token=self.prefill_cost)
        self.memory = options.kv_capacity_tokens > 0
        self.reserve = options.reserve_output_tokens if self.memory else None
        self.fair_share = fair_share
        self.live: dict[str, _Live] = {}
        self._arrived: dict[str, TraceRequest] = {}
        self._records = 0
        # Per-request figures in submission order.
        self.output_len: list[int] = []
        self.restored: list[int] = []  # tokens restored at first admission
        self.admit_time: list[float] = []
        self.admit_restore: list[int] = []
        self.admit_prompt: list[int] = []
        self.hit_tokens = 0
        self.prompt_tokens = 0
        self.uncached_blocks = 0
        self.usage = 0
        # Tenants: names by index, service computed per tenant (cumulative and in the window).
        self.tenant_names: list = list(tenant_names or [])
        self._tenant_index = {name: k for k, name in enumerate(self.tenant_names)}
        self.per_tenant = False
        self.service: list[float] = []  # tokens computed per tenant index
        self.window_service: Optional[list[float]] = None
        self.window_end_us: Optional[float] = None
        self.stream_done = False
        self.first_arrival_us: Optional[float] = None
        self.last_arrival_us: Optional[float] = None

    # -- the request stream ---------------------------------------------------------------------

    def stream(self, requests: Iterable[TraceRequest]) -> Iterator[TraceRequest]:
        """`requests`, registered with the host as the engine pulls them."""
        for request in requests:
            self._arrived[request.id] = request
            if self.first_arrival_us is None:
                self.first_arrival_us = request.arrival_us
            self.last_arrival_us = request.arrival_us
            yield request
        self.stream_done = True

    @property
    def stale_refreshes(self) -> int:
        return int(self.scheduler.metrics().stale_refreshes)

    def _tenant(self, name: Any) -> int:
        k = self._tenant_index.get(name)
        if k is None:
            k = self._tenant_index[name] = len(self.tenant_names)
            self.tenant_names.append(name)
        return k

    # -- submit ---------------------------------------------------------------------------------

    def _sequence(self, live: _Live, seq: Optional[Sequence] = None) -> Sequence:
        if seq is None:
            seq = Sequence(live.id, live.prompt.tolist(), live.out)
        if self.fair_share is not None:
            seq.with_tenant(self.tenant_names[live.tenant])
        if self.reserve is not None:
            seq.with_admission_tokens(live.n + min(live.out, self.reserve))
        return seq

    def prepare_sequence(self, seq: Sequence) -> Sequence:
        request = self._arrived.pop(seq.id)
        prompt = request.prompt_array()
        request.drop_prompt()
        live = _Live(request, prompt, self._tenant(request.tenant), self._records)
        self._records += 1
        self.live[live.id] = live
        self.output_len.append(live.out)
        self.restored.append(0)
        return self._sequence(live, seq)

    # -- running ----------------------------------------------------------------------------------

    def _start(self, live: _Live, start: int, fresh: bool) -> None:
        """At a request's first row after an admission: the restore the scheduler chose (it
        pins it), touched; the request's progress points at the restore's last full block.

        The row starts where the restore ends (§0.4b), except that a request with nothing
        generated replays its last prompt token when the restore covers the whole prompt: a
        fresh row at n - 1 cannot tell a restore of n - 1 from one of n, so only then is the
        scheduler asked (its snapshot copies the prompt)."""
        if fresh and start == live.n - 1:
            snap = self.scheduler.sequence(live.id)
            start = snap.prefix_restore.token_count if snap.prefix_restore is not None else 0
        live.restore = start
        live.done = 0
        live.progress = None
        store = self.store
        if not live.restore or store is None:
            return
        hit = store.match(live.prompt)
        if hit.entry is None or hit.matched_tokens < live.restore:
            raise RuntimeError(f"{live.id} was admitted with a restore of {live.restore} tokens "
                               "that is not resident")
        store.touch(hit.entry)
        done = blocks_for(live.n) if live.restore >= live.n else live.restore // BLOCK_TOKENS
        progress = store.find(live.prompt[:min(done * BLOCK_TOKENS, live.n)]) if done else None
        if done and progress is None:
            live.broken = True  # the restore is not block-aligned: cache nothing more of it
            done = 0
        live.done = done
        live.progress = progress
        if progress is not None:
            store.pin(progress)

    def _admit(self, live: _Live, now: float, start: int, fresh: bool) -> None:
        live.admitted = True
        self._start(live, start, fresh)
        self.restored[live.record] = live.restore
        self.hit_tokens += live.restore
        self.prompt_tokens += live.n
        self.admit_time.append(now)
        self.admit_restore.append(live.restore)
        self.admit_prompt.append(live.n)

    def _advance(self, live: _Live, fed_end: int) -> None:
        """Make the blocks of `live`'s prompt that are now fully computed resident."""
        if live.broken:
            return
        store = self.store
        assert store is not None
        n = live.n
        full = blocks_for(n) if fed_end >= n else fed_end // BLOCK_TOKENS
        prompt = live.prompt
        while live.done < full:
            k = live.done
            key = prompt[:min((k + 1) * BLOCK_TOKENS, n)]
            entry = store.find(key)
            if entry is None:
                entry = store.insert(key, parent=live.progress)
                if entry is None:
                    live.broken = True
                    self.uncached_blocks += full - k
                    return
            else:
                store.touch(entry)
            store.pin(entry)
            if live.progress is not None:
                store.unpin(live.progress)
            live.progress = entry
            live.done = k + 1

    def execute(self, plan: Any) -> None:
        super().execute(plan)
        phases = bytes(plan.phases)
        rows = len(phases)
        decode = phases.count(_PHASE_DECODE)
        if decode < rows:
            ids = plan.sequence_ids
            live_of = self.live
            offsets = plan.row_offsets
            positions = plan.positions
            now = self.clock.now() if self.clock is not None else 0.0
            prefill = [(live_of[ids[i]], i) for i, phase in enumerate(phases)
                       if phase != _PHASE_DECODE]
            # Every admission pins its restore before any row's new blocks can evict it.
            for live, i in prefill:
                if not live.admitted or live.preempted:
                    start = int(positions[offsets[i]])
                    fresh = phases[i] == _PHASE_PREFILL
                    if not live.admitted:
                        self._admit(live, now, start, fresh)
                    else:
                        live.preempted = False
                        self._start(live, start, fresh)
            if self.store is not None:
                for live, i in prefill:
                    self._advance(live, int(positions[offsets[i + 1] - 1]) + 1)
        if self.memory:
            live_of = self.live
            ids = plan.sequence_ids
            held = plan.positions[plan.row_offsets[1:] - 1].astype(np.int64) + 1
            lives = [live_of[i] for i in ids]
            for live, cells in zip(lives, held.tolist()):
                self.usage += cells - live.fed
                live.fed = cells
        if self.per_tenant:
            self._account(plan, phases)

    def _account(self, plan: Any, phases: bytes) -> None:
        # Plain Python: plans are small (most are a few decode rows), where numpy's per-call
        # overhead would cost more than the loop.
        live_of = self.live
        ids = plan.sequence_ids
        k = len(self.tenant_names)
        service = self.service
        if len(service) < k:
            service.extend([0.0] * (k - len(service)))
        if self.window_service is None and self.stream_done and self.clock is not None \
                and self.last_arrival_us is not None and self.clock.now() >= self.last_arrival_us:
            self.window_service = list(service)
            self.window_end_us = self.clock.now()
        served: dict[int, list] = {}
        if phases.count(_PHASE_DECODE) == len(phases):
            for rid in ids:
                t = live_of[rid].tenant
                service[t] += 1
                entry = served.get(t)
                if entry is None:
                    served[t] = [0, 1]
                else:
                    entry[1] += 1
        else:
            offsets = plan.row_offsets.tolist()
            for i, rid in enumerate(ids):
                t = live_of[rid].tenant
                tokens = offsets[i + 1] - offsets[i]
                service[t] += tokens
                entry = served.setdefault(t, [0, 0])
                entry[1 if phases[i] == _PHASE_DECODE else 0] += tokens
        fair = self.fair_share
        if fair is not None and fair.native_kind is None:
            names = self.tenant_names
            for t, (prefill, decode) in served.items():
                fair.charge(names[t], prefill, decode)

    def release(self, sequence_id: str, reason: object = None) -> None:
        live = self.live.get(sequence_id)
        if live is None:
            return
        if self.memory:
            self.usage -= live.fed
            live.fed = 0
        store = self.store
        if store is not None and live.progress is not None:
            store.unpin(live.progress)
        live.progress = None
        live.done = 0
        if self.scheduler.sequence(sequence_id) is not None:
            # Preempted: its KV is gone; the scheduler re-reads its restore (§2.12).
            live.preempted = True
            return
        del self.live[sequence_id]
        live.prompt = None  # type: ignore[assignment]

    def memory_used(self) -> Optional[list[int]]:
        return [self.usage] if self.memory else None


@dataclass
class ReplayRun:
    policy: str
    mode: str
    figures: dict = field(default_factory=dict)
    series: Optional[dict] = None  # per-iteration and per-admission arrays for plots
    ttft_us: Optional[np.ndarray] = None
    per_request: Optional[dict] = None  # arrays by submission index


def _natural(name: Any) -> tuple:
    """Sort key: "t2" before "t10"."""
    text = str(name)
    return tuple((0, int(part), "") if part.isdigit() else (1, 0, part)
                 for part in re.split(r"(\d+)", text) if part)


def jain_index(values: Any) -> Optional[float]:
    """(Σx)² / (n Σx²) over the given rates; None for fewer than two."""
    x = np.asarray(values, dtype=np.float64)
    if len(x) < 2:
        return None
    denominator = len(x) * float((x * x).sum())
    return float(x.sum() ** 2 / denominator) if denominator > 0 else None


def _progress_bar(total: Optional[int], label: str, enabled: Optional[bool]):
    import sys

    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=label, unit="req", leave=False, mininterval=0.5,
                file=sys.stderr)


def run_replay(trace: Trace, policy: str, mode: str = DEFAULT_MODE,
               options: Optional[ReplayOptions] = None, cost: Optional[RuntimeCostModel] = None,
               *, backend: str | Backend | None = "auto", progress: Optional[bool] = None,
               on_plan: Optional[Callable[[Any, float, float], None]] = None,
               host_hook: Optional[Callable[[TraceHost], None]] = None,
               total: Optional[int] = None) -> ReplayRun:
    """Replay `trace` under one admission policy and planning mode.

    progress: a progress bar on stderr (None = only when stderr is a terminal); `total` is its
    number of requests (default: the file's row count). on_plan: the engine's hook, called with
    every plan after the host ran it. host_hook(host): called once before the run (tests)."""
    options = (options or ReplayOptions()).validate()
    cost = cost or RuntimeCostModel()
    config = options.config(mode)
    admission = make_admission(policy, options.tenant_weights)
    sched = resolve_backend(backend).make(config, admission=admission)
    # A Python-run policy's resolved copy in the scheduler shares these counters (the host
    # charges them); the native kind keeps its own (TraceHost: tenants only).
    fair = admission if isinstance(admission, FairShareAdmission) else None
    host = TraceHost(sched, cost, options, fair_share=fair)
    if host_hook is not None:
        host_hook(host)
    if total is None and progress is not False:
        total = trace.count_rows()
    bar = _progress_bar(total, f"{policy}/{mode}", progress)
    shown = [0]

    def before_step(engine: Engine) -> None:
        if bar is not None and engine.iterations % 1024 == 0:
            done = len(engine.recorder.ids) - engine.outstanding  # type: ignore[union-attr]
            bar.update(done - shown[0])
            shown[0] = done

    engine = Engine(sched, host, clock=VirtualClock(cost), before_step=before_step,
                    on_plan=on_plan)
    host.clock = engine.clock
    requests = iter(trace)
    # Tenant accounting is needed only when the trace has more than one tenant; the first
    # requests tell (a trace field or --tenants): peeking keeps the stream lazy.
    first = next(requests, None)
    if first is None:
        raise ValueError(f"{trace.path}: the trace has no requests")
    host.per_tenant = trace.tenants is not None and trace.tenants > 1 or first.tenant is not None

    def chained() -> Iterator[TraceRequest]:
        yield first
        yield from requests

    wall_start = time.perf_counter()
    try:
        report = engine.run(host.stream(chained()))
    except EngineStalled as exc:
        raise RuntimeError(f"scheduler stalled ({policy}/{mode}): {exc}; a prompt larger than "
                           f"--kv-capacity-tokens can never be admitted") from exc
    finally:
        if bar is not None:
            bar.close()
    wall = time.perf_counter() - wall_start
    return _figures(trace, policy, mode, options, config, host, report, wall, sched)


def _figures(trace: Trace, policy: str, mode: str, options: ReplayOptions,
             config: SchedulerConfig, host: TraceHost, report: Any, wall: float,
             sched: Any) -> ReplayRun:
    per = report.arrays()
    timeline = report.timeline()
    out_len = np.asarray(host.output_len, dtype=np.int64)
    if not np.array_equal(timeline.generated, out_len):
        raise RuntimeError("replay bookkeeping lost tokens: generated counts differ from the "
                           "trace's output lengths")
    its = report.iteration_arrays()
    n = len(out_len)
    arrival = per["arrival_us"]
    first_sched = per["first_scheduled_us"]
    ttft = timeline.first_token_us - arrival
    queue = first_sched - arrival
    done = timeline.last_token_us
    gen = timeline.generated
    tpot = np.where(gen > 1, (done - timeline.first_token_us) / np.maximum(gen - 1, 1), 0.0)
    good = (ttft <= options.ttft_target_ms * 1e3) & (tpot <= options.itl_target_ms * 1e3)
    makespan_us = report.makespan_us
    makespan_s = makespan_us / 1e6
    busy_us = float(its["duration_us"].sum())
    preemptions = int(per["preemptions"].sum())
    store = host.store
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
        "goodput_rps": float(good.sum()) / makespan_s if makespan_s else 0.0,
        "goodput_fraction": float(good.mean()) if n else 0.0,
        "mean_batch": float(its["rows"].mean()) if report.iterations else 0.0,
        "prompt_tokens": host.prompt_tokens,
        "hit_tokens": host.hit_tokens,
        "hit_rate": host.hit_tokens / host.prompt_tokens if host.prompt_tokens else 0.0,
        "evictions": store.evictions if store is not None else 0,
        "evicted_tokens": store.evicted_tokens if store is not None else 0,
        "uncached_blocks": host.uncached_blocks,
        "stale_refreshes": host.stale_refreshes,
        "preemptions": preemptions,
        "recomputed_tokens": int(sched.metrics().recompute_tokens),
        "p99_max_itl_ms": float(percentile(timeline.max_gap_us, 99)) / 1e3,
    }
    for name, values in (("queue", queue), ("ttft", ttft), ("itl", timeline.gaps_us)):
        for p in (50, 90, 99):
            figures[f"p{p}_{name}_ms"] = float(percentile(values, p)) / 1e3
    tenants = {}
    jain = None
    if host.per_tenant and host.tenant_names:
        window = np.asarray(host.window_service if host.window_service is not None
                            else host.service, dtype=np.float64)
        end = host.window_end_us if host.window_end_us is not None else makespan_us
        start = host.first_arrival_us or 0.0
        span_s = max(end - start, 1.0) / 1e6
        rates = np.zeros(len(host.tenant_names))
        rates[:len(window)] = window / span_s
        tenants = {str(name): float(rate) for name, rate in
                   sorted(zip(host.tenant_names, rates), key=lambda item: _natural(item[0]))}
        jain = jain_index(rates)
    figures["tenants"] = len(host.tenant_names) if host.per_tenant else 1
    figures["tenant_service_tokens_per_s"] = tenants
    figures["jain_index"] = jain
    series = None
    if options.record_series:
        series = {"time_s": its["start_us"] / 1e6, "waiting": its["waiting"],
                  "batch": its["rows"], "tokens": its["tokens"],
                  "max_tokens": config.max_tokens_per_iteration,
                  "admit_time_s": np.asarray(host.admit_time) / 1e6,
                  "admit_restore": np.asarray(host.admit_restore, dtype=np.int64),
                  "admit_prompt": np.asarray(host.admit_prompt, dtype=np.int64),
                  "arrival_s": arrival / 1e6, "first_scheduled_s": first_sched / 1e6}
    per_request = {"arrival_us": arrival, "first_scheduled_us": first_sched,
                   "first_token_us": timeline.first_token_us, "completed_us": done,
                   "generated": gen, "restored_tokens": np.asarray(host.restored, dtype=np.int64)}
    return ReplayRun(policy, mode, figures, series, ttft, per_request)


def run_replays(trace: Trace, policies: Iterable[str] = POLICIES, mode: str = DEFAULT_MODE,
                options: Optional[ReplayOptions] = None, cost: Optional[RuntimeCostModel] = None,
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
           "ReplayRun", "TraceHost", "jain_index", "make_admission", "run_replay", "run_replays"]
