"""The slack rule's online cost model (engine/cost_fit.py): the fitter recovers the
coefficients of the steps it sees and ignores outliers; an engine whose scheduler runs the
slack rule feeds it the clock and the fitted model, one that runs the reference rule does not
add the observer."""
import numpy as np
import pytest

from skippy_scheduler import (PlanningRule, Request, Scheduler, SchedulerConfig, StepCost,
                              TwinScheduler)
from skippy_scheduler import cost_model
from skippy_scheduler._fit import fit_window
from skippy_scheduler.cost_model import LAB_COST, step_terms
from skippy_scheduler.engine import cost_fit
from skippy_scheduler.engine import CostModelHost, Engine, VirtualClock
from skippy_scheduler.engine.cost_fit import SlackFeed, StepCostFitter

TRUE = StepCost(base_us=500.0, per_prefill_token_us=3.0, decode_base_us=200.0,
                per_decode_row_us=40.0)


def _steps(n, rng):
    for i in range(n):
        prefill = int(rng.choice([0, 0, 16, 64, 200]))
        rows = 0 if i % 3 == 0 and prefill else int(rng.integers(1, 20))
        yield prefill, rows, TRUE.predict_us(prefill, rows)


def test_fitter_recovers_the_model_and_clips_outliers():
    rng = np.random.default_rng(3)
    fitter = StepCostFitter(StepCost(), window=64)
    for i, (p, d, us) in enumerate(_steps(64, rng)):
        fitter.add(p, d, us * (25.0 if i % 16 == 5 else 1.0))  # 4 stalls of 25x
    cost = fitter.fit()
    for name in ("base_us", "per_prefill_token_us", "decode_base_us", "per_decode_row_us"):
        assert getattr(cost, name) == pytest.approx(getattr(TRUE, name), rel=0.02, abs=2.0), name


def test_fitter_keeps_what_the_window_cannot_tell():
    prior = StepCost(base_us=1000.0, per_prefill_token_us=7.0, decode_base_us=0.0,
                     per_decode_row_us=50.0)
    fitter = StepCostFitter(prior, window=16)
    for _ in range(16):  # decode-only steps of one size: prefill cost is not observable
        fitter.add(0, 8, prior.predict_us(0, 8))
    cost = fitter.fit()
    assert cost.per_prefill_token_us == pytest.approx(7.0, rel=1e-3)
    assert cost.predict_us(0, 8) == pytest.approx(prior.predict_us(0, 8), rel=1e-3)


# A window from the per-step log of a trace replay on the bench model (ms): 56 decode-only
# steps (rows, ms), then a burst's 8 prefill steps (prefill tokens, decode rows, prefill rows,
# ms), and the model fitted before them.
_DECODE_STEPS = [(7, 18.2), (7, 19.1), (7, 18.8), (7, 18.5), (7, 19.3), (7, 17.7), (7, 18.1),
                 (7, 18.2), (7, 18.7), (7, 20.7), (7, 18.1), (7, 17.9), (7, 18.2), (7, 23.1),
                 (7, 19.4), (7, 17.9), (7, 19.8), (7, 18.4), (7, 17.8), (7, 20.5), (7, 18.0),
                 (7, 18.4), (7, 17.9), (7, 18.9), (7, 18.1), (7, 19.1), (7, 20.7), (7, 20.0),
                 (6, 23.9), (6, 20.0), (6, 19.0), (6, 17.8), (6, 17.7), (6, 19.0), (6, 19.2),
                 (6, 18.5), (6, 19.8), (6, 23.3), (6, 20.0), (6, 20.4), (6, 19.9), (5, 24.9),
                 (4, 28.5), (4, 19.4), (4, 18.5), (4, 18.0), (4, 17.7), (4, 18.3), (4, 17.4),
                 (3, 17.9), (3, 14.7), (3, 15.4), (3, 15.2), (2, 15.3), (1, 9.2), (1, 7.0)]
_PREFILL_STEPS = [(256, 0, 1, 175.6), (512, 0, 5, 308.4), (202, 4, 2, 134.1),
                  (202, 4, 2, 138.7), (201, 5, 2, 137.1), (215, 6, 1, 155.6),
                  (200, 6, 2, 152.4), (214, 7, 1, 155.9)]
