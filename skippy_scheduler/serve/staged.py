"""The OpenAI server on a staged model (`serve --stages DIR` / `--stage-addresses`).

`stage_host(settings)` makes the `StageHost` a `Server` runs on from its settings
(hosts/stages/opening.py: local workers for a stage directory, stopped when the host closes,
or workers already running at the given addresses). `StagedEngineRunner` is the server's
engine runner for it: once the chain of stages is broken (a worker died or stopped answering,
docs/stages.md "When a stage fails") the open requests end with the reason, and new requests
and `/health` get a 503 instead of being queued on a pipeline that can no longer run them.

`StageMetrics` puts each stage's measured KV use on `/metrics` (docs/stages.md "KV memory per
stage"): a scrape asks the engine thread to measure (`StageHost.stage_usage`, between two
steps, without waiting for it) and shows the last measurement taken, so a scrape sees what the
stages held at the previous one, and an unscraped server never pays for a measurement.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any, Iterator, Optional

from ..engine import FinishEvent, Request
from ..types import FinishReason
from ..hosts.offload import CPU_BATCH
from ..hosts.stages.channel import StageFailure
from ..hosts.stages.host import StageHost
from ..hosts.stages.opening import open_stage_host
from ..hosts.stages.usage import StageUsage
from .runner import EngineRunner, EngineUnavailable, Inbox, Subscription
from .server import ServeSettings, _reuse_of, context_of

__all__ = ["StageMetrics", "StagedEngineRunner", "stage_host"]


def stage_host(settings: ServeSettings) -> StageHost:
    """The stage host of a server's resolved settings (`stages` or `stage_addresses`)."""
    s = settings
    tokens, holders = _reuse_of(s)
    return open_stage_host(
        stages=s.stages, stage_addresses=s.stage_addresses, model=s.model,
        ctx_size=context_of(s), n_seq_max=s.max_active, n_batch=s.batch_size or CPU_BATCH,
        n_threads=s.threads, kv_type=s.kv_type or "f32", flash_attn=s.flash_attn in (True, "on"),
        prefix_cache_tokens=tokens, prefix_holders=holders, pipeline_depth=s.inflight or 1,
        stage_prefix_cache_tokens=s.stage_prefix_cache_tokens,
        stage_args=s.stage_worker_args)


class StagedEngineRunner(EngineRunner):
    """An `EngineRunner` that stops taking requests once the stage chain is broken. While no
    request is open it checks every `heartbeat_s` that each stage still answers (within
    `heartbeat_timeout_s`), so that a remote worker that died or hung meanwhile gives the
    503 before a request is sent to it."""

    host: StageHost
    usage: list[StageUsage] = []  # the last measurement (replaced whole, never mutated)
    usage_at = 0.0  # time.monotonic() of it
    _measuring = False
    heartbeat_s = 5.0
    heartbeat_timeout_s = 10.0
    _beat_at: Optional[float] = None  # time.monotonic() of the last beat (None: busy)

    def _before_step(self, engine: Any) -> None:
        super()._before_step(engine)
        if engine.outstanding:
            self._beat_at = None  # busy: its plans' answers tell
        elif self._beat_at is None:
            self._beat_at = time.monotonic()  # idle from now on
        elif time.monotonic() - self._beat_at >= self.heartbeat_s:
            self._beat_at = time.monotonic()
            self.host.check_alive(self.heartbeat_timeout_s)

    def request_usage(self) -> None:
        """Have the engine thread measure every stage's KV use between two steps (no wait)."""
        if self._measuring or self.host.broken is not None:
            return
        self._measuring = True

        def measure() -> None:
            # While idle, within the heartbeat's time: a stage that died meanwhile must not
            # hold the engine thread (and the heartbeat) for the chain's default minute.
            timeout = self.heartbeat_timeout_s if self._beat_at is not None else None
            try:
                self.usage, self.usage_at = self.host.stage_usage(timeout), time.monotonic()
            except StageFailure:
                pass  # the chain broke: `host.broken` and the open requests say why
            finally:
                self._measuring = False
        self.post(measure)

    def _broken(self) -> Optional[str]:
        """Why the chain cannot run: the failure the engine thread met, else a local worker
        process that has exited since (noticed here between requests, before a plan is sent
        to it)."""
        broken: Optional[str] = self.host.broken
        return broken if broken is not None else self.host.exited()

    @property
    def running(self) -> bool:
        return super().running and self._broken() is None

    @property
    def unavailable_reason(self) -> str:
        broken = self._broken()
        return (f"a stage of the model failed: {broken}" if broken is not None
                else super().unavailable_reason)

    def open(self, request: Request, loop: asyncio.AbstractEventLoop,
             inbox: Optional[Inbox] = None) -> Subscription:
        broken = self._broken()
        if broken is not None:
            raise EngineUnavailable(f"a stage of the model failed: {broken}")
        return super().open(request, loop, inbox)

    def _deliver(self, event: Any) -> None:
        if isinstance(event, FinishEvent) and event.reason == FinishReason.FAILED.value:
            broken = self.host.broken
            sub = self.subscription(event.request_id)
            if broken is not None and sub is not None and sub.error is None:
                sub.error = f"a stage of the model failed: {broken}"
        super()._deliver(event)


class StageMetrics:
    """A Prometheus collector of the stages' measured KV use and their budgets."""

    def __init__(self, runner: StagedEngineRunner) -> None:
        self.runner = runner

    def describe(self) -> Iterator[Any]:
        """The families, without measuring (what registering asks)."""
        return self._families(measure=False)

    def collect(self) -> Iterator[Any]:
        return self._families(measure=True)

    def _families(self, measure: bool) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        runner = self.runner
        if measure:
            runner.request_usage()
        cells = GaugeMetricFamily(
            "skippy:stage_kv_cells", "KV cells each stage holds, as llama.cpp counts them, for "
            "the lanes (requests) or the prefix holders (a shared cell counts for each "
            "sequence), at the last measurement.", labels=["stage", "holder"])
        used = GaugeMetricFamily(
            "skippy:stage_kv_bytes", "Bytes of those cells' KV state, as llama.cpp counts them.",
            labels=["stage", "holder"])
        for u in runner.usage:
            for kind, c, b in (("lanes", u.lane_cells, u.lane_bytes),
                               ("holders", u.holder_cells, u.holder_bytes)):
                cells.add_metric([str(u.index), kind], c)
                used.add_metric([str(u.index), kind], b)
        budget = GaugeMetricFamily(
            "skippy:stage_kv_budget_bytes", "Each stage's KV memory component: its cells times "
            "the bytes one position takes in its layers.", labels=["stage"])
        for k, comp in enumerate(runner.host.memory_components):
            budget.add_metric([str(k)], comp.capacity_bytes)
        age = GaugeMetricFamily("skippy:stage_kv_measured_age_seconds",
                                "Seconds since the stages' KV use was last measured (-1: never).",
                                value=time.monotonic() - runner.usage_at
                                if runner.usage else -1.0)
        yield from (cells, used, budget, age)
