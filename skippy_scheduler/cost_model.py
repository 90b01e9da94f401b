"""The step-cost model, what one plan costs a runtime in µs, and the one routine that fits it.

    predicted µs = base_us + per_prefill_token_us × (Prefill and Recompute tokens)
                   + per_prefill_row_us × (prefill rows − 1, when there are several)
                   + per_prefill_position_us × (those tokens' positions, summed) / 1000
                   + [any Decode row] × (decode_base_us + per_decode_row_us × Decode rows)

(docs/behaviour.md §2.13, §5.3). `StepCost` is the only cost model: the slack rule predicts
steps with it (native core and twin), the engine refits it online (`engine.cost_fit`), the lab's
virtual clock charges each plan by it, `calibrate` fits it to a real runtime, and a
`CostModelHost` runs under it. Both fits go through `fit_coefficients`.

The lab and calibrate price only the first four terms and have their own names for them, which
`parse`, `from_mapping` and `str()` still use: iteration_overhead_us (base_us), prefill_token_us
(per_prefill_token_us), decode_batch_us (decode_base_us) and decode_sequence_us
(per_decode_row_us). `LAB_COST` is the lab's default model. Prefix restores cost nothing here: a
restored prefix is simply not in the plan. This module imports nothing else of the package, so
that the scheduler's types, the hosts and the engine can all use it.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, fields, replace
from typing import Any, Mapping, Optional

import numpy as np

from ._validate import as_float, json_loads

# `IterationPhase.DECODE.value` (types.py) and the C `SKIPPY_PHASE_DECODE`: types.py imports
# this module (through slack.py), so it cannot be imported here. tests/engine/test_cost_model.py
# checks that the three agree.
DECODE_PHASE = 2

#: The terms of `StepCost`, in the order of its fields and of the C `skippy_step_cost`.
TERMS = ("base_us", "per_prefill_token_us", "decode_base_us", "per_decode_row_us",
         "per_prefill_row_us", "per_prefill_position_us")
#: The lab's names of the four terms it prices (the first four of `TERMS`).
LAB_NAMES = {"iteration_overhead_us": "base_us", "prefill_token_us": "per_prefill_token_us",
             "decode_batch_us": "decode_base_us", "decode_sequence_us": "per_decode_row_us"}


def decode_row_count(phases: Any) -> int:
    """Decode rows of a plan from its `phases` array (uint8 values of `IterationPhase`)."""
    # NOTE: bytes.count is the cheapest exact count for the few hundred rows of a plan.
    return bytes(phases).count(DECODE_PHASE)


def _check_us(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of µs, got {type(value).__name__}")
    us = as_float(value)
    if not math.isfinite(us) or us < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    # An int stays an int: integer coefficients price integer plans in integer µs, which is what
    # the lab's virtual clock prints (the native core reads every term as a double all the same).
    return int(value) if isinstance(value, int) else us


@dataclass(frozen=True)
class StepCost:
    """Predicted time of one step, in µs: `base_us` + `per_prefill_token_us` × prefill and
    recompute tokens + `per_prefill_row_us` × (prefill rows − 1, when there are several: the
    pass llama.cpp runs for each further prefill sequence, §2.13) + `per_prefill_position_us` ×
    (the sum of the prefill and recompute tokens' positions) / 1000 (each prefill token
    attends to the context before it) + (when the step has decode rows) `decode_base_us` +
    `per_decode_row_us` × decode rows. Every coefficient is a finite number >= 0 (an int is
    kept as an int, any other number becomes a float).

    The defaults are the slack rule's starting point for a CPU model; `LAB_COST` is the lab's."""

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
        # A term whose count is 0 is left out rather than added as 0.0, so that integer
        # coefficients give an integer (the float sums are the same either way).
        us = self.base_us + self.per_prefill_token_us * prefill_tokens
        if prefill_rows > 1:
            us += self.per_prefill_row_us * (prefill_rows - 1)
        if prefill_positions:
            us += self.per_prefill_position_us * (prefill_positions / 1000.0)
        if decode_rows:
            us += self.decode_base_us + self.per_decode_row_us * decode_rows
        return us

    def duration_us(self, prefill_tokens: int, decode_rows: int, prefill_rows: int = 1,
                    prefill_positions: int = 0) -> float:
        """What a virtual clock charges for the step: `predict_us`, at least 1 µs."""
        us = self.predict_us(prefill_tokens, decode_rows, prefill_rows, prefill_positions)
        return us if us >= 1 else 1

    def plan_duration_us(self, plan: Any) -> float:
        """`duration_us` of a live plan, read from its arrays (phases, token count, rows and
        the prefill positions)."""
        decode = decode_row_count(plan.phases)
        prefill_rows = len(plan) - decode
        positions = int(plan.prefill_positions) if prefill_rows else 0
        return self.duration_us(int(plan.token_count) - decode, decode, prefill_rows, positions)

    @property
    def lab_terms_only(self) -> bool:
        """Whether the model prices only what the lab's four terms price (no per-row and no
        position term): all a clock, told a plan's prefill tokens and decode rows, can charge."""
        return not (self.per_prefill_row_us or self.per_prefill_position_us)

    def terms(self) -> tuple[float, ...]:
        """The coefficients in the order of `TERMS`."""
        return tuple(getattr(self, name) for name in TERMS)

    def as_dict(self) -> dict[str, float]:
        """The six terms under their field names."""
        return dict(zip(TERMS, self.terms()))

    def lab_dict(self) -> dict[str, float]:
        """The four terms under the lab's names, as the lab's JSON documents print the model;
        ValueError for a model with a per-row or position term, which that form cannot hold."""
        if not self.lab_terms_only:
            raise ValueError(f"{self!s} has a per-row or position term, which the lab's four "
                             f"terms cannot hold")
        return {lab: getattr(self, name) for lab, name in LAB_NAMES.items()}

    def __str__(self) -> str:
        """The `name=value,...` form that `parse` reads back (to the thousandth of a µs): the
        lab's four names for a model of the lab's four terms (the form the lab's --cost-model
        and `calibrate` have always written), the six field names otherwise."""
        items = self.lab_dict() if self.lab_terms_only else self.as_dict()
        return ",".join(f"{name}={_fmt_number(value)}" for name, value in items.items())

    @classmethod
    def parse(cls, spec: str, base: Optional["StepCost"] = None, *,
              max_us: Optional[float] = None) -> "StepCost":
        """Build from `name=value,...` overrides or from the path of a JSON object file (the
        names of `from_mapping`); a term not named keeps its value in `base` (by default the
        class defaults). `max_us`: as in `from_mapping`."""
        if os.path.exists(spec):
            with open(spec, encoding="utf-8") as fh:
                data = json_loads(fh.read())
            if not isinstance(data, Mapping):
                raise ValueError(f"{spec}: the cost model file must hold a JSON object")
            return cls.from_mapping(data, base, max_us=max_us)
        values: dict[str, object] = {}
        for part in spec.split(","):
            part = part.strip()
            if not part:
                continue
            name, sep, text = part.partition("=")
            if not sep:
                raise ValueError(f"cost model override {part!r} is not name=value")
            try:
                number: object = int(text)
            except ValueError:
                try:
                    number = float(text)
                except ValueError:
                    raise ValueError(f"cost model value {text!r} for {name} is not a number") from None
            values[name.strip()] = number
        return cls.from_mapping(values, base, max_us=max_us)

    @classmethod
    def from_mapping(cls, values: Mapping[str, object],
                     base: Optional["StepCost"] = None, *,
                     max_us: Optional[float] = None) -> "StepCost":
        """`base` (by default the class defaults) with the terms of `values` replaced; a term
        is named by its field name or by its name in the lab (`LAB_NAMES`), not both. With
        `max_us`, a term given above it is refused (ValueError naming it as it was given)."""
        given: dict[str, object] = {}
        spelled: dict[str, str] = {}  # term -> the name it was given under
        unknown = []
        for name, value in values.items():
            term = LAB_NAMES.get(name, name)
            if term not in TERMS:
                unknown.append(name)
            elif term in given:
                raise ValueError(f"cost model term {term} is given twice, under its own name "
                                 f"and under the lab's")
            else:
                given[term] = value
                spelled[term] = name
        if unknown:
            raise ValueError(f"unknown cost model field(s): {', '.join(sorted(unknown))} "
                             f"(known: {', '.join(TERMS)}; the lab's names "
                             f"{', '.join(LAB_NAMES)})")
        # __post_init__ checks every value; its message names the term as it was given.
        try:
            cost = replace(base if base is not None else cls(), **given)  # type: ignore[arg-type]
        except ValueError as exc:
            message = str(exc)
            for term, name in spelled.items():
                if name != term and message.startswith(f"{term} "):
                    raise ValueError(name + message[len(term):]) from None
            raise
        if max_us is not None:
            for term, name in spelled.items():
                if getattr(cost, term) > max_us:
                    raise ValueError(f"{name} must be at most {max_us:g} µs, got "
                                     f"{given[term]!r}")
        return cost


