"""The priority scenario of the workload suite (docs/lab.md, "Priority that preempts").

A saturating background of priority-0 requests (Poisson arrivals above what the cost model can
serve, so the queue grows for the whole run) with a trickle of priority-1 requests mixed in,
replayed under three rules with a prefix store attached (`KeepingBlockCache`: the replay's
bounded block store, plus the KV of preempted requests):

* `admission-order`: the reference rule; priority only orders admission, so an urgent request
  waits for a running one to finish (`priority_preemption` off);
* `preempt-recompute`: preemption for priority (docs/behaviour.md §2.8a); a victim's KV beyond
  its prompt blocks is dropped, so its resume recomputes its generated tokens;
* `preempt-restore`: the same, and a victim's KV (prompt and generated tokens) is kept in the
  store when it has room, so its resume restores it (§2.12) and recomputes nothing.

Requests' prompts and lengths come from the suite's workload generator (`workload.py`); a
request's generated tokens are its marker token (the lab's echo sampling), so the key a victim
leaves is its prompt followed by the marker for every generated token its cells hold. The KV
cells a request holds are tracked by the lab host's memory model, at a capacity no run reaches
(a memory component the scheduler never has to preempt for), so only priority preempts.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterable, Optional

import numpy as np

from ..cost_model import LAB_COST, StepCost
from ..selection import make_admission
from .backend import Backend, resolve_backend
from .driver import LabRun, Latency, drive, nearest_rank
from .host import LabHost, Live
from .options import SuiteOptions
from .prefix import BlockPrefixCache
from .progress import Progress
from .suite import SuiteRequest
from .traces import blocks_for
from .workload import Workload, WorkloadSpec, generate

RULES = ("admission-order", "preempt-recompute", "preempt-restore")
UNREACHED_KV_TOKENS = 1 << 40  # the memory model tracks cells; no run comes near this


@dataclass(frozen=True)
class PriorityScenario:
    """The workload: `requests` arrivals at `rate`/s, `urgent_share` of them at priority 1."""

    requests: int = 2_000
    seed: int = 0
    rate: float = 150.0  # above what the default cost model serves of these: it saturates
    urgent_share: float = 0.02
    output_median: int = 256  # long streams: a lane frees up rarely
    prefix_cache_tokens: int = 1 << 20
    policy: str = "cache-aware-aging"
    mode: str = "mixed"

    def spec(self) -> WorkloadSpec:
        return WorkloadSpec(requests=self.requests, seed=self.seed, rate=self.rate,
                            priority_share=self.urgent_share,
                            output_median=self.output_median).validate()

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class KeepingBlockCache(BlockPrefixCache):
    """The block store, which with `keep_victims` also keeps a preempted request's cells."""

    def __init__(self, scheduler: Any, capacity_tokens: Optional[int], prefill_cost: int,
                 keep_victims: bool) -> None:
        super().__init__(scheduler, capacity_tokens, prefill_cost)
        self.keep_victims = keep_victims
        self.kept = 0  # victims whose generated tokens became resident
        self.kept_tokens = 0
        self.refused = 0  # victims the store had no room for

    def preempted(self, live: Live) -> None:
        if not self.keep_victims or live.fed <= live.n or live.prompt is None:
            return
        prompt = np.asarray(live.prompt, dtype=np.int32)
        key = np.concatenate((prompt, np.full(live.fed - live.n, prompt[-1], dtype=np.int32)))
        store = self.store
        hit = store.match(key)
        if hit.matched_tokens == len(key):
            if hit.entry is not None:
                store.touch(hit.entry)
            return
        # The deepest resident entry whose whole key starts this one is the parent (its tokens
        # are counted once); else the entry stands alone.
        parent = hit.entry if hit.entry is not None and \
            hit.entry.length == hit.matched_tokens else None
        if store.insert(key, parent=parent) is None:
            self.refused += 1
            return
        self.kept += 1
        self.kept_tokens += len(key)

    def start(self, live: Live) -> None:
        if live.restore <= live.n:
            super().start(live)
            return
        # A resume that restored generated tokens (the scheduler pins the entry): the whole
        # prompt is in KV, so no prompt block is left to make resident.
        live.done = blocks_for(live.n)
        live.progress = None


