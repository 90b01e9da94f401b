"""The OpenAI server on a staged model (`serve --stages DIR` / `--stage-addresses`).

`open_stage_host(settings)` makes the `StageHost` a `Server` runs on: local workers for a
stage directory (stopped when the host closes) or workers already running at the given
addresses. `StagedEngineRunner` is the server's engine runner for it: once the chain of
stages is broken (a worker died or stopped answering, docs/stages.md "When a stage fails")
the open requests end with the reason, and new requests and `/health` get a 503 instead of
being queued on a pipeline that can no longer run them.

`StageMetrics` puts each stage's measured KV use on `/metrics` (docs/stages.md "KV memory per
stage"): a scrape asks the engine thread to measure (`StageHost.stage_usage`, between two
steps, without waiting for it) and shows the last measurement taken, so a scrape sees what the
stages held at the previous one, and an unscraped server never pays for a measurement.
"""
from __future__ import annotations

import time
from concurrent.futures import Future
from typing import Any, Iterator, Optional

from ..engine import FinishEvent
from ..serve.runner import EngineRunner, EngineUnavailable, Inbox, Subscription
from .channel import StageFailure
from .host import StageHost
from .local import LocalStages
from .usage import StageUsage

__all__ = ["StageMetrics", "StagedEngineRunner", "open_stage_host", "stage_context_cells"]

CELLS_STEP = 256  # llama.cpp pads a context to a multiple of this


def stage_context_cells(ctx_size: int, prefix_cache_tokens: int) -> int:
    """KV cells of every stage context: the lanes' `ctx_size`, plus the cells the prefix
    holders keep (one unified cache per stage, so holders share cells with the lanes)."""
    extra = -(-prefix_cache_tokens // CELLS_STEP) * CELLS_STEP if prefix_cache_tokens else 0
    return ctx_size + extra


def open_stage_host(settings: Any) -> StageHost:
    """The stage host of a server's settings (`stages` or `stage_addresses`)."""
    from ..serve.server import context_of
    from .holders import check_stage_capacities
    from .split import file_identity, stage_paths

    s = settings
    if s.stages and s.stage_addresses:
        raise ValueError("give stages or stage_addresses, not both")
    host_args: dict[str, Any] = dict(
        n_ctx=stage_context_cells(context_of(s), s.prefix_cache_tokens), n_seq_max=s.max_active,
        # A stage keeping fewer prefixes gets only the cells its own capacity needs.
        stage_n_ctx=[stage_context_cells(context_of(s), c) for c in s.stage_prefix_cache_tokens]
        or None,
        n_batch=s.batch_size or 512, n_threads=s.threads or 2, kv_type=s.kv_type or "f32",
        flash_attn=s.flash_attn in (True, "on"),
        prefix_cache_tokens=s.prefix_cache_tokens, prefix_holders=s.prefix_holders,
        pipeline_depth=s.inflight,
        stage_prefix_cache_tokens=tuple(s.stage_prefix_cache_tokens) or None)
    if s.stages:
        # Refused before a worker starts: one capacity per stage file.
        check_stage_capacities(host_args["stage_prefix_cache_tokens"], s.prefix_cache_tokens,
                               len(stage_paths(s.stages)))
        local = LocalStages(s.stages, n_threads=s.threads, source_model=s.model,
                            stage_args=getattr(s, "stage_worker_args", ()))
        try:
            host = local.host(**host_args)
        except BaseException:
            local.close()
            raise
        host.on_close.append(local.close)
        return host
    if not s.model:
        raise ValueError("stage_addresses needs model: the model the stages were cut from "
                         "(its vocabulary tokenizes the prompts)")
    return StageHost(list(s.stage_addresses), source_id=file_identity(s.model),
                     vocab_model=s.model, **host_args)


class StagedEngineRunner(EngineRunner):
    """An `EngineRunner` that stops taking requests once the stage chain is broken."""

    host: StageHost
    usage: list[StageUsage] = []  # the last measurement (replaced whole, never mutated)
    usage_at = 0.0  # time.monotonic() of it
    _measuring = False

    def request_usage(self) -> None:
        """Have the engine thread measure every stage's KV use between two steps (no wait)."""
        if self._measuring or self.host.broken is not None:
            return
        self._measuring = True

        def measure() -> None:
            try:
                self.usage, self.usage_at = self.host.stage_usage(), time.monotonic()
            except StageFailure:
                pass  # the chain broke: the open requests say why
            finally:
                self._measuring = False
        self._calls.append((measure, Future()))
        self.engine.wake()

    @property
    def running(self) -> bool:
        return super().running and self.host.broken is None

    def open(self, request: Any, loop: Any, inbox: Optional[Inbox] = None) -> Subscription:
        broken: Optional[str] = self.host.broken
        if broken is not None:
            raise EngineUnavailable(f"a stage of the model failed: {broken}")
        return super().open(request, loop, inbox)

    def _deliver(self, event: Any) -> None:
        if isinstance(event, FinishEvent) and event.reason == "failed":
            broken = self.host.broken
            sub = self._subs.get(event.request_id)
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
