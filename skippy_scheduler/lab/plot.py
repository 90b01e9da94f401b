"""Optional PNG plots of a suite or a trace replay (needs matplotlib:
`pip install '.[plot]'` in the checkout).

Every panel shows one metric with labelled axes and units, and a legend that names each line,
placed beside the panel so that it never hides a peak; panels side by side that draw the same
policies share their axes and one legend, beside the rightmost. Every figure's title names the
run: the suite's workload (requests, rate, seed) or the trace file, its time scale and any
`--limit` and `--tenants`, since the time axes are virtual time of that run.
Time series are binned: the bin width is chosen from the run's length (a round number of
seconds) and written in the axis label, so a 10⁶-iteration run plots as a few hundred points.
Queue depth is the largest number of queued requests in each bin (an integer: a mean would
show fractional requests); it is drawn as small multiples, one panel per run on shared axes,
because overlapping step lines hide each other. The suite plots the scheduler's waiting queue
(not yet admitted); a trace replay plots the requests that have arrived and are not yet in
any plan, which also counts admitted requests still waiting for prefill budget.

Each PNG records how many lines each of its panels holds in a PNG text chunk ("skippy-series",
e.g. "4,4" for two panels of four lines), so a reader can check the picture without a viewer.
"""
from __future__ import annotations

import math
import os
from typing import Any, Sequence

import numpy as np

INSTALL_HINT = "plotting needs matplotlib: pip install '.[plot]' (in the checkout)"
SERIES_KEY = "skippy-series"
_MAX_BINS = 200
_STYLES = ("-", "--", "-.", ":", (0, (5, 1, 1, 1, 1, 1)))


class PlotUnavailable(RuntimeError):
    pass


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend, or PlotUnavailable saying how to install it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise PlotUnavailable(INSTALL_HINT) from exc
    return plt


def _style(k: int) -> dict[str, Any]:
    return {"color": f"C{k % 10}", "linestyle": _STYLES[k % len(_STYLES)], "linewidth": 1.6}


def bin_width(t_end: float, max_bins: int = _MAX_BINS) -> float:
    """The smallest round width (1, 2 or 5 × 10^k seconds) giving at most `max_bins` bins."""
    if t_end <= 0:
        return 1.0
    raw = t_end / max_bins
    exp = math.floor(math.log10(raw))
    for mult in (1, 2, 5, 10):
        width = mult * 10.0 ** exp
        if width >= raw:
            return width
    return 10.0 ** (exp + 1)


def sparse_bin_width(times: Sequence[np.ndarray], t_end: float, max_bins: int,
                     empty_share: float = 0.25) -> float:
    """The smallest round width (at most `max_bins` bins) leaving no more than `empty_share`
    of each series' bins, from its first sample to its last, empty: a short replay whose
    arrivals come on a coarse grid (Mooncake's 3 s) would otherwise draw scattered dots."""
    width = bin_width(t_end, max_bins)
    while True:
        worst = 0.0
        for t in times:
            if len(t) == 0:
                continue
            b = _bins(t, width)
            b -= b.min()
            worst = max(worst, 1.0 - np.count_nonzero(np.bincount(b)) / (b.max() + 1))
        bins = math.ceil(t_end / width) if t_end > 0 else 1
        if worst <= empty_share or bins <= 1:
            return width
        width = bin_width(t_end, bins - 1)


def _fmt_width(width: float) -> str:
    return f"{width:g} s"


def _bins(t: np.ndarray, width: float) -> np.ndarray:
    return np.floor(np.asarray(t, dtype=np.float64) / width).astype(np.int64)


def binned_mean(t: np.ndarray, values: np.ndarray, width: float) -> tuple[np.ndarray, np.ndarray]:
    """(bin start times, mean per bin) over the bins that hold samples."""
    if len(t) == 0:
        return np.zeros(0), np.zeros(0)
    b = _bins(t, width)
    counts = np.bincount(b)
    sums = np.bincount(b, weights=np.asarray(values, dtype=np.float64))
    keep = counts > 0
    return np.flatnonzero(keep) * width, sums[keep] / counts[keep]


