"""Figures and how they are written: nearest-rank percentiles, medians over rounds, JSON lines,
markdown tables, the table of a paired timing."""
from __future__ import annotations

import argparse
import json
import math
import statistics
from typing import Any, Callable, Iterable, Optional, Sequence


def percentile(values: Sequence[float], p: float) -> float:
    """The nearest-rank `p`th percentile of `values` (NaN when there are none)."""
    if not values:
        return float("nan")
    v = sorted(values)
    return v[min(max(math.ceil(len(v) * p / 100) - 1, 0), len(v) - 1)]


def median(results: Iterable[dict[str, Any]], key: str) -> float:
    """The median of `key` over the results that have a value for it (NaN: none has)."""
    values = [r[key] for r in results if r.get(key) is not None]
    return statistics.median(values) if values else float("nan")


def append_line(doc: Any, path: Optional[str]) -> str:
    """`doc` as one JSON line, appended to `path` when one is given; returns the line."""
    line = json.dumps(doc)
    if path:
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(line + "\n")
    return line


def emit(result: dict, path: Optional[str]) -> None:
    """Print `result` as one JSON line, and append the line to `path` when one is given."""
    print(append_line(result, path), flush=True)


def markdown_table(header: Sequence[str], align: str, rows: Iterable[Sequence[Any]]) -> list[str]:
    """A markdown table's lines: `align` has one letter a column, `l` (`---`) or `r` (`---:`);
    the cells are written as given."""
    rule = "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|"
    return (["| " + " | ".join(header) + " |", rule]
            + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])


def paired_medians_table(argv: Optional[list[str]], description: str, columns: Sequence[str],
                         sides: Callable[[int], tuple[Callable[[], object],
                                                      Callable[[], object]]]) -> int:
    """The command line `[--sizes N,...] [--steps S]` of a paired timing: for each N, the two
    steps `sides(N)` gives timed in alternating samples (`skippy_scheduler.bench`'s
    `paired_medians_us`), printed as N, each median (µs) and the second over the first,
    tab-separated under `columns`."""
    from skippy_scheduler.bench import paired_medians_us

    ap = argparse.ArgumentParser(description=description, allow_abbrev=False)
    ap.add_argument("--sizes", default="256,1024")
    ap.add_argument("--steps", type=int, default=4000)
    args = ap.parse_args(argv)
    print("\t".join(["N", *columns]))
    for n in (int(x) for x in args.sizes.split(",")):
        ma, mb = paired_medians_us(*sides(n), args.steps)
        print(f"{n}\t{ma:.2f}\t{mb:.2f}\t{mb / ma:.3f}")
    return 0
