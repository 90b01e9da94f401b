"""The slack rule's cost model, kept fitted online from observed step durations (§2.13).

`StepCostFitter` keeps the last `window` steps (prefill tokens, decode rows, prefill rows, the
prefill tokens' summed positions, µs) and fits the six coefficients of `StepCost` by least
squares on the *relative* error (each step weighted by 1 / its duration), pulled gently toward
the previous fit (so a window that never varies one term, e.g. only decode-only steps of one
size or no step with two prefill sequences, keeps that term's last value instead of making one
up), then drops the steps whose relative residual is more than `clip` × the median relative
residual (a step stalled by something else on the machine) and fits again, a few rounds;
coefficients stay >= 0. Beside the window it keeps the last `window` steps that had prefill
tokens and fits them too, those older than the window included: a stretch of decode-only steps
would otherwise push the prefill steps out of it, and a window left with one or two of them
cannot tell the prefill terms apart (per token, per row, per position: any split explains two
steps). In a trace replay one such refit, its window holding two prefill steps among 62
decode-only ones, put the per-token cost at 0 and the position cost at several times its value, and
the three chunks after it, predicted at 74-156 ms, ran 272-343 ms, each past every stream's
gap budget. Each solve is `cost_model.fit_coefficients`, the routine `calibrate`
fits the lab's four terms with. A window the current model already explains (median relative
residual within 1 %) keeps it without solving anything. `fit` runs this arithmetic natively
(`_fit.fit_window`: tens of µs where numpy took about a millisecond of the engine thread
holding the GIL, every 8 steps); `_fit_numpy` is the same in numpy, the reference it is
tested against and what decides the rare window it leaves to numpy (a solve that searches
every subset of the terms).

Why relative: a window is mostly short decode steps, fitted to a millisecond, and a few long
prefill steps whose errors are tens of milliseconds though just as small a share of their
duration. On absolute residuals the long steps were the "outliers": trimmed, they left the
per-token cost to a few short chunks where the fixed cost dominates, and in a trace replay one
refit put it at a tenth of its value (steps predicted at 28-32 ms ran 167-206 ms, and every
stream stalled past its target for seven steps). The slack rule needs each step predicted to a
share of itself, whatever its length, which is what the relative error weighs.

`SlackFeed` is the engine observer that feeds it: after each step ran it sets the scheduler's
clock (before the completion stamps last-token times and before the next plan reads them) and
records the step; every `refit_every` steps it refits and hands the model to the scheduler.
The engine adds it only when the scheduler runs the slack rule, so the reference rule's path
is unchanged.
"""
from __future__ import annotations

import math
from collections import deque
from typing import TYPE_CHECKING, Callable, Optional

import numpy as np

from .._fit import fit_window
from ..cost_model import StepCost, fit_coefficients, step_terms
from ..types import IterationTelemetry
from .observers import BaseObserver

if TYPE_CHECKING:  # pragma: no cover
    from .contract import SlackRuleScheduler
    from .requests import _InFlight

_PRIOR_WEIGHT = 1e-6  # of the window's own scale: only decides directions the data leaves open
_CLIP_ROUNDS = 4  # refits, each without the steps far off the previous one
_RESIDUAL_FLOOR = 0.01  # relative residuals below this are kept whatever the spread


