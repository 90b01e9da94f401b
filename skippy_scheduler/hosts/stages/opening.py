"""A stage host for a driver: local workers for a stage directory, or workers already running.

`open_stage_host(...)` makes the `StageHost` a driver runs on (the server gives it its settings
in serve/staged.py). With `stages` it starts a local worker for every stage file
(`LocalStages`, stopped when the host closes); with `stage_addresses` it drives workers already
running, `model` (the model the stages were cut from) giving the vocabulary. Every stage
context holds the lanes' `ctx_size` cells and the cells its prefix holders keep
(`stage_context_cells`).
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

from .host import StageHost
from .local import LocalStages

__all__ = ["CELLS_STEP", "open_stage_host", "stage_context_cells"]

CELLS_STEP = 256  # llama.cpp pads a context to a multiple of this


def stage_context_cells(ctx_size: int, prefix_cache_tokens: int) -> int:
    """KV cells of every stage context: the lanes' `ctx_size`, plus the cells the prefix
    holders keep (one unified cache per stage, so holders share cells with the lanes)."""
    extra = -(-prefix_cache_tokens // CELLS_STEP) * CELLS_STEP if prefix_cache_tokens else 0
    return ctx_size + extra


def open_stage_host(*, stages: Optional[str] = None, stage_addresses: Sequence[str] = (),
                    model: Optional[str] = None, ctx_size: int, n_seq_max: int,
                    n_batch: int = 512, n_threads: Optional[int] = None,
                    kv_type: str = "f32", flash_attn: bool = False,
                    prefix_cache_tokens: int = 0, prefix_holders: int = 16,
                    pipeline_depth: int = 1, stage_prefix_cache_tokens: Sequence[int] = (),
                    stage_args: Sequence[Sequence[str]] = ()) -> StageHost:
    """The stage host on the workers of the stage directory `stages` (started here) or on
    those at `stage_addresses` (give one, not both).

    `ctx_size`: the lanes' KV cells, every stage context getting the prefix holders' cells
    besides. `n_threads`: each local worker's threads (None: the cores divided among them;
    the host asks for 2 then). `stage_prefix_cache_tokens`: one prefix cache capacity per stage
    (empty: `prefix_cache_tokens` each). `stage_args`: further `stage` flags per local stage.
    The other keywords are `StageHost`'s.
    """
    if stages and stage_addresses:
        raise ValueError("give stages or stage_addresses, not both")
    from .holders import check_stage_capacities
    from .split import file_identity, stage_paths

    host_args: dict[str, Any] = dict(
        n_ctx=stage_context_cells(ctx_size, prefix_cache_tokens), n_seq_max=n_seq_max,
        # A stage keeping fewer prefixes gets only the cells its own capacity needs.
        stage_n_ctx=[stage_context_cells(ctx_size, c) for c in stage_prefix_cache_tokens]
        or None,
        n_batch=n_batch, n_threads=n_threads or 2, kv_type=kv_type, flash_attn=flash_attn,
        prefix_cache_tokens=prefix_cache_tokens, prefix_holders=prefix_holders,
        pipeline_depth=pipeline_depth,
        stage_prefix_cache_tokens=tuple(stage_prefix_cache_tokens) or None)
    if stages:
        # Refused before a worker starts: one capacity per stage file.
        check_stage_capacities(host_args["stage_prefix_cache_tokens"], prefix_cache_tokens,
                               len(stage_paths(stages)))
        local = LocalStages(stages, n_threads=n_threads, source_model=model,
                            stage_args=stage_args, n_batch=n_batch)
        try:
            host = local.host(**host_args)
        except BaseException:
            local.close()
            raise
        host.on_close.append(local.close)
        return host
    if not model:
        raise ValueError("stage_addresses needs model: the model the stages were cut from "
                         "(its vocabulary tokenizes the prompts)")
    return StageHost(list(stage_addresses), source_id=file_identity(model), vocab_model=model,
                     **host_args)
