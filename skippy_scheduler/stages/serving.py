"""The OpenAI server on a staged model (`serve --stages DIR` / `--stage-addresses`).

`open_stage_host(settings)` makes the `StageHost` a `Server` runs on: local workers for a
stage directory (stopped when the host closes) or workers already running at the given
addresses. `StagedEngineRunner` is the server's engine runner for it: once the chain of
stages is broken (a worker died or stopped answering, docs/stages.md "When a stage fails")
the open requests end with the reason, and new requests and `/health` get a 503 instead of
being queued on a pipeline that can no longer run them.
"""
from __future__ import annotations

from typing import Any, Optional

from ..engine import FinishEvent
from ..serve.runner import EngineRunner, EngineUnavailable, Inbox, Subscription
from .host import StageHost
from .local import LocalStages

__all__ = ["StagedEngineRunner", "open_stage_host", "stage_context_cells"]

CELLS_STEP = 256  # llama.cpp pads a context to a multiple of this


def stage_context_cells(ctx_size: int, prefix_cache_tokens: int) -> int:
    """KV cells of every stage context: the lanes' `ctx_size`, plus the cells the prefix
    holders keep (one unified cache per stage, so holders share cells with the lanes)."""
    extra = -(-prefix_cache_tokens // CELLS_STEP) * CELLS_STEP if prefix_cache_tokens else 0
    return ctx_size + extra


def open_stage_host(settings: Any) -> StageHost:
    """The stage host of a server's settings (`stages` or `stage_addresses`)."""
    from .split import file_identity

    s = settings
    if s.stages and s.stage_addresses:
        raise ValueError("give stages or stage_addresses, not both")
    host_args: dict[str, Any] = dict(
        n_ctx=stage_context_cells(s.ctx_size, s.prefix_cache_tokens), n_seq_max=s.max_active,
        n_batch=s.batch_size, n_threads=s.threads, kv_type=s.kv_type, flash_attn=s.flash_attn,
        prefix_cache_tokens=s.prefix_cache_tokens, prefix_holders=s.prefix_holders,
        pipeline_depth=s.inflight)
    if s.stages:
        local = LocalStages(s.stages, n_threads=s.threads, source_model=s.model)
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
