"""What the engine refuses, and how nothing is lost on the way: an arrival an engine without a
clock never reaches, a second request with an open request's id, a request that could never fit
the memory components; the contract's protocols as the package exports them; the engine's
snippet of docs/api.md as written; the engine's repr (docs/hosts.md, "The engine")."""
from __future__ import annotations

import contextlib
import io
import pathlib
import re
import threading

import numpy as np
import pytest

from skippy_scheduler import MemoryComponent, SchedulerConfig
from skippy_scheduler.cost_model import LAB_COST
from skippy_scheduler.engine import (AcceptEvent, Engine, EngineStalled, FinishEvent, Request,
                                     RequestNeverFits, VirtualClock)

from counting_host import CountingHost

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _config(**kw) -> SchedulerConfig:
    base = dict(max_active_sequences=4, max_tokens_per_iteration=64, prefill_chunk_tokens=16)
    base.update(kw)
    return SchedulerConfig(**base)


def _reasons(engine: Engine) -> list[tuple[str, str]]:
    return [(r.id, r.finish_reason) for r in engine.report().records]


def _from_another_thread(engine: Engine, *requests: Request) -> None:
    """Submit `requests` from another thread while this one holds the engine (so they wait in
    the inbox), then take them in here."""
    with engine.driven_here():
        worker = threading.Thread(target=lambda: [engine.submit(r) for r in requests])
        worker.start()
        worker.join()
        engine.drain_inbox()


# -- an engine without a clock --------------------------------------------------------------------


def test_an_arrival_an_untimed_engine_never_reaches_is_a_value_error(impl):
    engine = Engine(impl(_config()), CountingHost(), clock=None)
    late = Request("late", [1, 2], 2, arrival_us=5)
    with pytest.raises(ValueError, match="without a clock"):
        engine.submit(late)
    with pytest.raises(ValueError, match="without a clock"):
        engine.add_requests([late])  # what `run(requests)` takes: refused before it runs
    assert engine.open_ids() == [] and engine.report().records == []
    # In a stream, the requests before it go on; a later run ends them.
    with pytest.raises(ValueError, match="'late': arrival_us=5"):
        engine.run([Request("a", [1, 2], 2), late])
    assert engine.open_ids() == ["a"]
    report = engine.run([Request("b", [3], 2, arrival_us=0)])  # 0: the untimed engine's now
    assert [(r.id, r.finish_reason) for r in report.records] == [("a", "length"),
                                                                 ("b", "length")]


def test_an_engine_loses_its_clock_only_with_no_arrival_waiting(impl):
    engine = Engine(impl(_config()), CountingHost(), clock=VirtualClock(LAB_COST))
    engine.submit(Request("later", [1, 2], 2, arrival_us=50))
    with pytest.raises(ValueError, match="arrival times"):
        engine.clock = None
    assert isinstance(engine.clock, VirtualClock)
    assert engine.cancel("later")
    engine.clock = None  # what waited was cancelled: nothing is left to arrive
    assert engine.clock is None
    engine.run([Request("now", [1], 2)])
    assert _reasons(engine) == [("later", "cancelled"), ("now", "length")]


# -- a second request with an open request's id ---------------------------------------------------


def test_a_duplicate_id_in_a_run_is_a_rejected_record_and_the_run_goes_on(impl):
    engine = Engine(impl(_config()), CountingHost(), clock=VirtualClock(LAB_COST))
    events: list = []
    engine.add_listener(events.append)
    stream = engine.stream("a")
    report = engine.run([Request("a", [1, 2], 3, arrival_us=0),
                         Request("a", [7, 8], 3, arrival_us=0),
                         Request("empty", [], 3, arrival_us=0),
                         Request("b", [4], 2, arrival_us=0)])
    assert [(r.id, r.finish_reason) for r in report.records] == [
        ("a", "length"), ("a", "rejected"), ("empty", "rejected"), ("b", "length")]
    first, duplicate = report.records[:2]
    assert first.tokens == [3, 4, 5]
    assert duplicate.tokens == [] and "DuplicateSequence" in duplicate.error
    assert engine.open_ids() == [] and engine.outstanding == 0
    # Nothing is said under the open request's id: its events and stream are its own.
    ends = [(e.request_id, e.reason) for e in events if isinstance(e, FinishEvent)]
    assert sorted(ends) == [("a", "length"), ("b", "length"), ("empty", "rejected")]
    got = list(stream)
    assert isinstance(got[0], AcceptEvent) and got[-1].reason == "length"


def test_a_duplicate_id_is_told_to_on_reject(impl):
    refused: list = []
    engine = Engine(impl(_config()), CountingHost(), clock=None,
                    on_reject=lambda req, exc: refused.append((req.id, type(exc).__name__)))
    engine.run([Request("a", [1], 2), Request("a", [2], 2)])
    assert refused == [("a", "DuplicateSequence")]
    assert _reasons(engine) == [("a", "length"), ("a", "rejected")]


def test_a_duplicate_id_from_another_thread_is_a_rejected_record_too(impl):
    engine = Engine(impl(_config()), CountingHost(), clock=None)
    ends: list = []
    engine.add_listener(lambda e: isinstance(e, FinishEvent) and ends.append(e.reason))
    _from_another_thread(engine, Request("x", [1, 2], 3), Request("x", [5], 3))
    assert engine.open_ids() == ["x"]
    engine.run()
    assert _reasons(engine) == [("x", "length"), ("x", "rejected")]
    assert ends == ["length"]


