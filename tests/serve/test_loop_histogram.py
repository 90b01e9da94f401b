"""serve/metrics.py `LoopHistogram`: the inter-token histogram kept without locks shows the same
series as prometheus_client's `Histogram` given the same observations."""
from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from skippy_scheduler.serve.metrics import _ITL_BUCKETS, LoopHistogram


def exposition(registry: CollectorRegistry) -> list[str]:
    # prometheus_client's own adds a creation time, which says nothing of the observations.
    return [ln for ln in generate_latest(registry).decode().splitlines() if "_created" not in ln]


def test_the_same_series_as_prometheus_clients_histogram():
    theirs_reg, ours_reg = CollectorRegistry(), CollectorRegistry()
    theirs = Histogram("gap_seconds", "Gaps.", buckets=_ITL_BUCKETS, registry=theirs_reg)
    ours = LoopHistogram("gap_seconds", "Gaps.", _ITL_BUCKETS)
    ours_reg.register(ours)
    assert exposition(ours_reg) == exposition(theirs_reg)  # empty
    rng = random.Random(3)
    # Every bound exactly (a value on a bound goes into that bound's bucket), 0, past the last
    # bound, and values between.
    values = [*_ITL_BUCKETS, 0.0, 11.0, 1e9] + [rng.random() * 2 for _ in range(500)]
    for v in values:
        theirs.observe(v)
        ours.observe(v)
    assert exposition(ours_reg) == exposition(theirs_reg)
    assert sum(ours.counts) == len(values) and ours.sum == pytest.approx(sum(values))
    assert ours.counts[0] == 2  # 0.0 and the first bound itself


def test_bounds_must_increase():
    for bad in ((), (0.1, 0.1), (0.2, 0.1)):
        with pytest.raises(ValueError, match="increasing"):
            LoopHistogram("x", "x", bad)
