"""Opt-in pytest-benchmark suites for the per-step overhead (not collected by `pytest`).

    cd /tmp && pytest /path/to/repo/bench -p no:randomly --benchmark-columns=median,min,max

Each benchmark runs one engine step (plan + fake host outputs + complete), some with a dirty
waiting queue to re-rank; the same workloads feed `skippy-scheduler bench`, which prints medians and p99s.
"""
import pytest

from skippy_scheduler import Scheduler, TwinScheduler
from skippy_scheduler import bench as B

IMPLS = [pytest.param(Scheduler, id="native"), pytest.param(TwinScheduler, id="twin")]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("n", [64, 256, 1024])
def test_steady_decode(benchmark, impl, n):
    if impl is TwinScheduler and n == 1024:
        pytest.skip("the twin takes tens of ms per step at N=1024; the report measures it")
    step = B.steady_decode(impl, n)
    benchmark.pedantic(step, rounds=2000 if impl is Scheduler else 50, warmup_rounds=20)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("prompt", [512, 8192])
def test_decode_context_length(benchmark, impl, prompt):
    step = B.steady_decode(impl, 256, prompt=prompt)
    benchmark.pedantic(step, rounds=2000 if impl is Scheduler else 50, warmup_rounds=20)


@pytest.mark.parametrize("n", [64, 256])
def test_mixed_decode_and_prefill_chunk(benchmark, n):
    step = B.mixed_decode_prefill(Scheduler, n, steps=2200)
    benchmark.pedantic(step, rounds=2000, warmup_rounds=20)


@pytest.mark.parametrize("n", [64, 256])
def test_arrival_and_finish(benchmark, n):
    arrive, finish = B.admission_churn(Scheduler, n)

    def cycle():
        finish()
        arrive()

    benchmark.pedantic(cycle, rounds=1000, warmup_rounds=10)


@pytest.mark.parametrize("w", [1000, 10000])
def test_admission_ranking(benchmark, w):
    """One engine step whose plan re-ranks a queue of W (made dirty before each round)."""
    engine, make_dirty = B.ranking(Scheduler, w)
    benchmark.pedantic(engine.step, setup=make_dirty, rounds=30 if w == 1000 else 10)