# -- a request that could never fit ---------------------------------------------------------------


def _tight() -> SchedulerConfig:
    return _config(memory_components=[MemoryComponent("kv", 100, 0, 10, 0)])


def test_a_request_that_can_never_fit_is_refused_at_submit(impl):
    scheduler = impl(_tight())
    engine = Engine(scheduler, CountingHost(), clock=VirtualClock(LAB_COST))
    with pytest.raises(RequestNeverFits, match=r"'big' can never be admitted: it reserves 520 "
                                                r"bytes of memory component 'kv'") as caught:
        engine.submit(Request("big", list(range(50)), 2))
    assert isinstance(caught.value, EngineStalled) and isinstance(caught.value, ValueError)
    assert engine.open_ids() == [] and scheduler.metrics().waiting_sequences == 0
    assert engine.status("big") == "rejected"
    report = engine.run([Request("small", [1, 2], 3, arrival_us=0)])  # 50 bytes: it fits
    assert [(r.id, r.finish_reason) for r in report.records] == [("big", "rejected"),
                                                                 ("small", "length")]


def test_a_request_that_can_never_fit_ends_before_a_run_raises(impl):
    engine = Engine(impl(_tight()), CountingHost(), clock=VirtualClock(LAB_COST))
    ends: list = []
    engine.add_listener(lambda e: isinstance(e, FinishEvent) and ends.append(
        (e.request_id, e.reason, e.rejection)))
    with pytest.raises(RequestNeverFits, match="'big' can never be admitted"):
        engine.run([Request("big", list(range(50)), 2, arrival_us=0),
                    Request("next", [1], 2, arrival_us=0)])
    assert engine.open_ids() == [] and ends == [("big", "rejected", None)]
    engine.run()  # the stream goes on with the next request
    assert _reasons(engine) == [("big", "rejected"), ("next", "length")]
    assert "can never be admitted" in engine.report().records[0].error


def test_a_request_that_can_never_fit_from_another_thread_is_only_rejected(impl):
    engine = Engine(impl(_tight()), CountingHost(), clock=None)
    ends: list = []
    engine.add_listener(lambda e: isinstance(e, FinishEvent) and ends.append(e))
    _from_another_thread(engine, Request("big", list(range(50)), 2), Request("ok", [1], 2))
    engine.run()
    assert _reasons(engine) == [("big", "rejected"), ("ok", "length")]
    assert "RequestNeverFits" in ends[0].error and ends[0].rejection is None


def test_a_request_that_can_never_fit_is_told_to_on_reject(impl):
    refused: list = []
    engine = Engine(impl(_tight()), CountingHost(), clock=None,
                    on_reject=lambda req, exc: refused.append((req.id, type(exc).__name__)))
    engine.run([Request("big", list(range(50)), 2), Request("ok", [1], 2)])
    assert refused == [("big", "RequestNeverFits")]
    assert _reasons(engine) == [("big", "rejected"), ("ok", "length")]


# -- types at runtime, exports, docs, repr --------------------------------------------------------


def test_a_prompt_may_be_an_integer_array(impl):
    engine = Engine(impl(_config()), CountingHost(), clock=None)
    report = engine.run([Request("a", np.arange(40, 50), 3)])
    assert report.records[0].tokens == [50, 51, 52]
    assert engine.run() is not None
    quiet = Engine(impl(_config()), CountingHost(), clock=None, record=False)
    assert quiet.run([Request("b", np.arange(3), 2)]) is None


def test_the_contract_protocols_are_exported():
    from skippy_scheduler.engine import contract
    from skippy_scheduler.engine import (ChainingHost, ConfigCheckingHost,  # noqa: F401
                                         DetailReportingHost, HostOutOfMemory, PipelinedHost,
                                         PromptKeepingHost)

    for name in ("ChainingHost", "ConfigCheckingHost", "DetailReportingHost", "HostOutOfMemory",
                 "PipelinedHost", "PromptKeepingHost"):
        assert name in contract.__all__, name
        assert getattr(contract, name) is getattr(__import__("skippy_scheduler.engine",
                                                             fromlist=[name]), name)


def _api_engine_snippet() -> str:
    text = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    section = text.split("## Driving a runtime: the engine", 1)[1]
    block = re.search(r"```python\n(.*?)```", section, re.S)
    assert block, "docs/api.md's engine section has no python block"
    return block.group(1)


def test_the_api_engine_snippet_runs_as_written():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(_api_engine_snippet(), "docs/api.md", "exec"), {"__name__": "snippet"})
    assert out.getvalue().startswith("a length [")


def test_an_engine_repr_says_what_is_open(impl):
    engine = Engine(impl(_config()), CountingHost(), clock=VirtualClock(LAB_COST))
    engine.submit(Request("a", [1, 2], 3))
    engine.submit(Request("later", [1, 2], 3, arrival_us=10**6))
    text = repr(engine)
    assert text.startswith(f"<Engine {impl.__name__} on CountingHost:")
    assert "clock=VirtualClock" in text and "open=2" in text and "outstanding=1" in text
    engine.run()
    assert "open=0" in repr(engine) and "outstanding=0" in repr(engine)
