"""Timing a benchmark step: every sample kept, medians and 99th percentiles reported.

`measure()` times many calls of a step closure with `perf_counter_ns`; `measure_pairs()`
alternates two kinds of step so that load on a shared machine hits both alike (their ratio is
then measured in one run); `measure_ranking()` times the plan of a dirty and of a clean queue.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from .workloads import SchedulerClass, ranking


@dataclass
class Result:
    """Samples of one workload on one implementation (nanoseconds per step)."""

    workload: str
    impl: str
    size: int            # N active sequences, or W waiting requests for the ranking rows
    unit: str            # what `per` divides by: "row" or "waiting"
    per: int             # rows per step (or waiting requests per ranking)
    median_ns: float
    p99_ns: float
    steps: int
    note: str = ""

    @property
    def median_us(self) -> float:
        return self.median_ns / 1e3

    @property
    def p99_us(self) -> float:
        return self.p99_ns / 1e3

    @property
    def per_unit_ns(self) -> float:
        return self.median_ns / self.per if self.per else float("nan")


def summary(samples: list[int]) -> tuple[float, float]:
    a = np.sort(np.asarray(samples, dtype=np.int64))
    return float(np.median(a)), float(a[min(len(a) - 1, (len(a) * 99) // 100)])


def measure(step: Callable[[], object], steps: int, warmup: int = 20, budget_s: float = 5.0) -> list[int]:
    """Per-call wall times (ns) of `step`; stops early once `budget_s` is spent (at least 5 calls)."""
    for _ in range(warmup):
        step()
    out: list[int] = []
    clock = time.perf_counter_ns
    deadline = clock() + int(budget_s * 1e9)
    for i in range(steps):
        t0 = clock()
        step()
        t1 = clock()
        out.append(t1 - t0)
        if t1 > deadline and i >= 4:
            break
    return out


def measure_pairs(first: Callable[[], object], second: Callable[[], object], steps: int,
                  budget_s: float) -> tuple[list[int], list[int]]:
    """Alternates two step kinds, timing each into its own list."""
    a: list[int] = []
    b: list[int] = []
    clock = time.perf_counter_ns
    deadline = clock() + int(budget_s * 1e9)
    for i in range(steps):
        t0 = clock()
        second()
        t1 = clock()
        first()
        t2 = clock()
        b.append(t1 - t0)
        a.append(t2 - t1)
        if t2 > deadline and i >= 4:
            break
    return a, b


def paired_medians_us(first: Callable[[], object], second: Callable[[], object], steps: int,
                      warmup: int = 50, budget_s: float = 60.0) -> tuple[float, float]:
    """Median µs per call of `first` and of `second`, alternated (`measure_pairs`) after
    `warmup` calls of each: a ratio of the two is measured in one run."""
    for _ in range(warmup):
        first()
        second()
    a, b = measure_pairs(first, second, steps, budget_s=budget_s)
    return float(np.median(a)) / 1e3, float(np.median(b)) / 1e3


def measure_ranking(cls: SchedulerClass, w: int, reps: int,
                    budget_s: float) -> tuple[list[int], list[int]]:
    """(plan time with a dirty queue, plan time with a clean queue) samples."""
    engine, make_dirty = ranking(cls, w)
    dirty: list[int] = []
    clean: list[int] = []
    clock = time.perf_counter_ns
    deadline = clock() + int(budget_s * 1e9)
    for i in range(reps):
        make_dirty()
        engine.step()
        dirty.append(engine.last_plan_ns)
        engine.step()
        clean.append(engine.last_plan_ns)
        if clock() > deadline and i >= 2:
            break
    return dirty, clean
