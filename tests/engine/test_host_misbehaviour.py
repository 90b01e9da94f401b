"""A host that misbehaves once (a release that raises, outputs outside its plan) and requests
with arrivals that can never come: the engine raises what went wrong, loses no request and
leaks no host state, and the next run completes whatever is left."""
from __future__ import annotations

import math

import pytest

from skippy_scheduler import MalformedOutputs, SchedulerConfig
from skippy_scheduler.cost_model import LAB_COST
from skippy_scheduler.engine import CostModelHost, Engine, Request, VirtualClock

from counting_host import CountingHost


class OnceHost(CountingHost):
    """`CountingHost` that misbehaves once. `bad_release`: the first release raises;
    `bad_outputs`: the plan with that step writes an output outside its rows."""

    def __init__(self, bad_release: bool = False, bad_outputs: int = -1) -> None:
        super().__init__()
        self.bad_release = bad_release
        self.bad_outputs = bad_outputs
        self.plans = 0

    def execute(self, plan) -> None:
        super().execute(plan)
        if self.plans == self.bad_outputs and plan.outputs.count:
            plan.outputs.request_indexes[0] = len(plan) + 5
        self.plans += 1

    def release(self, sequence_id: str, reason: object = None) -> None:
        super().release(sequence_id, reason)
        if self.bad_release:
            self.bad_release = False
            raise RuntimeError("hiccup")


def _requests(ids: str, tokens: int = 3) -> list[Request]:
    return [Request(i, [10 + n, 11 + n], max_tokens=tokens) for n, i in enumerate(ids)]


def test_a_release_that_raises_ends_every_retired_request(impl):
    host = OnceHost(bad_release=True)
    engine = Engine(impl(), host, clock=None)
    with pytest.raises(RuntimeError, match="hiccup"):
        engine.run(_requests("ab", tokens=1))
    # Both ended (the scheduler retired both), and the second was released all the same.
    assert engine.open_ids() == [] and sorted(host.released) == ["a", "b"]
    report = engine.run(_requests("c"))  # the report keeps every request the engine took
    got = {r.id: (r.finish_reason, r.tokens) for r in report.records}
    assert got == {"a": ("length", [12]), "b": ("length", [13]), "c": ("length", [12, 13, 14])}
    assert host.holding == set()


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("record", [True, False])
def test_outputs_outside_the_plan_are_malformed_and_the_plans_run_again(impl, depth, record):
    host = OnceHost(bad_outputs=1)
    engine = Engine(impl(SchedulerConfig(max_inflight_plans=depth)), host, clock=None,
                    record=record)
    with pytest.raises(MalformedOutputs):
        engine.run(_requests("abc"))
    assert sorted(engine.open_ids()) == ["a", "b", "c"]  # none lost
    report = engine.run()
    assert sorted(engine.open_ids()) == [] and host.holding == set()
    assert sorted(host.released) == ["a", "b", "c"]  # each once
    if record:  # the plans undone ran again: every request has its whole generation
        got = {r.id: r.tokens for r in report.records}
        assert got == {"a": [12, 13, 14], "b": [13, 14, 15], "c": [14, 15, 16]}


@pytest.mark.parametrize("arrival", [math.nan, math.inf, -math.inf])
def test_an_arrival_that_never_comes_is_refused_before_the_engine_takes_it(impl, arrival):
    engine = Engine(impl(), CostModelHost(), clock=VirtualClock(LAB_COST), max_iterations=50)
    bad = Request("x", [1, 2], max_tokens=2, arrival_us=arrival)
    with pytest.raises(ValueError, match="arrival_us must be finite"):
        engine.submit(bad)
    with pytest.raises(TypeError, match="arrival_us must be a number"):
        engine.submit(Request("y", [1, 2], max_tokens=2, arrival_us="0"))  # type: ignore[arg-type]
    assert engine.open_ids() == []
    with pytest.raises(ValueError, match="arrival_us must be finite"):
        engine.run([bad])  # a stream: refused when it is pulled, not waited for
    report = engine.run(_requests("z", tokens=2))
    assert [r.id for r in report.records] == ["z"]


def test_a_bad_arrival_in_a_stream_keeps_the_requests_taken_before_it(impl):
    host = OnceHost()
    engine = Engine(impl(), host, clock=VirtualClock(LAB_COST))
    stream = [Request("a", [1, 2], max_tokens=2, arrival_us=10),
              Request("b", [3, 4], max_tokens=2, arrival_us=math.nan),
              Request("c", [5, 6], max_tokens=2, arrival_us=20)]
    with pytest.raises(ValueError, match="arrival_us must be finite"):
        engine.run(stream)
    assert engine.open_ids() == ["a"]  # taken before the bad one: it goes on
    report = engine.run()
    assert [(r.id, r.finish_reason) for r in report.records] == [("a", "length")]
    assert host.holding == set() and host.released == ["a"]


