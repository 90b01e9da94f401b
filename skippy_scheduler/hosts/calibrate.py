"""Fit the lab's linear iteration cost model to a real runtime.

The lab prices an iteration as
    overhead + prefill_token × (Prefill/Recompute tokens) + [decode rows > 0] × (decode_batch +
    decode_sequence × decode rows)
(behaviour.md §5.3). `calibrate_host` times a handful of plan shapes on a host (prefill-only of
several lengths, decode-only of several widths, and mixed) and solves for the four coefficients by
least squares over the per-shape medians, so that the lab can replay scenarios with the costs of
this machine and model. Timing covers what one plan costs the host: staging the batch, the
single `llama_decode` and greedy sampling.
"""
from __future__ import annotations

import re
import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from skippy_scheduler.lab.model import RuntimeCostModel

if TYPE_CHECKING:  # pragma: no cover
    from .llama import LlamaHost

# The lab's cost model is the one fitted here; its str() is the --cost-model form.
CostModel = RuntimeCostModel

COST_MODEL_RE = re.compile(
    r"^iteration_overhead_us=[0-9.]+,prefill_token_us=[0-9.]+,"
    r"decode_batch_us=[0-9.]+,decode_sequence_us=[0-9.]+$"
)


@dataclass
class Calibration:
    model: CostModel
    samples: list[tuple[int, int, float]]  # (prefill tokens, decode rows, median µs)
    residual_us: float  # root-mean-square error of the fit over the shapes

    def to_json(self) -> dict[str, Any]:
        return {
            "cost_model": str(self.model),
            "rms_residual_us": self.residual_us,
            "shapes": [
                {"prefill_tokens": p, "decode_rows": d, "median_us": us} for p, d, us in self.samples
            ],
        }


def default_shapes(n_seq_max: int, n_batch: int) -> list[tuple[list[int], int]]:
    """(prefill row lengths, decode rows) pairs that separate the four coefficients."""
    widths = [d for d in (1, 2, 4, 8) if d <= n_seq_max]
    shapes: list[tuple[list[int], int]] = []
    for p in (16, 64, 128, 256):
        if p <= n_batch:
            shapes.append(([p], 0))
    for d in widths:
        shapes.append(([], d))
    for d in widths[:2]:
        if 64 + d <= n_batch and d + 1 <= n_seq_max:
            shapes.append(([64], d))
    return shapes


def calibrate_host(
    host: LlamaHost, *, repeats: int = 7, context_tokens: int = 32, seed: int = 0, clock: str = "wall"
) -> Calibration:
    """Time `default_shapes` on `host` (which must have no active sequences) and fit the model.

    `clock="wall"` measures elapsed time (what a client sees); `clock="cpu"` measures the
    process's CPU time, which a busy machine does not inflate (with one llama.cpp thread it is
    the compute time; with more it also counts their spinning).
    """
    if clock not in ("wall", "cpu"):
        raise ValueError(f"clock must be 'wall' or 'cpu', got {clock!r}")
    timer = time.perf_counter if clock == "wall" else time.process_time
    if host.active_sequences:
        raise ValueError("calibrate on an idle host: it has active sequences")
    rng = np.random.default_rng(seed)
    vocab = host.n_vocab

    def toks(n: int) -> list[int]:
        tokens: list[int] = rng.integers(3, vocab, size=n).tolist()
        return tokens

    samples: list[tuple[int, int, float]] = []
    shapes = default_shapes(host.n_seq_max, host.n_batch)
    for prefill_rows, decode_rows in shapes:
        times: list[float] = []
        for rep in range(repeats + 1):  # the first run warms up graph allocation
            dec_ids = [f"calib-d{i}" for i in range(decode_rows)]
            pre_ids = [f"calib-p{i}" for i in range(len(prefill_rows))]
            # Decode rows need a context: prefill it outside the timed call.
            if dec_ids:
                host.run_rows([(s, toks(context_tokens), 0, True) for s in dec_ids])
            rows = [(s, toks(1), context_tokens, True) for s in dec_ids]
            rows += [(s, toks(n), 0, True) for s, n in zip(pre_ids, prefill_rows)]
            t = timer()
            host.run_rows(rows)
            elapsed = timer() - t
            host.release_all()
            if rep:
                times.append(elapsed * 1e6)
        samples.append((sum(prefill_rows), decode_rows, statistics.median(times)))

    model, residual = fit_cost_model(samples)
    return Calibration(model, samples, residual)


def fit_cost_model(samples: list[tuple[int, int, float]]) -> tuple[CostModel, float]:
    """Non-negative least squares of the four coefficients over (prefill, decode rows, µs).

    Costs cannot be negative, so when the unconstrained fit has a negative coefficient every
    subset of coefficients is tried (4 unknowns: 16 small solves) and the best non-negative
    fit wins; clipping the unconstrained solution would not be a least-squares fit.
    """
    if not samples:
        raise ValueError("no samples to fit")
    a = np.array([[1.0, p, 1.0 if d else 0.0, d] for p, d, _ in samples])
    y = np.array([us for _, _, us in samples], dtype=float)
    best: tuple[float, np.ndarray] | None = None
    for mask in range(1, 16):
        cols = [j for j in range(4) if mask >> j & 1]
        sol, *_ = np.linalg.lstsq(a[:, cols], y, rcond=None)
        if (sol < 0).any():
            continue
        coef = np.zeros(4)
        coef[cols] = sol
        err = float(np.sum((a @ coef - y) ** 2))
        if best is None or err < best[0] - 1e-9:
            best = (err, coef)
    if best is None:  # only when every sample is <= 0
        best = (float(np.sum(y**2)), np.zeros(4))
    coef = np.round(best[1], 3)
    residual = float(np.sqrt(np.mean((a @ coef - y) ** 2)))
    return CostModel(*(float(c) for c in coef)), residual