#: The lab's default model: 50 µs a step, 2 µs a prefill token, 100 µs for a step's decode
#: batch and 20 µs a decode row (§5.3).
LAB_COST = StepCost(base_us=50, per_prefill_token_us=2, decode_base_us=100, per_decode_row_us=20)


def check_clock_cost(name: str, value: object) -> StepCost:
    """`value` as a clock charges it: a `StepCost` of the lab's four terms. A clock is told a
    plan's prefill tokens and decode rows only, so it could not charge a per-row or position
    term, and refuses a model that has one rather than leave it out."""
    if not isinstance(value, StepCost):
        raise TypeError(f"{name} must be a StepCost, got {type(value).__name__}")
    if not value.lab_terms_only:
        raise ValueError(f"{name} has a per-row or position term (per_prefill_row_us, "
                         f"per_prefill_position_us), which a clock cannot charge: it is told "
                         f"a plan's prefill tokens and decode rows only")
    return value


def _fmt_number(value: float) -> str:
    text = f"{value:.3f}".rstrip("0").rstrip(".")
    return text or "0"


# -- fitting --------------------------------------------------------------------------------------

_TIE = 1e-12  # a later subset of terms replaces the best one only when it fits better by more


def step_terms(prefill_tokens: Any, decode_rows: Any, prefill_rows: Any = None,
               prefill_positions: Any = None) -> Any:
    """The design matrix of steps given as arrays: one row per step, one column per term of
    `TERMS`, holding what multiplies that coefficient in `StepCost.predict_us` (1, prefill
    tokens, [decode rows > 0], decode rows, max(prefill rows − 1, 0), prefill positions / 1000).
    Without `prefill_rows` every step has one; without `prefill_positions`, none."""
    p = np.asarray(prefill_tokens, dtype=float)
    d = np.asarray(decode_rows, dtype=float)
    rows = np.ones(len(p)) if prefill_rows is None else np.asarray(prefill_rows, dtype=float)
    positions = (np.zeros(len(p)) if prefill_positions is None
                 else np.asarray(prefill_positions, dtype=float))
    return np.column_stack([np.ones(len(p)), p, (d > 0).astype(float), d,
                            np.maximum(rows - 1.0, 0.0), positions / 1000.0])


