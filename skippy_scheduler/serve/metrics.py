"""Prometheus metrics, named like vLLM's with the `skippy:` prefix.

Latency histograms and token counters are observed on the event loop as events reach each
request; the engine's own figures (running and waiting requests, preemptions, prefix-cache hit
rate, lanes and KV in use) are read from the last `EngineStats` the engine thread published, at
scrape time, so the engine thread never calls into prometheus_client.

Times are on the engine's clock: TTFT is from the moment the server received the request (before
its body is read, tokenized and checked) to the end of the iteration that sampled the first
token; inter-token latency is between consecutive tokens of a request; end-to-end latency runs
to the request's end. The TTFT and end-to-end histograms and `skippy:request_success_total`
count choices: a request with `n` > 1 or `best_of` counts once per sequence it ran (the
best_of candidates not returned included).

Preemptions are counted by reason (`reason="memory"`: the measured memory did not fit;
`reason="priority"`: a waiting request of higher priority took the lane, docs/behaviour.md
§2.8a), and TTFT is observed a second time per request priority
(`skippy:time_to_first_token_by_priority_seconds{priority="N"}`), so a dashboard sees what
urgent requests wait. At most `PRIORITY_LABELS` distinct priorities get a label of their own;
requests of further priorities are observed under `priority="other"`, so a client cannot grow
the metrics without bound.

Where an iteration's time goes (docs/measuring.md, "Where an iteration's time goes"):
`skippy:step_seconds{part}` is a histogram per part of the engine's iterations
(`part` one of engine/step_timing.py's `PARTS`: wall, before, plan, execute, wait, events,
complete), and `skippy:host_busy_ratio` the share of wall time the host spent executing over
the last 64 iterations (and, while the engine is idle, the time since the last one). The
engine thread keeps the bucket counts itself (a few additions per iteration); they are read at
scrape time.

The SLO (serve/slo.py): `skippy:slo_met_total{part}` and `skippy:slo_missed_total{part}`
(`part` ttft, itl or both) count the choices of complete answers that carried a budget, once
each (docs/serving.md, "An SLO");
`skippy:slo_shed_total` the requests `--slo-shed` answered with a 503, and
`skippy:slo_relegated_total` the requests the prefill order relegated behind the others for a
first-token deadline they could no longer meet (the scheduler's `slo_relegated`).

The process's garbage collector (serve/gc_pauses.py): `skippy:gc_collections_total`,
`skippy:gc_pause_seconds_total` and `skippy:gc_pause_max_seconds`, each by `generation`, and
`skippy:gc_frozen_objects`.
"""
from __future__ import annotations

import gc
from bisect import bisect_left
from itertools import accumulate
from typing import Any, Callable, Iterator, Sequence, cast

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily, Metric)
from prometheus_client.utils import floatToGoString

from ..engine.step_timing import BUCKETS_S, BUSY_WINDOW, PARTS

from .gc_pauses import GENERATIONS, GcPauses, process_pauses
from .runner import EngineStats

_le_label = cast(Callable[[float], str], floatToGoString)  # a bound as the exposition writes it

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PRIORITY_LABELS = 16

_TTFT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5,
                 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.0002, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2,
                0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
_E2E_BUCKETS = (0.005, 0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0,
                20.0, 30.0, 40.0, 50.0, 60.0, 120.0)


class LoopHistogram:
    """A histogram observed on one thread only, the event loop's (a gap per streamed token), and
    read on it (`/metrics` is served there): its bucket counts and sum are plain numbers, with
    no lock and no per-bucket objects, and a scrape shows them as prometheus_client's
    `Histogram` shows its own (the same series, `le` labels and cumulative counts)."""

    __slots__ = ("name", "documentation", "bounds", "les", "counts", "sum")

    def __init__(self, name: str, documentation: str, buckets: Sequence[float]) -> None:
        bounds = tuple(float(b) for b in buckets)
        if not bounds or any(b >= c for b, c in zip(bounds, bounds[1:])):
            raise ValueError(f"{name}: bucket bounds must be given in increasing order")
        self.name = name
        self.documentation = documentation
        self.bounds = bounds  # the upper bounds; the last bucket, +Inf, is implied
        self.les = [_le_label(b) for b in bounds] + ["+Inf"]
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        """One observation: into the first bucket whose upper bound is at least `value`."""
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def collect(self) -> Iterator[Metric]:
        h = HistogramMetricFamily(self.name, self.documentation)
        h.add_metric([], list(zip(self.les, map(float, accumulate(self.counts)))), self.sum)
        yield h


