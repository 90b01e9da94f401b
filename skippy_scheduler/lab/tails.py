"""The tails a lab run reports beside its percentiles (docs/lab.md, "Tails"): the largest
inter-token gap and the stalls, gaps above the inter-token target, per request and per group
of co-tenants (the trace's tenants, or the suite's priority classes).

`tail_figures` reads a run's `TokenTimeline`, whose gaps are stored request by request in
submission order (each request's `generated - 1` gaps in a row), so one cumulative count gives
every request's stalls without a loop over requests.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np

from .driver import nearest_rank

TAILS_NOTE = ("ms of virtual time; a stall is an inter-token gap above the run's "
              "--itl-target-ms; stalls_by_group per tenant (--trace) or priority class (--suite)")
TAIL_COLUMNS = ("policy", "mode", "p50_itl_ms", "p99_itl_ms", "max_itl_ms", "p99_max_itl_ms",
                "stalls", "stalled_requests_pct", "p99_stalls_per_request",
                "max_stalls_per_request", "p50_ttft_ms", "p99_ttft_ms", "goodput_fraction",
                "stalls_by_group")


def stalls_per_request(timeline: Any, target_us: float) -> np.ndarray:
    """Gaps above `target_us` of each request, by submission index."""
    counts = np.maximum(np.asarray(timeline.generated, dtype=np.int64) - 1, 0)
    if int(counts.sum()) != len(timeline.gaps_us):
        raise RuntimeError("the timeline's gaps do not match its token counts")
    above = np.r_[0, np.cumsum(np.asarray(timeline.gaps_us) > target_us)]
    ends = np.cumsum(counts)
    per: np.ndarray = above[ends] - above[ends - counts]
    return per


def tail_figures(timeline: Any, target_ms: float, groups: Optional[Sequence[Any]] = None,
                 group_name: str = "group") -> dict[str, Any]:
    """Max gap, stall counts per request and per co-tenant group (`groups[i]` = request i's)."""
    per = stalls_per_request(timeline, target_ms * 1e3)
    gaps = np.asarray(timeline.gaps_us)
    figures: dict[str, Any] = {
        "itl_target_ms": target_ms,
        # None (JSON null, `-` in the table) when no request had a gap: undefined, not 0
        "max_itl_ms": float(gaps.max()) / 1e3 if len(gaps) else None,
        "stalls": int(per.sum()),
        "stalled_requests_pct": (100.0 * float(np.count_nonzero(per)) / len(per)
                                 if len(per) else 0.0),
        "p99_stalls_per_request": nearest_rank(per, 99) if len(per) else 0.0,
        "max_stalls_per_request": int(per.max()) if len(per) else 0,
        "stalls_by_group": {},
        "max_itl_ms_by_group": {},
        "group_kind": group_name,
    }
    if groups is not None and len(per):
        labels = np.asarray([str(g) for g in groups])
        max_gap = np.asarray(timeline.max_gap_us)
        has_gap = np.asarray(timeline.generated) > 1
        for label in sorted(set(labels.tolist())):
            mask = labels == label
            figures["stalls_by_group"][label] = int(per[mask].sum())
            figures["max_itl_ms_by_group"][label] = (float(max_gap[mask].max()) / 1e3
                                                     if has_gap[mask].any() else None)
    return figures


def format_tails(runs: Sequence[Any]) -> str:
    """The tails table of runs that carry `tails` (tab-separated, one line per run)."""
    lines = ["\t".join(TAIL_COLUMNS)]
    for run in runs:
        f = {**run.figures, **run.tails}
        cells = []
        for column in TAIL_COLUMNS:
            value = f[column]
            if column == "stalls_by_group":
                cells.append(",".join(f"{k}:{v}" for k, v in value.items()) or "-")
            elif value is None:  # undefined (no request had a gap): not 0
                cells.append("-")
            elif isinstance(value, str):
                cells.append(value)
            elif isinstance(value, (int, np.integer)):
                cells.append(str(int(value)))
            elif column == "goodput_fraction":  # a miss or two must show: not 1.00
                cells.append(f"{value:.4f}")
            else:
                cells.append(f"{value:.3f}" if column.endswith("_ms") else f"{value:.2f}")
        lines.append("\t".join(cells))
    return "\n".join(lines) + "\n"