def fit_coefficients(x: Any, y: Any, prior: Any = None, prior_weight: float = 0.0) -> Any:
    """Least-squares coefficients b >= 0 of y ≈ x · b: x one row per step and one column per
    fitted term (columns of `step_terms`), y the steps' µs. `calibrate` fits the lab's four terms
    with it, the engine's online fitter all six.

    Each step's error counts relative to its duration (its row and µs are divided by
    max(µs, 1)): steps span a sub-millisecond decode step to a prefill hundreds of times longer,
    and on absolute errors a fit buys a percent on the long steps by getting the short ones,
    most of a run's steps, wrong by half or more.

    `prior` with `prior_weight` > 0 pulls b toward `prior`, each term by `prior_weight` × its
    column's sum of squares (a column all zero still gets a pull), so that a term the steps
    leave undetermined (a window without a multi-sequence step) keeps its prior value instead
    of an arbitrary one.

    Costs cannot be negative, and clipping a negative coefficient would not leave a
    least-squares fit; the answer is the best fit with every coefficient >= 0:

    * with a prior the best fit is unique. The terms that come out negative are held at 0 and
      the others solved again until none is negative (a step or two, usually); when that point
      is optimal (no term held at 0 would lower the error by growing) it is the answer,
      otherwise an active-set search finds it (`_active_set`: a handful of small solves, where
      solving every subset of six terms took 63; the online fitter runs on the engine thread);
    * without one a term no step varies leaves many least-squares fits, so every subset of the
      terms is solved with the others held at 0 (4 terms: 15 small solves) and the best fit
      without a negative coefficient wins, the first subset (counting in binary over the
      terms) of any that fit within 1e-12 alike: a term no step varies comes out 0. Zeros when
      nothing fits (every µs <= 0).
    """
    x = np.asarray(x, dtype=float)
    y = np.asarray(y, dtype=float)
    n = x.shape[1]
    inv = 1.0 / np.maximum(y, 1.0)
    xw = x * inv[:, None]
    yw = np.minimum(y, 1.0)  # y × inv, exactly
    if prior is None or not prior_weight > 0:
        def solve(cols: list[int]) -> Any:
            sol, *_ = np.linalg.lstsq(xw[:, cols], yw, rcond=None)  # the minimum-norm one
            return sol

        def error(coef: Any) -> float:
            return float(np.sum((xw @ coef - yw) ** 2))

        return _best_subset(n, solve, error)
    norms = (xw * xw).sum(axis=0)
    scale = np.maximum(norms, norms.max() * 1e-9 + 1e-300) * prior_weight
    # The normal equations of the fit and the pull: minimise b·G·b − 2 h·b.
    gram = xw.T @ xw + np.diag(scale)
    h = xw.T @ yw + scale * np.asarray(prior, dtype=float)
    coef = _hold_negatives_at_zero(gram, h)
    gradient = gram @ coef - h  # half the objective's; >= 0 where a term is held at 0
    tol = 1e-9 * (np.abs(gram).max() * np.abs(coef).max() + np.abs(h).max())
    if (gradient[coef == 0] >= -tol).all():
        return coef
    coef = _active_set(gram, h, tol)
    if coef is not None and np.isfinite(coef).all():
        return coef
    return _best_subset(n, lambda cols: np.linalg.solve(gram[np.ix_(cols, cols)], h[cols]),
                        lambda coef: float(coef @ gram @ coef - 2 * h @ coef))