class _EngineCollector:
    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        yield GaugeMetricFamily("skippy:num_requests_running",
                                "Requests in the scheduler's active set.", value=s.running)
        yield GaugeMetricFamily("skippy:num_requests_waiting",
                                "Requests in the scheduler's waiting queue.", value=s.waiting)
        preemptions = CounterMetricFamily(
            "skippy:num_preemptions",
            "Sequences preempted, by reason (memory pressure, or a waiting request of higher "
            "priority); they resume from their kept KV or recompute.", labels=["reason"])
        priority = min(s.preemptions_priority, s.preemptions)
        preemptions.add_metric(["memory"], s.preemptions - priority)
        preemptions.add_metric(["priority"], priority)
        yield preemptions
        lookups = s.prefix_hits + s.prefix_misses
        yield GaugeMetricFamily("skippy:prefix_cache_hit_rate",
                                "Share of admitted requests that carried a cached prefix.",
                                value=s.prefix_hits / lookups if lookups else 0.0)
        yield GaugeMetricFamily("skippy:num_lanes_in_use",
                                "llama.cpp sequence ids held by requests.", value=s.lanes_in_use)
        yield GaugeMetricFamily("skippy:kv_cache_usage_perc",
                                "Share of the KV cache's cells holding request tokens (0-1).",
                                value=s.kv_tokens / s.kv_capacity if s.kv_capacity else 0.0)
        yield CounterMetricFamily("skippy:iterations", "Iterations the engine has completed.",
                                  value=s.iterations)
        yield CounterMetricFamily("skippy:decoded_tokens",
                                  "Batch entries the host decoded (prompt and decode rows).",
                                  value=s.decoded_tokens)
        yield CounterMetricFamily("skippy:plans_staged_ahead",
                                  "Plans the host staged while the plan before them ran on the "
                                  "device (--stage-ahead).", value=s.staged_ahead)
        if s.not_staged_ahead:
            missed = CounterMetricFamily(
                "skippy:plans_not_staged_ahead",
                "Plans that ran after another on the device without a staging made while it "
                "ran, by why (docs/measuring.md).", labels=["reason"])
            for reason, n in s.not_staged_ahead.items():
                missed.add_metric([reason], n)
            yield missed
        # Where the work of preemption goes (bench/priority_load.py takes their deltas).
        yield CounterMetricFamily("skippy:prefill_computed_tokens",
                                  "Prompt tokens prefilled (restored prefixes not included).",
                                  value=s.prefill_tokens)
        yield CounterMetricFamily(
            "skippy:recomputed_tokens",
            "Replay tokens prefilled again to resume preempted sequences.",
            value=s.recompute_tokens)
        yield CounterMetricFamily(
            "skippy:prefix_restored_tokens",
            "Tokens admitted as prefix restores (a resume from kept KV restores its replay).",
            value=s.restored_tokens)
        yield CounterMetricFamily(
            "skippy:kv_copies",
            "KV copies between llama.cpp sequence ids (into prefix holders and back, forks of "
            "n > 1); with a KV stream per sequence each moves a whole stream.",
            value=s.kv_copies)
        yield CounterMetricFamily(
            "skippy:shared_prefill_tokens",
            "Entries the host did not decode: copies of another choice's KV (n > 1, best_of).",
            value=s.shared_tokens)
        yield CounterMetricFamily(
            "skippy:slo_relegated",
            "Requests the slack rule's prefill order put behind the others because their "
            "first-token deadline could no longer be met (each counted once).",
            value=s.slo_relegated)


_PART_HELP = (
    "Engine iterations' time by part (wall: the iteration's share of elapsed time; before: the "
    "server's before-step work; plan: plan_iteration; execute: the host's execution; wait: the "
    "engine thread blocked on an asynchronous execution; events: token events and the "
    "hand-over to the event loop; complete: complete_iteration and releases).")


class _StepCollector:
    """`skippy:step_seconds{part}` and `skippy:host_busy_ratio`, from the engine's
    `StepTiming` (the one the last `EngineStats` names)."""

    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        timing = self._stats().steps
        h = HistogramMetricFamily("skippy:step_seconds", _PART_HELP, labels=["part"])
        les = [f"{b:g}" for b in BUCKETS_S] + ["+Inf"]
        for part in PARTS:
            if timing is None:
                counts, total = [0] * len(les), 0.0
            else:
                counts, total = timing.histogram(part)
            h.add_metric([part], list(zip(les, map(float, counts))), total)
        yield h
        yield GaugeMetricFamily(
            "skippy:host_busy_ratio", "Share of wall time the host spent executing plans over "
            f"the last {BUSY_WINDOW} iterations and, while idle, the time since (0-1).",
            value=timing.busy_ratio(idle_counts=True) if timing is not None else 0.0)