def binned_max(t: np.ndarray, values: np.ndarray, width: float) -> tuple[np.ndarray, np.ndarray]:
    """(bin start times, max per bin) for every bin from 0 to the last sample (0 when empty)."""
    if len(t) == 0:
        return np.zeros(0), np.zeros(0)
    b = _bins(t, width)
    out = np.zeros(int(b.max()) + 1)
    np.maximum.at(out, b, np.asarray(values, dtype=np.float64))
    return np.arange(len(out)) * width, out


def binned_ratio(t: np.ndarray, num: np.ndarray, den: np.ndarray,
                 width: float) -> tuple[np.ndarray, np.ndarray]:
    """(bin start times, Σnum/Σden per bin) for every bin from 0 to the last sample, NaN where
    Σden = 0: a line drawn through it breaks there instead of bridging the empty bins."""
    if len(t) == 0:
        return np.zeros(0), np.zeros(0)
    b = _bins(t, width)
    n = np.bincount(b, weights=np.asarray(num, dtype=np.float64))
    d = np.bincount(b, weights=np.asarray(den, dtype=np.float64))
    ratio = np.full(len(d), np.nan)
    np.divide(n, d, out=ratio, where=d > 0)
    return np.arange(len(d)) * width, ratio


def _legend(ax: Any, **kwargs: Any) -> None:
    """The legend beside the panel (right of it), where no line can be under it."""
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0,
              fontsize="small", **kwargs)


def _titled(text: str, run_title: str | None) -> str:
    return f"{text}\n{run_title}" if run_title else text


def _save(fig: Any, path: str, series: list[int]) -> str:
    # bbox_inches="tight" keeps the legends beside the panels inside the picture.
    fig.savefig(path, dpi=100, bbox_inches="tight",
                metadata={SERIES_KEY: ",".join(str(s) for s in series)})
    return path


def _ttft_panel(ax: Any, runs: Sequence[Any], labels: Sequence[str],
                styles: Sequence[int] | None = None, legend: bool = True) -> int:
    """One TTFT CDF per run; `styles[i]` is run i's style (default: its position)."""
    for k, (run, label) in enumerate(zip(runs, labels)):
        ttft = run.ttft_us[~np.isnan(run.ttft_us)] / 1e3
        ttft = np.sort(np.maximum(ttft, 1e-3))  # log axis: a zero TTFT cannot be drawn
        ax.plot(ttft, np.arange(1, len(ttft) + 1) / max(len(ttft), 1), label=label,
                **_style(k if styles is None else styles[k]))
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (ms of virtual time, log scale)")
    ax.set_ylabel("fraction of requests with TTFT ≤ x")
    ax.set_ylim(0, 1.02)
    ax.grid(True, which="major", alpha=0.3)
    if legend:
        _legend(ax, title="policy")
    return len(runs)


def _one_legend(axes: Any, ax: Any) -> None:
    """One legend for panels that draw the same policies alike (`axes`), beside `ax`: each
    label once, in the order the panels first draw it."""
    seen: dict[str, Any] = {}
    for panel in axes:
        for handle, label in zip(*panel.get_legend_handles_labels()):
            seen.setdefault(label, handle)
    _legend(ax, handles=list(seen.values()), labels=list(seen), title="policy")


