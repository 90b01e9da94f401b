"""Settings of a lab run: the scheduler it builds, its runtime models and its goodput targets.

`RunOptions` holds what the workload suite and the trace replay share (the scheduler's size and
chunking, the KV-cell memory model); `SuiteOptions` and `ReplayOptions` add what only one of
them has and their own goodput targets. The field order is the order of the `options` object
in the lab's JSON documents, so new fields go at the end of a class.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Hashable, Mapping, Optional

from ..cost_model import LAB_COST, StepCost
from ..slack import PlanningRule
from ..types import MemoryComponent, SchedulerConfig

MODES = ("phase", "mixed")  # what runs by default
# "slack": the slack-sized planning rule (docs/behaviour.md §2.13), its inter-token target the
# run's goodput target and its cost model the run's (the engine refits it from the steps).
ALL_MODES = MODES + ("slack",)
DEFAULT_PREFIX_CACHE_TOKENS = 8 << 20


@dataclass(frozen=True)
class RunOptions:
    """The scheduler a lab run builds and its KV-cell memory model (docs/lab.md)."""

    max_active: int = 32
    max_tokens: int = 2_048
    chunk: int = 512
    kv_capacity_tokens: int = 0  # 0 = no memory component
    reserve_output_tokens: int = 32  # admission reserves prompt + min(output, this) cells

    @property
    def reserve(self) -> Optional[int]:
        """Output tokens an admission reserves cells for; None without the memory model."""
        return self.reserve_output_tokens if self.kv_capacity_tokens > 0 else None

    def kv_cells_needed(self, input_tokens: int, output_tokens: int) -> int:
        """The fewest KV cells (`kv_capacity_tokens`) a request of these lengths runs in, even
        alone: its admission reserves prompt + min(output, reserve_output_tokens) cells, and
        while it runs it holds one cell per token fed, which the engine measures after each
        step (after the step it ends on, it has left): prompt + output - 2 at most, as its last
        output token is never fed. Fewer cells stall the run (it can never be admitted, or it
        is preempted whenever it runs)."""
        reserved = min(output_tokens, self.reserve_output_tokens)
        return input_tokens + max(reserved, output_tokens - 2)

    def config(self, mode: str, cost: Optional[StepCost] = None) -> SchedulerConfig:
        """The scheduler configuration of a run in planning mode `mode` ("phase", "mixed" or
        "slack"; `cost` is the slack rule's starting cost model)."""
        if mode not in ALL_MODES:
            raise ValueError(f"unknown planning mode {mode!r} (choose from "
                             f"{', '.join(ALL_MODES)})")
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
            **(self._slack(cost) if mode == "slack" else {}),
        )

    def _slack(self, cost: Optional[StepCost]) -> dict[str, Any]:
        target_ms = float(getattr(self, "itl_target_ms", 0.0)) or 100.0
        return {"planning_rule": PlanningRule.SLACK, "itl_target": target_ms / 1e3,
                "step_cost": cost or LAB_COST}

    def _check_common(self, ttft_target_ms: float, itl_target_ms: float) -> None:
        for name in ("max_active", "max_tokens", "chunk"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name.replace('_', '-')} must be >= 1")
        if self.kv_capacity_tokens < 0 or self.reserve_output_tokens < 0:
            raise ValueError("memory options must be >= 0")
        if not all(math.isfinite(t) and t >= 0 for t in (ttft_target_ms, itl_target_ms)):
            raise ValueError("goodput targets must be finite and >= 0")


@dataclass(frozen=True)
class SuiteOptions(RunOptions):
    """A workload-suite run: goodput targets in the cost model's virtual time."""

    ttft_target_ms: float = 50.0
    itl_target_ms: float = 1.5
    record_series: bool = False

    def validate(self) -> "SuiteOptions":
        self._check_common(self.ttft_target_ms, self.itl_target_ms)
        return self


@dataclass(frozen=True)
class ReplayOptions(RunOptions):
    """A trace replay: the bounded block prefix cache, goodput targets, fair-share weights."""

    prefix_cache_tokens: Optional[int] = DEFAULT_PREFIX_CACHE_TOKENS  # None = unbounded, 0 = off
    ttft_target_ms: float = 1_000.0
    itl_target_ms: float = 5.0
    tenant_weights: Optional[Mapping[Hashable, float]] = None  # fair-share weights (default 1)
    record_series: bool = False
    # Tell the scheduler the goodput targets as every request's SLO: a first-token deadline
    # ttft_target_ms after its arrival and an inter-token target of itl_target_ms (the slack
    # mode plans to it; its prefill order ranks by the deadlines, behaviour.md §2.13).
    slo_told: bool = False

    def validate(self) -> "ReplayOptions":
        self._check_common(self.ttft_target_ms, self.itl_target_ms)
        if self.slo_told and not (self.ttft_target_ms > 0 and self.itl_target_ms > 0):
            raise ValueError("an SLO told to the scheduler needs ttft-target-ms and "
                             "itl-target-ms > 0")
        if self.prefix_cache_tokens is not None and self.prefix_cache_tokens < 0:
            raise ValueError("prefix-cache-tokens must be >= 0")
        return self