class StepCostFitter:
    """Windowed, outlier-clipped least squares of `StepCost` (module docstring)."""

    def __init__(self, prior: StepCost, window: int = 64, clip: float = 4.0) -> None:
        if window < 4:
            raise ValueError(f"window must be at least 4 steps, got {window}")
        if not clip > 0:
            raise ValueError(f"clip must be > 0, got {clip}")
        self.cost = prior
        # (prefill tokens, decode rows, prefill rows, prefill positions, µs)
        self._steps: deque[tuple[int, int, int, int, float]] = deque(maxlen=window)
        # The last `window` steps with prefill tokens, each with its number in `_added`, so
        # that a fit takes those older than the window from here and the rest from `_steps`.
        self._prefill: deque[tuple[int, tuple[int, int, int, int, float]]] = \
            deque(maxlen=window)
        self._added = 0
        self._clip = clip

    def __len__(self) -> int:
        """Steps in the window (the prefill steps kept from before it not counted)."""
        return len(self._steps)

    def add(self, prefill_tokens: int, decode_rows: int, duration_us: float,
            prefill_rows: int = 1, prefill_positions: int = 0) -> None:
        """Record one step (`prefill_rows`: its rows with prefill or recompute tokens;
        `prefill_positions`: those tokens' positions summed, `IterationPlan.prefill_positions`);
        an empty or non-positive one is ignored."""
        # NOTE: math.isfinite, not numpy's: this runs every step (a scalar ufunc costs more).
        if (prefill_tokens or decode_rows) and duration_us > 0 and math.isfinite(duration_us):
            step = (prefill_tokens, decode_rows, prefill_rows, prefill_positions,
                    float(duration_us))
            self._steps.append(step)
            self._added += 1
            if prefill_tokens:
                self._prefill.append((self._added, step))

    def fit(self) -> StepCost:
        """Refit from the window (the previous fit when it holds fewer than 4 steps)."""
        if len(self._steps) < 4:
            return self.cost
        first = self._added - len(self._steps)  # the numbers of the window's steps are above
        older = [step for number, step in self._prefill if number <= first]
        data = np.array(older + list(self._steps), dtype=float)
        prior = np.array(self.cost.terms(), dtype=float)
        fitted = fit_window(data, prior, self._clip, _RESIDUAL_FLOOR, _PRIOR_WEIGHT,
                            _CLIP_ROUNDS)
        if fitted == "kept":
            return self.cost
        if fitted is not None:
            self.cost = StepCost(*(max(b, 0.0) for b in fitted))
            return self.cost
        x = step_terms(data[:, 0], data[:, 1], data[:, 2], data[:, 3])
        return self._fit_numpy(x, data[:, 4], prior)

    def _fit_numpy(self, x: "np.ndarray", y: "np.ndarray", prior: "np.ndarray") -> StepCost:
        """`fit`'s arithmetic in numpy: the reference the native `fit_window` is tested
        against, and what decides where `fit_window` leaves it (a solve that searches every
        subset of the terms)."""
        inv = 1.0 / y  # relative error: each step weighs by its own length (module docstring)
        if float(np.median(np.abs(x @ prior - y) * inv)) <= _RESIDUAL_FLOOR:
            return self.cost  # the model still explains the window: nothing to refit
        keep = np.ones(len(y), dtype=bool)
        beta = fit_coefficients(x, y, prior, _PRIOR_WEIGHT)
        for _ in range(_CLIP_ROUNDS):
            residual = np.abs(x @ beta - y) * inv
            spread = float(np.median(residual[keep]))
            trimmed = residual <= max(self._clip * spread, _RESIDUAL_FLOOR)
            if trimmed.sum() < 4 or np.array_equal(trimmed, keep):
                break
            keep = trimmed
            beta = fit_coefficients(x[keep], y[keep], prior, _PRIOR_WEIGHT)
        self.cost = StepCost(*(float(b) for b in np.maximum(beta, 0.0)))
        return self.cost


class SlackFeed(BaseObserver):
    """Engine observer: the scheduler's clock and cost model under the slack rule (the
    scheduler's `SlackRuleScheduler` capability, engine/contract.py)."""

    def __init__(self, scheduler: "SlackRuleScheduler", now_us: Callable[[], float],
                 fitter: Optional[StepCostFitter] = None, refit_every: int = 8) -> None:
        self._scheduler = scheduler
        self._now_us = now_us
        self.fitter = fitter if fitter is not None else StepCostFitter(scheduler.step_cost)
        self._refit_every = max(int(refit_every), 1)
        self._since_fit = 0

    @property
    def scheduler(self) -> "SlackRuleScheduler":
        return self._scheduler

    def tick(self) -> None:
        """The scheduler's clock to now: after each step, and before each submit (a request's
        age in the prefill order counts from the clock at its submit, §2.13)."""
        self._scheduler.set_clock(self._now_us() / 1e6)

    def executed(self, flight: "_InFlight", duration_us: float) -> None:
        self.tick()
        decode = flight.decode  # rows that are not decode are prefill or recompute rows
        plan = flight.plan
        prefill_rows = len(plan) - decode
        self.fitter.add(flight.token_count - decode, decode, duration_us, prefill_rows,
                        plan.prefill_positions if prefill_rows else 0)

    def completed(self, flight: "_InFlight", duration_us: float,
                  telemetry: IterationTelemetry) -> None:
        self._since_fit += 1
        if self._since_fit >= self._refit_every:
            self._since_fit = 0
            self._scheduler.set_step_cost(self.fitter.fit())
