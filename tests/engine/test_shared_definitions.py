"""The pieces the package defines once: observer base, clock factory, int checks, end reasons."""
from __future__ import annotations

import numpy as np
import pytest

from skippy_scheduler import FinishReason, SchedulerConfig
from skippy_scheduler._core import Scheduler
from skippy_scheduler._validate import check_int, check_uint
from skippy_scheduler.engine import (FINISH_REASONS, BaseObserver, CostModelHost, Engine, Request,
                                     VirtualClock)
from skippy_scheduler.engine.clock import CpuClock, WallClock, make_clock
from skippy_scheduler.hosts.calibrate import fresh_clock
from skippy_scheduler.types import COMPLETED_REASONS, REJECTED, UNCOMPLETED_REASONS


class _Steps(BaseObserver):
    def __init__(self) -> None:
        self.steps = 0

    def completed(self, flight, duration_us, telemetry) -> None:
        self.steps += 1


class _Samples(BaseObserver):
    wants_samples = True

    def __init__(self) -> None:
        self.tokens: list[int] = []

    def sampled(self, flight, rows, tokens, end_us) -> None:
        self.tokens.extend(tokens.tolist())


def test_an_observer_overrides_only_the_points_it_uses():
    config = SchedulerConfig(max_active_sequences=2, max_tokens_per_iteration=64)
    engine = Engine(Scheduler(config), CostModelHost(token=1), clock=VirtualClock())
    steps, samples = _Steps(), _Samples()
    engine.observers.extend([steps, samples])
    report = engine.run([Request("a", [1, 2, 3], 4), Request("b", [4, 5], 2)])
    assert steps.steps == report.iterations > 0
    assert samples.tokens == [1] * 6
    assert BaseObserver.wants_samples is False


def test_the_engine_and_the_calibration_share_one_clock_factory():
    assert make_clock(None) is None
    assert isinstance(make_clock("wall"), WallClock)
    assert isinstance(make_clock("virtual"), VirtualClock)
    clock = VirtualClock()
    assert make_clock(clock) is clock
    with pytest.raises(ValueError, match=r"^clock must be 'wall', 'virtual', a Clock or None, "
                                         r"got 'cpu'$"):
        make_clock("cpu")
    with pytest.raises(TypeError, match="clock needs start"):
        make_clock(5)  # type: ignore[arg-type]
    assert isinstance(make_clock("cpu", ("cpu", "wall")), CpuClock)
    assert isinstance(fresh_clock("cpu"), CpuClock)
    assert isinstance(fresh_clock("wall"), WallClock)
    assert fresh_clock(lambda: clock) is clock
    for wrong in ("virtual", None, clock):
        with pytest.raises(ValueError, match=r"^clock must be one of cpu, wall or a clock "
                                             r"factory, got "):
            fresh_clock(wrong)


def test_the_int_checks_say_what_they_want():
    assert check_int("n", np.int64(3), 1, 4) == 3 and type(check_int("n", np.int64(3), 1)) is int
    with pytest.raises(ValueError, match=r"^n must be in \[1, 4\], got 5$"):
        check_int("n", 5, 1, 4)
    with pytest.raises(ValueError, match=r"^n must be >= 1, got 0$"):
        check_int("n", 0, 1)
    with pytest.raises(ValueError, match=r"^n must be in \[0, 7\], got -1$"):
        check_uint("n", -1, 7)
    for wrong, kind in ((True, "bool"), (1.0, "float"), ("1", "str")):
        with pytest.raises(TypeError, match=rf"^n must be an int, got {kind}$"):
            check_int("n", wrong, 0)
    with pytest.raises(TypeError, match=r"^n must be an int, got int64$"):
        check_uint("n", np.int64(3), exact=True)


def test_end_reasons_are_spelled_once():
    assert FINISH_REASONS == ("length", "stop", "failed", "cancelled", "rejected")
    assert FINISH_REASONS == COMPLETED_REASONS + UNCOMPLETED_REASONS
    assert set(FINISH_REASONS) == {r.value for r in FinishReason} | {REJECTED}
