"""Misuse parity: the twin refuses what the native scheduler refuses, with the same exception.

Each case runs on both implementations (the `impl` fixture) and requires the exact exception
class (not a subclass: `StalePlanError` is a `ValueError`), the key part of its message, and a
scheduler whose snapshot, metrics, sequences and live plans are as they were before the misuse
(behaviour.md §0.7: a plan's views raise `StalePlanError` once it is no longer live, a plan of
another scheduler is a `ValueError`).
"""
import pytest

from skippy_scheduler import (
    MalformedOutputs,
    Scheduler,
    SchedulerConfig,
    Sequence,
    StalePlanError,
    TwinScheduler,
)
from skippy_scheduler.inflight import resolve_deferred
from sched_helpers import complete, state

# Plan views that need the plan live: the numpy views, the outputs block and the sums read
# from them (native: `IterationPlan._check`).
VIEWS = ["tokens", "positions", "row_offsets", "sample_last", "phases", "sample_rows",
         "new_rows", "restored_tokens", "deferred_rows", "deferred_source_steps",
         "deferred_source_indexes", "prefill_positions", "outputs"]
# Readable whatever becomes of the plan.
KEPT = ["token_count", "admitted", "preempted", "priority_victims", "step"]

STALE = "no longer live"


def full_state(s):
    return state(s), s.live_plans


def refuses(s, cls, fragment, fn):
    """`fn()` raises exactly `cls` with `fragment` in its message, and `s` is unchanged."""
    before = full_state(s)
    with pytest.raises(Exception) as info:
        fn()
    assert type(info.value) is cls, f"{type(info.value).__name__}: {info.value}"
    assert fragment in str(info.value)
    assert full_state(s) == before


def started(impl, **config):
    """A scheduler with one sequence submitted and a plan made for it (returned too)."""
    s = impl(SchedulerConfig(**config))
    s.submit(Sequence("a", [1, 2, 3], 4))
    return s, s.plan_iteration()


def completed(impl):
    s, p = started(impl)
    complete(s, p, [(0, 7)])
    return s, p


def aborted(impl):
    s, p = started(impl)
    s.abort_iteration(p)
    return s, p


def replaced(impl):
    s, p = started(impl)
    s.plan_iteration()  # depth 1: the next plan aborts the live one
    return s, p


ENDINGS = [completed, aborted, replaced]


# -- 1. a plan that is no longer live -------------------------------------------------------------