def _hold_negatives_at_zero(gram: Any, h: Any) -> Any:
    """Solve gram · b = h over the terms not yet held at 0, hold at 0 those that come out
    negative, again, until none does."""
    free = np.ones(len(h), dtype=bool)
    coef = np.zeros(len(h))
    while free.any():
        coef = np.zeros(len(h))
        coef[free] = np.linalg.solve(gram[np.ix_(free, free)], h[free])
        negative = coef < 0
        if not negative.any():
            break
        free &= ~negative
        coef[negative] = 0.0
    return coef


def _active_set(gram: Any, h: Any, tol: float) -> Any:
    """The minimum of b·G·b − 2 h·b over b >= 0, G positive definite (Lawson and Hanson's
    active set, on the normal equations): terms are freed one at a time, the one whose
    growth lowers the objective most first, and a solve that would make a free term negative
    stops at the boundary and holds the first term to reach 0 there. The minimum is unique,
    so it is the one the search over every subset of terms finds, in a handful of solves
    instead of 2^n − 1. Every loop is bounded (each inner pass holds one more term at 0); None
    when the outer passes run out (rounding can make a freed term fall back at once, again
    and again), and the caller searches every subset instead."""
    n = len(h)
    free = np.zeros(n, dtype=bool)
    coef = np.zeros(n)
    for _ in range(4 * n):
        descent = h - gram @ coef  # minus half the gradient
        descent[free] = -np.inf
        j = int(np.argmax(descent))
        if not descent[j] > tol:
            return coef
        free[j] = True
        for _ in range(n):
            trial = np.zeros(n)
            trial[free] = np.linalg.solve(gram[np.ix_(free, free)], h[free])
            blocked = np.flatnonzero(free & (trial <= 0))
            if not blocked.size:
                coef = trial
                break
            # Move toward the trial until the first free term reaches 0; hold it there (a
            # term already at 0 stops the move at once).
            gap = coef[blocked] - trial[blocked]
            ratios = np.divide(coef[blocked], gap, out=np.zeros(len(blocked)), where=gap > 0)
            k = int(np.argmin(ratios))
            coef = coef + ratios[k] * (trial - coef)
            free[blocked[k]] = False
            free &= coef > 0
            coef[~free] = 0.0
            if not free.any():
                break
    return None


def _best_subset(n: int, solve: Any, error: Any) -> Any:
    """The best of the non-negative solutions over every subset of the `n` terms (the others
    held at 0): `solve(cols)` solves the subset, `error(coef)` scores a solution."""
    best: Optional[tuple[float, Any]] = None
    for mask in range(1, 1 << n):
        cols = [j for j in range(n) if mask >> j & 1]
        sol = solve(cols)
        if (sol < 0).any():
            continue
        coef = np.zeros(n)
        coef[cols] = sol
        err = error(coef)
        if best is None or err < best[0] - _TIE:
            best = (err, coef)
    return np.zeros(n) if best is None else best[1]