class _GcCollector:
    """The process's garbage-collector pauses (serve/gc_pauses.py)."""

    def __init__(self, pauses: GcPauses) -> None:
        self._pauses = pauses

    def collect(self) -> Iterator[Metric]:
        p = self._pauses
        counts = CounterMetricFamily(
            "skippy:gc_collections", "Collections of the cyclic garbage collector in this "
            "process, by generation (2: full).", labels=["generation"])
        seconds = CounterMetricFamily(
            "skippy:gc_pause_seconds", "Wall time the garbage collector's passes held the "
            "interpreter (every thread stopped), by generation.", labels=["generation"])
        longest = GaugeMetricFamily(
            "skippy:gc_pause_max_seconds", "The longest pass of the garbage collector so "
            "far, by generation.", labels=["generation"])
        for g in range(GENERATIONS):
            counts.add_metric([str(g)], p.collections[g])
            seconds.add_metric([str(g)], p.seconds[g])
            longest.add_metric([str(g)], p.longest[g])
        yield counts
        yield seconds
        yield longest
        yield GaugeMetricFamily(
            "skippy:gc_frozen_objects", "Objects kept out of the garbage collector's passes "
            "(the startup heap `serve` freezes before it listens).",
            value=gc.get_freeze_count())


class DeviceMemory:
    """`skippy:device_memory_bytes{device, kind}`: the weights and the KV cache of the model
    per device, as placed at load (hosts/offload.py `Placement`)."""

    def __init__(self, placement: Any) -> None:
        self._placement = placement

    def collect(self) -> Iterator[Metric]:
        g = GaugeMetricFamily("skippy:device_memory_bytes",
                              "Bytes of the model's weights and KV cache per device, as placed "
                              "at load.", labels=["device", "kind"])
        p = self._placement
        for kind, per in (("weights", p.weights), ("kv", p.kv)):
            for device, size in sorted(per.items()):
                g.add_metric([device, kind], float(size))
        yield g
        yield GaugeMetricFamily("skippy:gpu_layers", "Layers on GPUs (llama.cpp's count, the "
                                "output layer included).", value=p.n_gpu_layers)


class ServeMetrics:
    """One registry per server (several servers can live in one process, as in tests)."""

    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        reg = CollectorRegistry(auto_describe=True)
        self.registry = reg
        self.ttft = Histogram("skippy:time_to_first_token_seconds",
                              "Time to first token of each choice, from the request's "
                              "arrival.", buckets=_TTFT_BUCKETS, registry=reg)
        self.ttft_by_priority = Histogram(
            "skippy:time_to_first_token_by_priority_seconds",
            "Time to first token, by request priority (higher runs first).", ["priority"],
            buckets=_TTFT_BUCKETS, registry=reg)
        self._priority_labels: dict[int, Any] = {}
        # Observed once per streamed token, on the event loop: a histogram without locks.
        self.itl = LoopHistogram("skippy:inter_token_latency_seconds",
                                 "Time between consecutive tokens of a request.", _ITL_BUCKETS)
        reg.register(self.itl)
        self.e2e = Histogram("skippy:e2e_request_latency_seconds",
                             "Time from arrival to the end of each choice.",
                             buckets=_E2E_BUCKETS, registry=reg)
        self.prompt_tokens = Counter("skippy:prompt_tokens", "Prompt tokens of admitted requests "
                                     "(once per prompt, whatever n or best_of).",
                                     registry=reg)
        self.generation_tokens = Counter("skippy:generation_tokens",
                                         "Tokens generated (every choice run, best_of "
                                         "candidates not returned included).", registry=reg)
        self.request_success = Counter("skippy:request_success",
                                       "Choices that ended (each of n, every best_of "
                                       "candidate), by finish reason.",
                                       ["finished_reason"], registry=reg)
        self.request_errors = Counter("skippy:request_errors",
                                      "Requests answered with an error, by HTTP status.",
                                      ["status"], registry=reg)
        # The SLO's verdicts and sheds (serve/slo.py; docs/serving.md "An SLO").
        self.slo_met = Counter("skippy:slo_met",
                               "Choices of complete answers within their SLO, by part "
                               "(ttft: TTFT within its budget; itl: every gap within its "
                               "budget; both: requests carrying both budgets, within both).",
                               ["part"], registry=reg)
        self.slo_missed = Counter("skippy:slo_missed",
                                  "Choices of complete answers outside their SLO, by part "
                                  "(ttft, itl; both: requests carrying both budgets, outside "
                                  "either).", ["part"], registry=reg)
        for part in ("ttft", "itl", "both"):
            self.slo_met.labels(part)
            self.slo_missed.labels(part)
        self.slo_shed = Counter("skippy:slo_shed",
                                "Requests answered 503 at arrival because the cost model "
                                "predicted they could not meet their TTFT budget (--slo-shed).",
                                registry=reg)
        reg.register(_EngineCollector(stats))
        reg.register(_StepCollector(stats))
        reg.register(_GcCollector(process_pauses()))

    def observe_ttft(self, seconds: float, priority: int) -> None:
        """A request's first token came `seconds` after it arrived."""
        self.ttft.observe(seconds)
        child = self._priority_labels.get(priority)
        if child is None:
            known = len(self._priority_labels) < PRIORITY_LABELS
            child = self.ttft_by_priority.labels(str(priority) if known else "other")
            if known:
                self._priority_labels[priority] = child
        child.observe(seconds)

    def render(self) -> bytes:
        return bytes(generate_latest(self.registry))