_BEFORE = StepCost(base_us=13302.9, per_prefill_token_us=494.9, decode_base_us=1939.0,
                   per_decode_row_us=540.4, per_prefill_row_us=7317.2)


def test_fitter_keeps_the_long_steps_of_a_window_of_short_ones():
    """Short decode steps fitted to a millisecond and a few long prefill steps off by a tenth
    of their length are fitted alike, on relative error: the fit still predicts every prefill
    step of the window. On absolute residuals the long steps were the outliers, and this
    window's refit put the per-token cost at 45 µs and the per-row toll at 110 ms, so that
    the steps after it, predicted at 28-32 ms, ran 167-206 ms."""
    fitter = StepCostFitter(_BEFORE, window=64)
    for rows, ms in _DECODE_STEPS:
        fitter.add(0, rows, ms * 1e3)
    for tokens, rows, prefill_rows, ms in _PREFILL_STEPS:
        fitter.add(tokens, rows, ms * 1e3, prefill_rows)
    cost = fitter.fit()
    assert cost.per_prefill_token_us > 300
    for tokens, rows, prefill_rows, ms in _PREFILL_STEPS:
        assert cost.predict_us(tokens, rows, prefill_rows) == pytest.approx(ms * 1e3, rel=0.2)
    assert cost.predict_us(214, 7) == pytest.approx(155.9e3, rel=0.15)  # the next chunk's step


ROWS = StepCost(base_us=500.0, per_prefill_token_us=3.0, decode_base_us=200.0,
                per_decode_row_us=40.0, per_prefill_row_us=12000.0)


def test_fitter_recovers_the_per_prefill_row_cost():
    """Steps of 1-4 prefill sequences: the fifth coefficient (each prefill row after the
    first, llama.cpp's pass per sequence, §2.13) comes out of the fit with the other four."""
    rng = np.random.default_rng(5)
    prior = StepCost(base_us=800.0, per_prefill_token_us=5.0, decode_base_us=100.0,
                     per_decode_row_us=60.0)
    fitter = StepCostFitter(prior, window=64)
    for i in range(64):
        prefill_rows = int(rng.integers(0, 5))
        prefill = prefill_rows * int(rng.choice([8, 32, 100]))
        rows = 0 if i % 4 == 0 and prefill else int(rng.integers(1, 20))
        fitter.add(prefill, rows, ROWS.predict_us(prefill, rows, prefill_rows), prefill_rows)
    cost = fitter.fit()
    for name in ("base_us", "per_prefill_token_us", "decode_base_us", "per_decode_row_us",
                 "per_prefill_row_us"):
        assert getattr(cost, name) == pytest.approx(getattr(ROWS, name), rel=0.02, abs=2.0), name


POSITIONS = StepCost(base_us=3000.0, per_prefill_token_us=556.0, decode_base_us=380.0,
                     per_decode_row_us=4600.0, per_prefill_row_us=16500.0,
                     per_prefill_position_us=414.0)