def run_rule(workload: Workload, scenario: PriorityScenario, rule: str,
             options: Optional[SuiteOptions] = None, cost: Optional[StepCost] = None,
             *, backend: str | Backend | None = "auto",
             progress: bool | None = None) -> LabRun:
    """Replay the scenario's workload under one rule (`RULES`); `progress`: the stderr
    progress bar (None: on a terminal), as the suite's runs have."""
    if rule not in RULES:
        raise ValueError(f"unknown rule {rule!r} (choose from {', '.join(RULES)})")
    base = options or SuiteOptions()
    cost = cost or LAB_COST
    opts = SuiteOptions(**{**base.__dict__, "kv_capacity_tokens": UNREACHED_KV_TOKENS})
    config = opts.config(scenario.mode)
    config.priority_preemption = rule != "admission-order"
    sched = resolve_backend(backend).make(config, admission=make_admission(scenario.policy))
    cache = KeepingBlockCache(sched, scenario.prefix_cache_tokens,
                              max(0, round(cost.per_prefill_token_us)),
                              keep_victims=rule == "preempt-restore")
    host = LabHost(sched, prefix=cache, memory=True, reserve=opts.reserve)
    arrivals = workload.arrival_us.tolist()
    requests = (SuiteRequest(workload, r, arrivals[r]) for r in range(workload.n))
    bar = Progress(workload.n, f"priority/{rule}", enabled=progress)
    try:
        report, wall = drive(sched, host, requests, cost, label=f"priority/{rule}",
                             progress=bar.update, every=512)
    finally:  # cleared on Ctrl-C too, before the interrupt's line
        bar.close()
    return LabRun(rule, scenario.mode, _figures(workload, rule, opts, host, cache, sched,
                                                report, wall))


def _figures(workload: Workload, rule: str, options: SuiteOptions, host: LabHost,
             cache: KeepingBlockCache, sched: Any, report: Any, wall: float) -> dict[str, Any]:
    lat = Latency.of(report, workload.output_len, options.ttft_target_ms,
                     options.itl_target_ms, "priority scenario")
    urgent = workload.priority > 0
    gen = lat.timeline.generated
    makespan_s = report.makespan_us / 1e6
    m = sched.metrics()
    figures: dict[str, Any] = {
        "rule": rule,
        "requests": workload.n,
        "urgent": int(urgent.sum()),
        "makespan_s": makespan_s,
        "background_tokens_per_s": float(gen[~urgent].sum()) / makespan_s if makespan_s else 0.0,
        "output_tokens_per_s": float(gen.sum()) / makespan_s if makespan_s else 0.0,
        "preemptions": int(m.preempted),
        "preempted_priority": int(m.preempted_priority),
        "recomputed_tokens": int(m.recompute_tokens),
        # restored at resumes: all the scheduler restored, less the first admissions' restores
        "resume_restored_tokens": int(m.restored_tokens) - host.hit_tokens,
        "victims_kept": cache.kept,
        "victims_refused": cache.refused,
        "evictions": cache.store.evictions,
        "stale_refreshes": int(m.stale_refreshes),
        "iterations": report.iterations,
        "wall_s": wall,
    }
    for name, values in (("urgent", lat.ttft[urgent]), ("background", lat.ttft[~urgent])):
        for p in (50, 99):
            # None (JSON null, "-" in the table) when the workload has no request of the kind
            figures[f"{name}_p{p}_ttft_ms"] = (nearest_rank(values, p) / 1e3 if len(values)
                                               else None)
    return figures


def run_priority_scenario(scenario: PriorityScenario, rules: Iterable[str] = RULES,
                          options: Optional[SuiteOptions] = None,
                          cost: Optional[StepCost] = None, *,
                          backend: str | Backend | None = "auto",
                          progress: bool | None = None,
                          on_run: Optional[Callable[[LabRun], None]] = None) -> list[LabRun]:
    workload = generate(scenario.spec())
    runs = []
    for rule in rules:
        run = run_rule(workload, scenario, rule, options, cost, backend=backend,
                       progress=progress)
        runs.append(run)
        if on_run is not None:
            on_run(run)
    return runs


PRIORITY_COLUMNS = ("rule", "urgent_p50_ttft_ms", "urgent_p99_ttft_ms",
                    "background_p50_ttft_ms", "background_p99_ttft_ms",
                    "background_tokens_per_s", "preempted_priority", "recomputed_tokens",
                    "resume_restored_tokens", "victims_kept", "makespan_s", "wall_s")


def format_priority_table(runs: list[LabRun], header: bool = True) -> str:
    lines = ["\t".join(PRIORITY_COLUMNS)] if header else []
    for run in runs:
        cells = []
        for column in PRIORITY_COLUMNS:
            value = run.figures[column]
            if value is None:
                cells.append("-")
            elif isinstance(value, str):
                cells.append(value)
            elif isinstance(value, (int, np.integer)):
                cells.append(str(int(value)))
            else:
                cells.append(f"{value:.3f}")
        lines.append("\t".join(cells))
    return "\n".join(lines) + "\n"


__all__ = ["PRIORITY_COLUMNS", "RULES", "KeepingBlockCache", "PriorityScenario",
           "format_priority_table", "run_priority_scenario", "run_rule"]