def unscheduled_depth(arrival_s: np.ndarray,
                      first_scheduled_s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(event times, requests arrived and not yet in any plan just after each event)."""
    arrival_s = np.asarray(arrival_s, dtype=np.float64)
    started = np.asarray(first_scheduled_s, dtype=np.float64)
    started = started[~np.isnan(started)]
    times = np.concatenate([arrival_s, started])
    steps = np.concatenate([np.ones(len(arrival_s)), -np.ones(len(started))])
    order = np.lexsort((-steps, times))  # at equal times, arrivals first: the peak counts
    return times[order], np.cumsum(steps[order])


def _queue_multiples(plt: Any, runs: Sequence[Any], labels: Sequence[str], title: str, path: str,
                     what: str) -> str:
    """Queue depth as one panel per run. `what` picks the series: "waiting" (the scheduler's
    waiting queue after each iteration) or "unscheduled" (arrived, not yet in any plan)."""
    curves = []
    for run in runs:
        s = run.series
        if what == "waiting":
            curves.append((s["time_s"], s["waiting"]))
        else:
            curves.append(unscheduled_depth(s["arrival_s"], s["first_scheduled_s"]))
    t_end = max((float(t[-1]) for t, _ in curves if len(t)), default=1.0)
    width = bin_width(t_end)
    fig, axes = plt.subplots(len(runs), 1, figsize=(9, 1.2 + 1.4 * len(runs)), sharex=True,
                             sharey=True, squeeze=False)
    for k, (ax, (t, values), label) in enumerate(zip(axes[:, 0], curves, labels)):
        start, depth = binned_max(t, values, width)
        # One line per panel: colour tells the runs apart, a solid line reads best.
        ax.step(start, depth, where="post", label=label, color=f"C{k % 10}", linewidth=1.4)
        _legend(ax)
        ax.grid(True, alpha=0.3)
        ax.yaxis.get_major_locator().set_params(integer=True)
    # Shared y: headroom above the deepest queue of any panel, so no peak touches the frame.
    top = max((float(np.max(v)) for _, v in curves if len(v)), default=0.0)
    axes[0, 0].set_ylim(0, max(top, 1.0) * 1.12 + 0.5)
    axes[-1, 0].set_xlabel("virtual time (s)")
    if what == "waiting":
        ylabel = (f"requests waiting for admission\n(largest after an iteration in each "
                  f"{_fmt_width(width)} bin)")
    else:
        ylabel = (f"requests arrived and not yet scheduled\n(largest in each "
                  f"{_fmt_width(width)} bin)")
    fig.supylabel(ylabel, fontsize="medium")
    fig.suptitle(title)
    fig.tight_layout()
    try:
        return _save(fig, path, [1] * len(runs))
    finally:
        plt.close(fig)


# -- the workload suite --------------------------------------------------------------------------


def plot_suite(runs: Sequence[Any], out_dir: str, title: str | None = None) -> list[str]:
    """Write ttft_cdf.png, batch_occupancy.png and queue_depth.png; return their paths.

    One column per planning mode (its policies as lines) for TTFT and batching; queue depth as
    one panel per run. `title` names the run (the workload) in every figure."""
    plt = pyplot()
    os.makedirs(out_dir, exist_ok=True)
    modes = list(dict.fromkeys(run.mode for run in runs))
    by_mode = {m: [r for r in runs if r.mode == m] for m in modes}
    # A policy keeps its colour and dash in every panel, so one legend names them all.
    style_of = {p: k for k, p in enumerate(dict.fromkeys(run.policy for run in runs))}
    paths = []

    fig, axes = plt.subplots(1, len(modes), figsize=(6 * len(modes) + 1.5, 4.8), sharex=True,
                             sharey=True, squeeze=False)
    series = []
    for col, (ax, mode) in enumerate(zip(axes[0], modes)):
        runs_m = by_mode[mode]
        series.append(_ttft_panel(ax, runs_m, [r.policy for r in runs_m],
                                  [style_of[r.policy] for r in runs_m], legend=False))
        ax.set_title(f"TTFT, {mode} planning")
        if col:
            ax.set_ylabel("")
    _one_legend(axes[0], axes[0, -1])
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    paths.append(_save(fig, os.path.join(out_dir, "ttft_cdf.png"), series))
    plt.close(fig)

    t_end = max((float(r.series["time_s"][-1]) for r in runs if len(r.series["time_s"])),
                default=1.0)
    width = bin_width(t_end)
    # Each row shares its y axis (one metric per row), so the modes compare at a glance.
    fig, axes = plt.subplots(2, len(modes), figsize=(6 * len(modes) + 1.5, 7), sharex=True,
                             sharey="row", squeeze=False)
    series = []
    for col, mode in enumerate(modes):
        top, bottom = axes[0, col], axes[1, col]
        for run in by_mode[mode]:
            s = run.series
            t, batch = binned_mean(s["time_s"], s["batch"], width)
            top.plot(t, batch, label=run.policy, **_style(style_of[run.policy]))
            t, occ = binned_mean(s["time_s"], 100.0 * s["tokens"] / s["max_tokens"], width)
            bottom.plot(t, occ, label=run.policy, **_style(style_of[run.policy]))
        top.set_title(f"{mode} planning")
        if col == 0:
            top.set_ylabel(f"batch size (rows per iteration,\nmean per {_fmt_width(width)} "
                           f"bin)")
            bottom.set_ylabel(f"token occupancy (% of the iteration\nbudget, mean per "
                              f"{_fmt_width(width)} bin)")
        bottom.set_xlabel("virtual time (s)")
        for ax in (top, bottom):
            ax.grid(True, alpha=0.3)
        series += [len(by_mode[mode])]
    _one_legend(axes[0], axes[0, -1])
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    paths.append(_save(fig, os.path.join(out_dir, "batch_occupancy.png"),
                       series + series))
    plt.close(fig)

    paths.append(_queue_multiples(plt, runs, [f"{r.policy}, {r.mode} planning" for r in runs],
                                  _titled("Queue depth", title),
                                  os.path.join(out_dir, "queue_depth.png"),
                                  "waiting"))
    return paths


# -- a trace replay ------------------------------------------------------------------------------


def plot_trace(runs: Sequence[Any], out_dir: str, title: str | None = None) -> list[str]:
    """Write trace_ttft_cdf.png, trace_hit_rate.png and trace_queue_depth.png for the policies
    of one replay; return their paths. `title` names the trace and its time scale."""
    plt = pyplot()
    os.makedirs(out_dir, exist_ok=True)
    labels = [run.policy for run in runs]
    mode = runs[0].mode if runs else ""
    paths = []

    fig, ax = plt.subplots(figsize=(8, 5))
    _ttft_panel(ax, runs, labels)
    ax.set_title(_titled(f"TTFT per policy ({mode} planning)", title))
    fig.tight_layout()
    paths.append(_save(fig, os.path.join(out_dir, "trace_ttft_cdf.png"), [len(runs)]))
    plt.close(fig)

    t_end = max((float(r.series["admit_time_s"][-1]) for r in runs
                 if len(r.series["admit_time_s"])), default=1.0)
    width = sparse_bin_width([r.series["admit_time_s"] for r in runs], t_end, 120)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for k, (run, label) in enumerate(zip(runs, labels)):
        s = run.series
        # NaN in the bins where nobody was admitted: the line breaks there (a marker shows a
        # bin between two empty ones) instead of drawing a rate nobody had.
        t, rate = binned_ratio(s["admit_time_s"], s["admit_restore"], s["admit_prompt"],
                                    width)
        ax.plot(t, 100.0 * rate, label=label, marker=".", markersize=4, **_style(k))
    ax.set_xlabel("virtual time (s)")
    ax.set_ylabel(f"prefix cache hit rate (%)\n(restored / prompt tokens of the\nrequests "
                  f"admitted in each {_fmt_width(width)} bin)")
    ax.set_ylim(0, 103)  # a bin at 100 % stays inside the frame
    ax.grid(True, alpha=0.3)
    _legend(ax, title="policy")
    ax.set_title(_titled("Prefix cache hit rate over time", title))
    fig.tight_layout()
    paths.append(_save(fig, os.path.join(out_dir, "trace_hit_rate.png"), [len(runs)]))
    plt.close(fig)

    paths.append(_queue_multiples(plt, runs, labels,
                                  _titled(f"Queue depth ({mode} planning)", title),
                                  os.path.join(out_dir, "trace_queue_depth.png"), "unscheduled"))
    return paths