def test_runs_one_after_another_each_take_their_own_requests(impl):
    host = OnceHost()
    engine = Engine(impl(), host, clock=VirtualClock(LAB_COST))
    first = engine.run([Request("a", [1, 2], max_tokens=2, arrival_us=5_000)])
    assert [r.id for r in first.records] == ["a"]
    # A second stream (it may start before the first one's last arrival: the order is its own).
    second = engine.run([Request("b", [3, 4], max_tokens=2, arrival_us=0),
                         Request("c", [5, 6], max_tokens=2, arrival_us=1.0)])
    assert sorted(r.id for r in second.records) == ["a", "b", "c"]
    assert host.holding == set() and sorted(host.released) == ["a", "b", "c"]
    engine.add_requests(iter([Request("d", [1], max_tokens=1)]))
    with pytest.raises(RuntimeError, match="already has a request stream"):
        engine.add_requests([])


class PrepareFails(CountingHost):
    """`CountingHost` whose `prepare_sequence` fails (not a refusal: a host error) for one id."""

    def __init__(self, bad_id: str) -> None:
        super().__init__()
        self.bad_id = bad_id

    def prepare_sequence(self, sequence):
        if sequence.id == self.bad_id:
            raise RuntimeError("host bug")
        return sequence


def test_a_prepare_sequence_that_fails_ends_its_request_and_the_run_goes_on(impl):
    host = PrepareFails("b")
    engine = Engine(impl(), host, clock=None)
    ended = []
    engine.add_listener(lambda e: ended.append((e.request_id, e.reason))
                        if type(e).__name__ == "FinishEvent" else None)
    with pytest.raises(RuntimeError, match="host bug"):
        engine.run(_requests("abc"))
    assert ("b", "failed") in ended  # told, not left open with its stream waiting
    assert "b" not in engine.open_ids()
    report = engine.run()
    got = {r.id: r.finish_reason for r in report.records}
    assert got == {"a": "length", "b": "failed", "c": "length"}
    assert engine.open_ids() == [] and host.holding == set()
    host.bad_id = ""
    again = engine.run([Request("b", [1, 2], max_tokens=1)])  # its id is free again
    assert [(r.id, r.finish_reason) for r in again.records if r.id == "b"][-1] == ("b", "length")


@pytest.mark.parametrize("field", ["arrival_us", "ttft_ms"])
def test_an_int_past_a_double_is_a_value_error_and_loses_nothing(impl, field):
    engine = Engine(impl(), OnceHost(), clock=VirtualClock(LAB_COST))
    huge = 10 ** 400  # float() of it overflows
    with pytest.raises(ValueError, match=f"{field} must be"):
        engine.submit(Request("x", [1, 2], max_tokens=2, **{field: huge}))
    assert engine.open_ids() == []
    stream = [Request("a", [1, 2], max_tokens=2, arrival_us=10),
              Request("b", [3, 4], max_tokens=2, **{"arrival_us": 20, field: huge}),
              Request("c", [5, 6], max_tokens=2, arrival_us=30)]
    if field == "arrival_us":  # a stream's bad arrival: the stream stops there (as NaN does)
        with pytest.raises(ValueError, match="arrival_us must be finite"):
            engine.run(stream)
        report = engine.run()
        assert [(r.id, r.finish_reason) for r in report.records] == [("a", "length")]
    else:  # a bad budget: that request is refused, the others run
        report = engine.run(stream)
        assert {r.id: r.finish_reason for r in report.records} == {
            "a": "length", "b": "rejected", "c": "length"}
    assert engine.open_ids() == []


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("call", ["step", "run"])
def test_a_step_from_inside_a_step_is_refused_and_no_token_is_sent_twice(impl, depth, call):
    engine = Engine(impl(SchedulerConfig(max_inflight_plans=depth)), OnceHost(), clock=None)
    tokens = []
    refused = []

    def listener(event):
        if type(event).__name__ == "TokenEvent":
            tokens.append(event.token)
            try:
                engine.step() if call == "step" else engine.run()
            except RuntimeError as exc:
                refused.append(str(exc))

    engine.add_listener(listener)
    report = engine.run([Request("a", [1, 2, 3], max_tokens=4)])
    assert refused and all("in a step" in r for r in refused)
    assert [r.finish_reason for r in report.records] == ["length"]
    assert len(tokens) == 4 == len(report.records[0].tokens)
    assert engine.open_ids() == [] and engine.scheduler.live_plans == 0