def _chunk_positions(chunks):
    return sum(n * start + n * (n - 1) // 2 for start, n in chunks)


def test_fitter_recovers_the_position_cost():
    """Chunks at varied depths into their prompts (the bench model's fit, 414 µs per prefill
    token per thousand positions before it): the sixth coefficient comes out of the fit, and a
    chunk deep in a prompt is predicted longer than the same chunk at its start."""
    rng = np.random.default_rng(11)
    fitter = StepCostFitter(StepCost(base_us=2000.0, per_prefill_token_us=650.0,
                                     decode_base_us=500.0, per_decode_row_us=4000.0,
                                     per_prefill_row_us=15000.0), window=64)
    for i in range(64):
        chunks = [(int(rng.integers(0, 800)), int(rng.choice([16, 64, 200])))
                  for _ in range(int(rng.integers(0, 3)))]
        tokens = sum(n for _, n in chunks)
        rows = int(rng.integers(1, 12)) if i % 3 or not chunks else 0
        positions = _chunk_positions(chunks)
        fitter.add(tokens, rows, POSITIONS.predict_us(tokens, rows, len(chunks), positions),
                   len(chunks), positions)
    cost = fitter.fit()
    for name in ("base_us", "per_prefill_token_us", "per_decode_row_us", "per_prefill_row_us",
                 "per_prefill_position_us"):
        assert getattr(cost, name) == pytest.approx(getattr(POSITIONS, name), rel=0.02), name
    deep, shallow = _chunk_positions([(700, 64)]), _chunk_positions([(0, 64)])
    assert cost.predict_us(64, 4, 1, deep) > cost.predict_us(64, 4, 1, shallow) + 15000


def test_fitter_keeps_the_position_cost_without_prefill_steps():
    """A window of decode-only steps says nothing about prefill: the position cost stays."""
    fitter = StepCostFitter(POSITIONS, window=16)
    for rows in range(1, 17):
        fitter.add(0, rows, 1.1 * POSITIONS.predict_us(0, rows))
    assert fitter.fit().per_prefill_position_us == pytest.approx(414.0, rel=1e-6)


def test_fitter_keeps_the_row_cost_without_multi_sequence_steps():
    """No step of the window has two prefill rows: the row cost is not observable and stays
    the prior's, while the other coefficients are refitted."""
    prior = StepCost(base_us=800.0, per_prefill_token_us=5.0, decode_base_us=100.0,
                     per_decode_row_us=60.0, per_prefill_row_us=9000.0)
    fitter = StepCostFitter(prior, window=32)
    rng = np.random.default_rng(7)
    for i in range(32):
        prefill_rows = i % 2  # at most one prefill sequence a step
        prefill = prefill_rows * int(rng.choice([16, 64, 200]))
        rows = int(rng.integers(1, 20))
        fitter.add(prefill, rows, TRUE.predict_us(prefill, rows), prefill_rows)
    cost = fitter.fit()
    assert cost.per_prefill_row_us == pytest.approx(9000.0, rel=1e-6)
    assert cost.per_prefill_token_us == pytest.approx(TRUE.per_prefill_token_us, rel=0.02)
    assert cost.base_us + cost.decode_base_us == pytest.approx(
        TRUE.base_us + TRUE.decode_base_us, rel=0.02)


# 128 steps of a trace replay's per-step log on the bench model (prefill tokens, decode rows,
# prefill rows, prefill positions, ms): 12 with prefill among the first 66, then 62 decode-only
# ones; and the model in force before them.
_STRETCH = [
    (0, 5, 0, 0, 19.6), (0, 5, 0, 0, 19.2), (0, 5, 0, 0, 18.7), (0, 5, 0, 0, 18.9),
    (0, 5, 0, 0, 19.0), (0, 5, 0, 0, 18.7), (0, 5, 0, 0, 18.6), (0, 5, 0, 0, 18.9),
    (0, 4, 0, 0, 18.9), (0, 4, 0, 0, 15.6), (0, 4, 0, 0, 15.5), (0, 4, 0, 0, 15.7),
    (0, 4, 0, 0, 15.4), (0, 4, 0, 0, 15.6), (0, 4, 0, 0, 16.0), (0, 4, 0, 0, 15.7),
    (0, 4, 0, 0, 15.6), (0, 4, 0, 0, 16.0), (0, 4, 0, 0, 16.4), (0, 4, 0, 0, 16.7),
    (0, 4, 0, 0, 15.7), (0, 4, 0, 0, 16.4), (0, 4, 0, 0, 16.1), (0, 4, 0, 0, 18.0),
    (0, 4, 0, 0, 16.6), (0, 4, 0, 0, 17.0), (0, 4, 0, 0, 15.9), (0, 4, 0, 0, 16.3),
    (0, 4, 0, 0, 16.3), (0, 4, 0, 0, 17.5), (0, 4, 0, 0, 19.8), (0, 3, 0, 0, 24.1),
    (0, 3, 0, 0, 15.5), (0, 3, 0, 0, 15.1), (0, 3, 0, 0, 15.0), (0, 2, 0, 0, 17.2),
    (0, 2, 0, 0, 14.0), (0, 2, 0, 0, 14.4), (0, 2, 0, 0, 14.0), (0, 2, 0, 0, 13.9),
    (0, 2, 0, 0, 13.6), (0, 2, 0, 0, 13.8), (0, 2, 0, 0, 13.7), (0, 1, 0, 0, 9.8),
    (0, 1, 0, 0, 5.5), (0, 1, 0, 0, 8.6), (0, 1, 0, 0, 5.4), (0, 1, 0, 0, 5.4), (0, 1, 0, 0, 5.3),
    (0, 1, 0, 0, 5.7), (0, 1, 0, 0, 5.4), (0, 1, 0, 0, 5.2), (0, 1, 0, 0, 5.3), (0, 1, 0, 0, 5.4),
    (512, 0, 2, 74240, 347.7), (512, 0, 4, 145962, 321.2), (179, 2, 1, 110622, 113.5),
    (179, 2, 2, 65313, 104.2), (173, 3, 1, 55879, 101.5), (173, 3, 1, 85808, 116.9),
    (173, 3, 1, 115737, 119.8), (173, 3, 2, 24755, 114.3), (173, 3, 1, 45672, 119.0),
    (173, 3, 1, 75601, 122.8), (186, 3, 1, 114669, 125.3), (58, 3, 1, 42833, 58.8),
    (0, 4, 0, 0, 22.5), (0, 4, 0, 0, 21.9), (0, 4, 0, 0, 21.5), (0, 4, 0, 0, 20.2),
    (0, 4, 0, 0, 20.2), (0, 4, 0, 0, 21.4), (0, 4, 0, 0, 20.3), (0, 4, 0, 0, 20.2),
    (0, 4, 0, 0, 20.6), (0, 4, 0, 0, 20.1), (0, 4, 0, 0, 20.2), (0, 4, 0, 0, 20.7),
    (0, 4, 0, 0, 20.0), (0, 4, 0, 0, 20.8), (0, 4, 0, 0, 20.0), (0, 4, 0, 0, 20.1),
    (0, 4, 0, 0, 19.7), (0, 4, 0, 0, 19.9), (0, 4, 0, 0, 20.4), (0, 3, 0, 0, 22.2),
    (0, 3, 0, 0, 17.8), (0, 3, 0, 0, 17.5), (0, 3, 0, 0, 17.4), (0, 3, 0, 0, 19.5),
    (0, 3, 0, 0, 17.8), (0, 3, 0, 0, 18.3), (0, 3, 0, 0, 17.3), (0, 3, 0, 0, 17.3),
    (0, 3, 0, 0, 17.7), (0, 3, 0, 0, 17.5), (0, 3, 0, 0, 17.6), (0, 2, 0, 0, 18.3),
    (0, 1, 0, 0, 10.6), (0, 1, 0, 0, 7.6), (0, 1, 0, 0, 7.7), (0, 1, 0, 0, 7.6),
    (0, 1, 0, 0, 7.8), (0, 1, 0, 0, 7.8), (0, 1, 0, 0, 8.1), (0, 1, 0, 0, 8.3), (0, 1, 0, 0, 7.5),
    (0, 1, 0, 0, 7.7), (0, 1, 0, 0, 7.5), (0, 1, 0, 0, 7.5), (0, 1, 0, 0, 7.5), (0, 1, 0, 0, 7.6),
    (0, 1, 0, 0, 7.4), (0, 1, 0, 0, 7.7), (0, 1, 0, 0, 8.0), (0, 1, 0, 0, 8.3), (0, 1, 0, 0, 7.6),
    (0, 1, 0, 0, 7.6), (0, 1, 0, 0, 7.8), (0, 1, 0, 0, 8.1), (0, 1, 0, 0, 7.6), (0, 1, 0, 0, 8.0),
    (0, 1, 0, 0, 7.7), (0, 1, 0, 0, 7.7), (0, 1, 0, 0, 8.4), (0, 1, 0, 0, 7.8), (0, 1, 0, 0, 7.9),
    (0, 1, 0, 0, 7.7),
]
_STRETCH_BEFORE = StepCost(base_us=2983.212, per_prefill_token_us=607.781, decode_base_us=0.0,
                           per_decode_row_us=4321.63, per_prefill_row_us=39913.547,
                           per_prefill_position_us=287.971)


def test_fitter_keeps_the_prefill_steps_a_decode_stretch_pushes_out_of_its_window():
    """Refitted every 8 steps as the engine does, the window of 64 ends up holding 2 prefill
    steps among 62 decode-only ones, which cannot tell the prefill terms apart. Fitted on the
    window alone, the per-token cost came out 0 and the next chunk (511 tokens in four rows,
    which ran 272 ms) was predicted at 74 ms; with the prefill steps kept from before the
    window it is predicted within a fifth of its time."""
    fitter = StepCostFitter(_STRETCH_BEFORE, window=64)
    for n, (tokens, rows, prefill_rows, positions, ms) in enumerate(_STRETCH, start=1):
        fitter.add(tokens, rows, ms * 1e3, prefill_rows, positions)
        if n % 8 == 0:
            cost = fitter.fit()
    assert len(fitter) == 64
    assert cost.per_prefill_token_us > 300
    assert cost.predict_us(511, 1, 4, 68950) == pytest.approx(272e3, rel=0.2)
    assert cost.predict_us(0, 1) == pytest.approx(8e3, rel=0.2)  # a one-row decode: 7-8 ms


@pytest.mark.parametrize("impl", [Scheduler, TwinScheduler], ids=["native", "twin"])
def test_feed_counts_the_prefill_rows_of_each_step(impl):
    """SlackFeed records each step's prefill rows: steps carrying several prompts show up as
    such in the fitter's window (rows that are not decode rows)."""
    config = SchedulerConfig(planning_rule=PlanningRule.SLACK, itl_target=1.0,
                             prefill_chunk_tokens=64, max_tokens_per_iteration=256)
    sched = impl(config)
    engine = Engine(sched, CostModelHost(token=1), clock=VirtualClock(LAB_COST))
    feed = next(o for o in engine.observers if isinstance(o, SlackFeed))
    seen, positions = [], []
    add = feed.fitter.add

    def record(prefill_tokens, decode_rows, duration_us, prefill_rows=1, prefill_positions=0):
        seen.append((prefill_tokens, decode_rows, prefill_rows))
        positions.append(prefill_positions)
        add(prefill_tokens, decode_rows, duration_us, prefill_rows, prefill_positions)

    feed.fitter.add = record
    for i in range(3):
        engine.submit(Request(f"r{i}", list(range(10 + i)), 3, arrival_us=0.0))
    engine.run()
    assert seen[0] == (10 + 11 + 12, 0, 3)  # the three prompts in one step
    assert positions[0] == sum(range(10)) + sum(range(11)) + sum(range(12))
    assert all(rows == 0 for p, _, rows in seen if p == 0)  # decode-only steps: none
    assert all(pos == 0 for (p, _, _), pos in zip(seen, positions) if p == 0)
    assert len(feed.fitter) == len(seen)


def test_fitter_refuses_bad_settings():
    with pytest.raises(ValueError):
        StepCostFitter(StepCost(), window=2)
    with pytest.raises(ValueError):
        StepCostFitter(StepCost(), clip=0)


@pytest.mark.parametrize("impl", [Scheduler, TwinScheduler], ids=["native", "twin"])
def test_engine_fits_the_model_under_the_slack_rule(impl):
    model = StepCost(base_us=500, per_prefill_token_us=3, decode_base_us=200, per_decode_row_us=40)
    config = SchedulerConfig(planning_rule=PlanningRule.SLACK, itl_target=0.002,
                             prefill_chunk_tokens=64, max_tokens_per_iteration=256)
    sched = impl(config)
    engine = Engine(sched, CostModelHost(token=1), clock=VirtualClock(model))
    feeds = [o for o in engine.observers if isinstance(o, SlackFeed)]
    assert len(feeds) == 1
    for i in range(24):
        engine.submit(Request(f"r{i}", list(range(10 + 37 * (i % 5))), 8 + i % 7,
                              arrival_us=1500.0 * i))
    report = engine.run()
    assert engine.outstanding == 0 and report.iterations > 24
    fitted = sched.step_cost
    assert fitted != config.step_cost  # refitted during the run
    for p, d in ((0, 4), (64, 4), (128, 0), (32, 12)):
        assert fitted.predict_us(p, d) == pytest.approx(model.predict_us(p, d), rel=0.02)


def _random_window(rng):
    """A fitter whose window mixes decode, prefill and multi-prompt steps of a random model
    around a random prior, with stalls and sub-µs steps among them."""
    prior = StepCost(*rng.uniform(0, 2000, 6) * (rng.random(6) < 0.7))
    fitter = StepCostFitter(prior, window=int(rng.integers(4, 80)))
    true = rng.uniform(0, 1000, 6) * (rng.random(6) < 0.6)
    for _ in range(int(rng.integers(4, 150))):
        p = int(rng.choice([0, 0, 0, 16, 256, 512]))
        d = int(rng.integers(0, 64)) if rng.random() < 0.8 or not p else 0
        d = d if p or d else 1
        rows = int(rng.integers(1, 4)) if p else 0
        pos = p * int(rng.integers(0, 1000)) if p else 0
        x = step_terms([p], [d], [rows], [pos])[0]
        us = max(float(x @ true), 1.0) * rng.uniform(0.8, 1.3) * (20 if rng.random() < 0.05 else 1)
        fitter.add(p, d, 0.5 if rng.random() < 0.02 else us, rows, pos)
    return fitter


def test_native_fit_matches_the_numpy_fit(monkeypatch):
    """`fit` runs `_fit.fit_window`; `_fit_numpy` is the same arithmetic in numpy. Over random
    windows (the active set reached in many) the two agree to rounding (the solves are
    ill-conditioned where the prior alone decides a term, hence 1e-6, not 1e-12)."""
    active = []
    real = cost_model._active_set
    monkeypatch.setattr(cost_model, "_active_set", lambda *a: active.append(1) or real(*a))
    rng = np.random.default_rng(11)
    for trial in range(300):
        fitter = _random_window(rng)
        twin = StepCostFitter(fitter.cost, window=64)
        twin._steps, twin._prefill, twin._added = fitter._steps, fitter._prefill, fitter._added
        first = fitter._added - len(fitter._steps)
        data = np.array([s for n, s in fitter._prefill if n <= first] + list(fitter._steps))
        prior = np.array(fitter.cost.terms())
        want = np.array(twin._fit_numpy(step_terms(*data[:, :4].T), data[:, 4], prior).terms())
        native = fit_window(data, prior, 4.0, 0.01, 1e-6, 4)
        assert native is not None and native != "kept", trial
        got = np.maximum(np.array(native), 0.0)
        assert np.array_equal(np.array(fitter.fit().terms()), got)  # what `fit` runs
        scale = np.maximum(np.abs(want), 1e-6 * max(np.abs(want).max(), 1.0))
        assert np.all(np.abs(got - want) <= 1e-6 * scale), (trial, got, want)
    assert len(active) > 30  # the active set's path, not only the first solve's


def test_native_fit_keeps_a_model_that_explains_the_window_and_leaves_singular_solves():
    prior = StepCost(base_us=1000.0, per_decode_row_us=50.0)
    steps = np.array([[0, d, 0, 0, prior.predict_us(0, d)] for d in range(1, 9)], dtype=float)
    assert fit_window(steps, np.array(prior.terms()), 4.0, 0.01, 1e-6, 4) == "kept"
    fitter = StepCostFitter(prior)
    for row in steps:
        fitter.add(0, int(row[1]), row[4])
    assert fitter.fit() is prior
    # Without the prior's pull, terms no step varies make the system singular: numpy decides.
    assert fit_window(steps, np.zeros(6), 4.0, 0.01, 0.0, 4) is None
    with pytest.raises(ValueError, match="5"):
        fit_window(steps[:, :4].copy(), np.zeros(6), 4.0, 0.01, 1e-6, 4)
    with pytest.raises(ValueError, match="at least one step"):
        fit_window(np.zeros((0, 5)), np.zeros(6), 4.0, 0.01, 1e-6, 4)


def test_fit_falls_back_to_numpy_where_the_native_fit_leaves_it(monkeypatch):
    rng = np.random.default_rng(5)
    fitter = _random_window(rng)
    twin = StepCostFitter(fitter.cost)
    twin._steps, twin._prefill, twin._added = fitter._steps, fitter._prefill, fitter._added
    want = twin.fit()
    monkeypatch.setattr(cost_fit, "fit_window", lambda *a: None)
    got = fitter.fit()
    assert np.allclose(got.terms(), want.terms(), rtol=1e-6, atol=1e-9)


def test_reference_rule_adds_no_observer():
    engine = Engine(Scheduler(SchedulerConfig()), CostModelHost(), clock=VirtualClock())
    assert not any(isinstance(o, SlackFeed) for o in engine.observers)


_SLACK_VERBS = ("set_clock", "step_cost", "set_step_cost")


class _NoSlackInputs:
    """A scheduler without the slack rule's inputs: everything else delegated."""

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        if name in _SLACK_VERBS:
            raise AttributeError(name)
        return getattr(self._inner, name)

    config = property(lambda self: self._inner.config)
    prefix_store = property(lambda self: self._inner.prefix_store)

    def __dir__(self):
        return [n for n in dir(self._inner) if n not in _SLACK_VERBS]


@pytest.mark.parametrize("impl", [Scheduler, TwinScheduler], ids=["native", "twin"])
def test_the_slack_inputs_are_a_capability_checked_once(impl):
    """Both schedulers take the slack rule's inputs (`SlackRuleScheduler`); an engine told to
    run the rule on a scheduler that lacks them refuses it when built, naming what it lacks."""
    from skippy_scheduler.engine.contract import (SchedulerLike, SlackRuleScheduler,
                                                  check_scheduler, check_slack_scheduler)

    sched = impl(SchedulerConfig(planning_rule=PlanningRule.SLACK))
    assert isinstance(sched, SlackRuleScheduler) and check_slack_scheduler(sched) is sched
    assert not set(_SLACK_VERBS) & set(vars(SchedulerLike))
    bare = _NoSlackInputs(sched)
    assert check_scheduler(bare) is bare  # a scheduler all the same
    with pytest.raises(TypeError, match="cannot run the slack rule: it lacks set_clock, "
                                        "step_cost, set_step_cost"):
        Engine(bare, CostModelHost(), clock=VirtualClock())
    Engine(bare, CostModelHost(), clock=None)  # without a clock the rule's inputs are not set


@pytest.mark.parametrize("impl", [Scheduler, TwinScheduler], ids=["native", "twin"])
def test_request_deadlines_reach_the_sequence(impl):
    sched = impl(SchedulerConfig(planning_rule=PlanningRule.SLACK))
    seen = {}

    def look(engine):
        for rid in ("r", "plain"):
            seq = sched.sequence(rid)
            if seq is not None and rid not in seen:
                seen[rid] = (seq.itl_target, seq.ttft_deadline, engine.now())

    engine = Engine(sched, CostModelHost(token=1), clock=VirtualClock(LAB_COST),
                    before_step=look)
    engine.submit(Request("r", [1, 2, 3], 4, arrival_us=2000.0, ttft_ms=250.0, itl_ms=40.0))
    engine.submit(Request("plain", [1, 2], 4, arrival_us=2000.0))
    engine.run()
    itl, deadline, at_us = seen["r"]
    assert itl == pytest.approx(0.04)
    assert at_us >= 2000.0
    assert deadline == pytest.approx(0.002 + 0.25)  # from its arrival, on the engine's clock
    assert seen["plain"][:2] == (None, None)


@pytest.mark.parametrize("impl", [Scheduler, TwinScheduler], ids=["native", "twin"])
def test_a_request_ages_from_its_arrival_under_the_slack_rule(impl):
    """The engine sets the scheduler's clock before each submit, so the prefill order's age
    bound (§2.13) counts from each request's arrival, not from the last step before it: after
    a long idle gap a burst's short prompt still goes before the long one that came with it."""
    model = StepCost(base_us=1000, per_prefill_token_us=100, decode_base_us=0,
                     per_decode_row_us=100)
    config = SchedulerConfig(planning_rule=PlanningRule.SLACK, itl_target=1.0,
                             prefill_chunk_tokens=16, max_tokens_per_iteration=16,
                             slack_prefill_age_max=0.5)
    engine = Engine(impl(config), CostModelHost(token=1), clock=VirtualClock(model))
    engine.submit(Request("early", [1, 2, 3], 1, arrival_us=0.0))
    engine.submit(Request("long", list(range(200)), 1, arrival_us=10e6))  # 10 s idle first
    engine.submit(Request("short", list(range(40)), 1, arrival_us=10e6))
    records = engine.run().by_id()
    assert records["short"].first_token_us < records["long"].first_token_us
    # 40 tokens in 16-token chunks: done by its third step, long's 200 tokens wait behind it
    steps_us = 3 * (1000 + 16 * 100)
    assert records["short"].first_token_us <= 10e6 + steps_us + 1
