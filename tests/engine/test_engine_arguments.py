"""Arguments of the engine's Python API that a caller can get wrong: each is refused with a
specific exception naming it, before the engine or its scheduler changes (a request's own
budgets are judged alike whatever its arrival)."""
from __future__ import annotations

import math
import re

import pytest

from skippy_scheduler.cost_model import LAB_COST
from skippy_scheduler.engine import CostModelHost, Engine, Request, VirtualClock


@pytest.mark.parametrize("value, error, message", [
    ("3", TypeError, "max_iterations must be an int or None, got str"),
    (1.5, TypeError, "got float"),
    (True, TypeError, "got bool"),
    (-1, ValueError, "max_iterations must be >= 0, got -1"),
])
def test_max_iterations_is_checked_at_construction(impl, value, error, message):
    with pytest.raises(error, match=message):
        Engine(impl(), CostModelHost(), clock=None, max_iterations=value)


@pytest.mark.parametrize("hook", ["on_plan", "before_step", "on_reject"])
def test_hooks_must_be_callable(impl, hook):
    with pytest.raises(TypeError, match=f"{hook} must be callable or None, got int"):
        Engine(impl(), CostModelHost(), clock=None, **{hook: 5})


def test_a_listener_that_is_not_callable_is_refused_before_any_request_runs(impl):
    engine = Engine(impl(), CostModelHost(), clock=None)
    with pytest.raises(TypeError, match="listener must be callable, got NoneType"):
        engine.add_listener(None)  # type: ignore[arg-type]
    report = engine.run([Request("a", [1, 2], 3, arrival_us=0)])
    assert [r.finish_reason for r in report.records] == ["length"]


@pytest.mark.parametrize("field", ["ttft_ms", "itl_ms"])
@pytest.mark.parametrize("value, error, message", [
    (-0.05, ValueError, "must be a finite number of ms > 0, got -0.05"),
    (-5, ValueError, "got -5"),
    (0, ValueError, "got 0"),
    (math.nan, ValueError, "got nan"),
    ("5", TypeError, "must be a number of ms or None, got str"),
    (True, TypeError, "got bool"),
])
@pytest.mark.parametrize("arrival", [0.0, 100.0])
def test_a_request_s_own_budgets_are_checked_whatever_its_arrival(impl, field, value, error,
                                                                  message, arrival):
    engine = Engine(impl(), CostModelHost(), clock=VirtualClock(LAB_COST), max_iterations=100)
    bad = Request("bad", [1, 2, 3], 3, arrival_us=arrival, **{field: value})
    with pytest.raises(error, match=f"request 'bad': {field} .*{re.escape(message)}"):
        engine.submit(bad)
    assert engine.open_ids() == [] and engine.scheduler.snapshot().waiting_ids == []
    # In a run the request is rejected with that reason and the others run.
    report = engine.run([bad, Request("good", [4, 5], 2, arrival_us=arrival)])
    got = {r.id: r.finish_reason for r in report.records}
    assert got == {"bad": "rejected", "good": "length"}


def test_llama_host_kv_unified_takes_a_bool_only():
    pytest.importorskip("llama_cpp")
    from skippy_scheduler.hosts.llama.host import LlamaHost

    with pytest.raises(TypeError, match="kv_unified must be True, False or None, got 'no'"):
        LlamaHost("/nonexistent.gguf", n_ctx=512, n_seq_max=2, kv_unified="no")  # type: ignore


def test_a_thing_in_a_request_stream_that_is_no_request_is_a_type_error(impl):
    """What `add_requests` / `run` pull is typed as `submit` types it: a TypeError naming what
    it lacks, raised from the run (the requests taken before it stay open; one the scheduler
    refuses is a `rejected` record instead, above)."""
    engine = Engine(impl(), CostModelHost())
    with pytest.raises(TypeError, match="a request needs id, arrival_us and to_sequence"):
        engine.run([Request("a", [1, 2], 3), ...])
    assert engine.open_ids() == ["a"]  # taken before it: a later run ends it
    engine.run()
    assert engine.status("a") == "length"
