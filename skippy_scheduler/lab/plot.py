"""Optional PNG plots of a suite (needs matplotlib: `pip install '.[plot]'`).

Each PNG records how many series each of its panels holds in a PNG text chunk
("skippy-series", e.g. "8" or "8,8"), so a reader can check the picture without a viewer.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    from .suite import SuiteRun

INSTALL_HINT = "plotting needs matplotlib: pip install '.[plot]' (or pip install matplotlib)"
SERIES_KEY = "skippy-series"
_BINS = 600


class PlotUnavailable(RuntimeError):
    pass


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise PlotUnavailable(INSTALL_HINT) from exc
    return plt


def _binned(t: np.ndarray, values: np.ndarray, bins: int = _BINS) -> tuple[np.ndarray, np.ndarray]:
    """Mean of `values` per time bin, so 10^6-iteration runs plot as a few hundred points."""
    if len(t) == 0:
        return t, values
    edges = np.linspace(t[0], t[-1] if t[-1] > t[0] else t[0] + 1e-9, bins + 1)
    which = np.clip(np.searchsorted(edges, t, side="right") - 1, 0, bins - 1)
    counts = np.bincount(which, minlength=bins)
    sums = np.bincount(which, weights=values.astype(np.float64), minlength=bins)
    keep = counts > 0
    centers = (edges[:-1] + edges[1:]) / 2
    return centers[keep], sums[keep] / counts[keep]


def _label(run: SuiteRun) -> str:
    return f"{run.policy}/{run.mode}"


def _recorded(run: SuiteRun) -> tuple[np.ndarray, dict[str, Any]]:
    """TTFTs and per-iteration series of a run; only runs with `record_series` have the series."""
    if run.ttft_us is None or run.series is None:
        raise ValueError(f"{_label(run)} has no per-iteration series: run the suite with "
                         "SuiteOptions(record_series=True) to plot it")
    return run.ttft_us, run.series


def _save(fig: Any, path: str, series: list[int]) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=100, metadata={SERIES_KEY: ",".join(str(s) for s in series)})
    return path


def plot_suite(runs: Sequence[SuiteRun], out_dir: str) -> list[str]:
    """Write ttft_cdf.png, batch_occupancy.png and queue_depth.png; return their paths."""
    plt = _pyplot()
    recorded = [(run, *_recorded(run)) for run in runs]
    os.makedirs(out_dir, exist_ok=True)
    paths = []

    fig, ax = plt.subplots(figsize=(8, 5))
    for run, ttft_us, _ in recorded:
        ttft = np.sort(ttft_us[~np.isnan(ttft_us)]) / 1e3
        ax.plot(ttft, np.arange(1, len(ttft) + 1) / max(len(ttft), 1), label=_label(run))
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (ms, virtual)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT CDF per policy")
    ax.legend(fontsize="small")
    paths.append(_save(fig, os.path.join(out_dir, "ttft_cdf.png"), [len(runs)]))
    plt.close(fig)

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    for run, _, s in recorded:
        t, batch = _binned(s["time_s"], s["batch"])
        top.plot(t, batch, label=_label(run))
        t, occ = _binned(s["time_s"], 100.0 * s["tokens"] / s["max_tokens"])
        bottom.plot(t, occ, label=_label(run))
    top.set_ylabel("batch size (rows)")
    bottom.set_ylabel("token occupancy (%)")
    bottom.set_xlabel("virtual time (s)")
    top.legend(fontsize="x-small", ncol=4, loc="lower center", bbox_to_anchor=(0.5, 1.0))
    paths.append(_save(fig, os.path.join(out_dir, "batch_occupancy.png"), [len(runs), len(runs)]))
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(9, 4))
    for run, _, s in recorded:
        t, waiting = _binned(s["time_s"], s["waiting"])
        ax.plot(t, waiting, label=_label(run))
    ax.set_xlabel("virtual time (s)")
    ax.set_ylabel("waiting requests")
    ax.set_title("Queue depth")
    ax.legend(fontsize="small")
    paths.append(_save(fig, os.path.join(out_dir, "queue_depth.png"), [len(runs)]))
    plt.close(fig)
    return paths