@pytest.mark.parametrize("ending", ENDINGS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("name", VIEWS)
def test_views_of_a_plan_no_longer_live_raise(impl, ending, name):
    s, p = ending(impl)
    assert p.live is False
    refuses(s, StalePlanError, STALE, lambda: getattr(p, name))


@pytest.mark.parametrize("ending", ENDINGS, ids=lambda f: f.__name__)
def test_work_and_ids_not_read_while_live_raise(impl, ending):
    s, p = ending(impl)
    refuses(s, StalePlanError, STALE, lambda: p.work)
    refuses(s, StalePlanError, STALE, lambda: p.sequence_ids)


@pytest.mark.parametrize("ending", ENDINGS, ids=lambda f: f.__name__)
def test_what_stays_readable(impl, ending):
    s, p = ending(impl)
    assert len(p) == 1 and p.live is False
    for name in KEPT:
        getattr(p, name)


def test_work_and_ids_read_while_live_stay_readable(impl):
    s, p = started(impl)
    work, ids = p.work, p.sequence_ids
    complete(s, p, [(0, 7)])
    assert p.work == work and p.sequence_ids == ids == ["a"]


def test_ids_stay_readable_with_plans_in_flight(impl):
    s, p = started(impl, max_inflight_plans=2)
    complete(s, p, [(0, 7)])
    assert p.sequence_ids == ["a"]
    refuses(s, StalePlanError, STALE, lambda: p.work)


@pytest.mark.parametrize("ending", ENDINGS, ids=lambda f: f.__name__)
def test_an_outputs_block_taken_while_live(impl, ending):
    s, p = started(impl)
    out = p.outputs
    if ending is completed:
        complete(s, p, [(0, 7)])
    elif ending is aborted:
        s.abort_iteration(p)
    else:
        s.plan_iteration()
    refuses(s, StalePlanError, STALE, lambda: out.count)

    def write():
        out.count = 0
    refuses(s, StalePlanError, STALE, write)
    # The arrays already handed out, and the capacity, are not checked (native: plain views).
    assert out.capacity == 1 and len(out.request_indexes) == len(out.predicted_tokens) == 1


def test_resolve_deferred_from_a_completed_plan(impl):
    s, a = started(impl, max_inflight_plans=2)
    out = a.outputs
    out.request_indexes[0], out.predicted_tokens[0], out.count = 0, 5, 1
    b = s.plan_iteration()
    assert list(b.deferred_rows) == [0]
    s.complete_iteration(a)
    refuses(s, StalePlanError, STALE, lambda: resolve_deferred(b, [a]))


def test_resolve_deferred_into_a_plan_no_longer_live(impl):
    s, a = started(impl, max_inflight_plans=2)
    b = s.plan_iteration()
    s.abort_iteration(b)
    refuses(s, StalePlanError, STALE, lambda: resolve_deferred(b, [a]))


@pytest.mark.parametrize("call", ["complete", "observe", "abort"])
@pytest.mark.parametrize("ending", ENDINGS, ids=lambda f: f.__name__)
def test_feedback_on_a_plan_no_longer_live(impl, ending, call):
    s, p = ending(impl)
    fn = {"complete": lambda: s.complete_iteration(p),
          "observe": lambda: s.observe_iteration_duration(p, "not seconds"),
          "abort": lambda: s.abort_iteration(p)}[call]
    refuses(s, StalePlanError, STALE, fn)


def test_a_refused_completion_leaves_the_views_readable(impl):
    s, p = started(impl)
    out = p.outputs
    out.request_indexes[0], out.predicted_tokens[0], out.count = 5, 7, 1
    refuses(s, MalformedOutputs, "", lambda: s.complete_iteration(p))
    assert p.live and list(p.tokens) == [1, 2, 3] and p.outputs.count == 1


def test_views_cannot_be_replaced(impl):
    s, p = started(impl)
    for name in ("tokens", "outputs", "deferred_rows"):
        with pytest.raises(AttributeError):
            setattr(p, name, None)


# -- 2. a plan of another scheduler ---------------------------------------------------------------


@pytest.mark.parametrize("call", ["complete", "observe", "observe-bad-seconds", "abort"])
@pytest.mark.parametrize("there", ["live", "completed"])
def test_a_plan_of_another_scheduler(impl, call, there):
    s, _ = started(impl)
    other, q = started(impl)
    if there == "completed":
        complete(other, q, [(0, 7)])
    fn = {"complete": lambda: s.complete_iteration(q),
          "observe": lambda: s.observe_iteration_duration(q, 0.01),
          "observe-bad-seconds": lambda: s.observe_iteration_duration(q, "x"),
          "abort": lambda: s.abort_iteration(q)}[call]
    before = full_state(other)
    refuses(s, ValueError, "belongs to another scheduler", fn)
    assert full_state(other) == before
    if there == "live":
        assert q.live
        complete(other, q, [(0, 7)])  # its own scheduler still takes it


@pytest.mark.parametrize("call", ["complete", "observe", "abort"])
def test_a_plan_of_the_other_implementation(impl, call):
    s, _ = started(impl)
    _, q = started(TwinScheduler if impl is Scheduler else Scheduler)
    fn = {"complete": lambda: s.complete_iteration(q),
          "observe": lambda: s.observe_iteration_duration(q, 0.01),
          "abort": lambda: s.abort_iteration(q)}[call]
    refuses(s, TypeError, type(q).__name__, fn)


@pytest.mark.parametrize("value", [None, 5, "plan"])
@pytest.mark.parametrize("call", ["complete", "observe", "abort"])
def test_not_a_plan(impl, call, value):
    s, _ = started(impl)
    fn = {"complete": lambda: s.complete_iteration(value),
          "observe": lambda: s.observe_iteration_duration(value, 0.01),
          "abort": lambda: s.abort_iteration(value)}[call]
    refuses(s, TypeError, type(value).__name__, fn)


# -- 3. attach_prefix_store with something that is not a store ------------------------------------


@pytest.mark.parametrize("store", [5, "store", object(), [1]], ids=lambda v: type(v).__name__)
@pytest.mark.parametrize("held", [False, True], ids=["empty", "held"])
def test_attach_something_that_is_not_a_store(impl, held, store):
    s = impl(SchedulerConfig())
    if held:
        s.submit(Sequence("a", [1, 2, 3], 4))
    refuses(s, TypeError, type(store).__name__, lambda: s.attach_prefix_store(store))
    assert s.prefix_store is None


def test_attach_bad_costs_before_the_store(impl):
    s = impl(SchedulerConfig())
    refuses(s, TypeError, "prefill_cost_per_token",
            lambda: s.attach_prefix_store(5, prefill_cost_per_token="x"))
    refuses(s, ValueError, "restore_cost_per_token",
            lambda: s.attach_prefix_store(5, restore_cost_per_token=-1))


# -- 4. wrong types elsewhere (the same class on both) --------------------------------------------


@pytest.mark.parametrize("value", [None, 5, b"a", ["a"]], ids=repr)
@pytest.mark.parametrize("method", ["cancel", "sequence"])
def test_ids_of_the_wrong_type(impl, method, value):
    s, _ = started(impl)
    refuses(s, TypeError, "", lambda: getattr(s, method)(value))


@pytest.mark.parametrize("value", [5, "kv", [1.5], [True], [-1], [1 << 64]], ids=repr)
def test_measured_bytes_of_the_wrong_type(impl, value):
    s, _ = started(impl)
    cls = ValueError if value in ([-1], [1 << 64]) else TypeError
    refuses(s, cls, "", lambda: s.preempt_for_component_pressure(value))


@pytest.mark.parametrize("value", [None, "1", True])
def test_durations_of_the_wrong_type(impl, value):
    s, p = started(impl)
    refuses(s, TypeError, "", lambda: s.observe_iteration_duration(p, value))


@pytest.mark.parametrize("value", [None, "1", True, 1.5, -1, 2], ids=repr)
def test_output_counts_of_the_wrong_type(impl, value):
    s, p = started(impl)
    cls = TypeError if value in (None, "1", 1.5) or value is True else ValueError
    with pytest.raises(Exception) as info:
        p.outputs.count = value
    assert type(info.value) is cls
    assert p.outputs.count == 0
