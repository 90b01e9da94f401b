"""The slack-sized planning rule's configuration types (docs/behaviour.md §2.13).

`PlanningRule` picks how a plan is filled when prefill and decode both wait: the reference's
rule (homogeneous plans and the mixed gate of §2.6) or the slack rule, which sizes each step's
prefill chunk from the tightest decode slack. `StepCost` is the rule's cost model, in µs, of
the same shape as the lab's `RuntimeCostModel` (§5.3); the engine refits it online from
observed step durations (`skippy_scheduler.engine.cost_fit`).
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, fields
from typing import Any


class PlanningRule(enum.Enum):
    """How a plan is filled when prefill and live decode both wait; values match the C core."""

    REFERENCE = 0
    SLACK = 1


def _check_us(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of µs, got {type(value).__name__}")
    us = float(value)
    if not math.isfinite(us) or us < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return us


@dataclass(frozen=True)
class StepCost:
    """Predicted time of one step, in µs: `base_us` + `per_prefill_token_us` × prefill and
    recompute tokens + `per_prefill_row_us` × (prefill rows − 1, when there are several: the
    pass llama.cpp runs for each further prefill sequence, §2.13) + `per_prefill_position_us` ×
    (the sum of the prefill and recompute tokens' positions) / 1000 (each prefill token
    attends to the context before it) + (when the step has decode rows) `decode_base_us` +
    `per_decode_row_us` × decode rows. Every coefficient is a finite number >= 0."""

    base_us: float = 8000.0
    per_prefill_token_us: float = 600.0
    decode_base_us: float = 0.0
    per_decode_row_us: float = 700.0
    per_prefill_row_us: float = 0.0
    per_prefill_position_us: float = 0.0

    def __post_init__(self) -> None:
        for f in fields(self):
            object.__setattr__(self, f.name, _check_us(f.name, getattr(self, f.name)))

    def predict_us(self, prefill_tokens: int, decode_rows: int, prefill_rows: int = 1,
                   prefill_positions: int = 0) -> float:
        """The step's predicted µs; `prefill_positions` is the sum of its prefill and
        recompute tokens' positions (`IterationPlan.prefill_positions`)."""
        decode = (self.decode_base_us + self.per_decode_row_us * decode_rows
                  if decode_rows else 0.0)
        extra_rows = max(prefill_rows - 1, 0)
        return (self.base_us + self.per_prefill_token_us * prefill_tokens
                + self.per_prefill_row_us * extra_rows
                + self.per_prefill_position_us * (prefill_positions / 1000.0) + decode)

    @classmethod
    def from_runtime_cost_model(cls, model: Any) -> "StepCost":
        """The same prediction as a lab `RuntimeCostModel` (§5.3), with no per-row toll."""
        return cls(base_us=model.iteration_overhead_us,
                   per_prefill_token_us=model.prefill_token_us,
                   decode_base_us=model.decode_batch_us,
                   per_decode_row_us=model.decode_sequence_us)


def check_planning_rule(name: str, value: object) -> PlanningRule:
    if not isinstance(value, PlanningRule):
        raise TypeError(f"{name} must be a PlanningRule, got {type(value).__name__}")
    return value


def check_positive_seconds(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds, got {type(value).__name__}")
    seconds = float(value)
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"{name} must be a finite number of seconds > 0, got {value!r}")
    return seconds


def check_optional_seconds(name: str, value: object) -> float | None:
    """None, or a finite number of seconds > 0 (a per-request target or deadline)."""
    return None if value is None else check_positive_seconds(name, value)


def check_safety(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    factor = float(value)
    if not math.isfinite(factor) or factor <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return factor


def check_step_cost(name: str, value: object) -> StepCost:
    if not isinstance(value, StepCost):
        raise TypeError(f"{name} must be a StepCost, got {type(value).__name__}")
    return value


def check_clock(value: object) -> float:
    """A clock reading in seconds: a finite number (any origin)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"now must be a number of seconds, got {type(value).__name__}")
    now = float(value)
    if not math.isfinite(now):
        raise ValueError(f"now must be a finite number of seconds, got {value!r}")
    return now
