"""The slack-sized planning rule's configuration types (docs/behaviour.md §2.13).

`PlanningRule` picks how a plan is filled when prefill and decode both wait: the reference's
rule (homogeneous plans and the mixed gate of §2.6) or the slack rule, which sizes each step's
prefill chunk from the tightest decode slack. `StepCost` (skippy_scheduler.cost_model, imported
here for the configuration's users) is the rule's cost model, in µs, the same one the lab's
virtual clock charges (§5.3); the engine refits it online from observed step durations
(`skippy_scheduler.engine.cost_fit`).
"""
from __future__ import annotations

import enum
import math

from ._validate import as_float
from .cost_model import StepCost as StepCost  # re-exported: the rule's cost model


class PlanningRule(enum.Enum):
    """How a plan is filled when prefill and live decode both wait; values match the C core."""

    REFERENCE = 0
    SLACK = 1


def check_planning_rule(name: str, value: object) -> PlanningRule:
    if not isinstance(value, PlanningRule):
        raise TypeError(f"{name} must be a PlanningRule, got {type(value).__name__}")
    return value


def check_positive_seconds(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds, got {type(value).__name__}")
    seconds = as_float(value)
    if not math.isfinite(seconds * 1e6) or seconds <= 0:  # finite in µs too, as the core has it
        raise ValueError(f"{name} must be a finite number of seconds > 0, got {value!r}")
    return seconds


def check_optional_seconds(name: str, value: object) -> float | None:
    """None, or a finite number of seconds > 0 (a per-request target or deadline)."""
    return None if value is None else check_positive_seconds(name, value)


def check_safety(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    factor = as_float(value)
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
    now = as_float(value)
    if not math.isfinite(now):
        raise ValueError(f"now must be a finite number of seconds, got {value!r}")
    return now
