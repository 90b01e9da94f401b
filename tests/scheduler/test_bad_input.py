"""Bad input raises a specific exception before any state changes (§0.5, §0.7)."""
import math

import numpy as np
import pytest
from sched_helpers import complete, make_scheduler, pred, row_ids, seq, state

from skippy_scheduler import (
    AdmissionError,
    DuplicateSequence,
    EmptyPrompt,
    IterationPrediction,
    MalformedOutputs,
    MemoryComponent,
    QueueFull,
    Scheduler,
    SchedulerConfig,
    Sequence,
    StalePlanError,
    TwinScheduler,
)


def busy(impl):
    """Two active sequences ("a" sampling, "b" mid-prefill), one waiting ("w"), a live plan."""
    s = make_scheduler(
        impl,
        max_active_sequences=2,
        max_waiting_sequences=3,
        max_tokens_per_iteration=6,
        prefill_chunk_tokens=4,
        memory_components=[MemoryComponent("kv", 1000, 0, 1, 0)],
    )
    s.submit(Sequence("a", [7, 8], 4, None, 1))
    s.submit(seq("b", 6, 4))
    s.submit(Sequence("w", [9], 4, None, 1))
    plan = s.plan_iteration()
    assert [(w.sequence_id, len(w.tokens), w.sample_last) for w in plan.work] == [("a", 2, True), ("b", 4, False)]
    assert s.snapshot().waiting_ids == ["w"]
    return s, plan


def assert_unchanged(s, before):
    assert state(s) == before


# -- constructor -----------------------------------------------------------------------------------


def test_constructor_rejects_wrong_types(impl):
    with pytest.raises(TypeError):
        impl({"max_active_sequences": 4})
    with pytest.raises(TypeError):
        impl(SchedulerConfig(), admission="fcfs")
    with pytest.raises(TypeError):
        impl(SchedulerConfig(), preemption=3)


def test_negative_config_is_rejected_before_a_scheduler_exists():
    with pytest.raises(ValueError):
        SchedulerConfig(max_tokens_per_iteration=-1)
    with pytest.raises(TypeError):
        SchedulerConfig(max_waiting_sequences=None)


# -- submit -------------------------------------------------------------------------------------


def test_submit_empty_prompt(impl):
    s, _ = busy(impl)
    before = state(s)
    with pytest.raises(EmptyPrompt):
        s.submit(Sequence("e", [], 4))
    assert_unchanged(s, before)


@pytest.mark.parametrize("sequence_id", ["a", "w"], ids=["active", "waiting"])
def test_submit_duplicate(impl, sequence_id):
    s, _ = busy(impl)
    before = state(s)
    with pytest.raises(DuplicateSequence) as info:
        s.submit(seq(sequence_id, 3, 4))
    assert info.value.id == sequence_id
    assert_unchanged(s, before)


def test_submit_empty_prompt_is_checked_before_duplicates(impl):
    s, _ = busy(impl)
    with pytest.raises(EmptyPrompt):
        s.submit(Sequence("a", [], 4))


def test_submit_to_a_full_queue_only_counts_the_rejection(impl):
    s, _ = busy(impl)
    s.submit(seq("w2", 2, 4))
    s.submit(seq("w3", 2, 4))
    snap, metrics, sequences = state(s)
    with pytest.raises(QueueFull) as info:
        s.submit(seq("w4", 2, 4))
    assert info.value.capacity == 3
    snap2, metrics2, sequences2 = state(s)
    assert (snap2, sequences2) == (snap, sequences)
    assert metrics2.rejected_overload == metrics.rejected_overload + 1
    metrics2.rejected_overload -= 1
    assert metrics2 == metrics


def corrupt(field, value):
    def apply(x):
        setattr(x, field, value)
        return x

    return apply


def append_token(value):
    def apply(x):
        x.prompt_tokens.append(value)
        return x

    return apply


@pytest.mark.parametrize(
    "mutate, error",
    [
        (append_token(-1), ValueError),
        (append_token(1 << 31), ValueError),
        (append_token(True), TypeError),
        (append_token(2.0), TypeError),
        (append_token("3"), TypeError),
        (corrupt("generated_tokens", [5, -2]), ValueError),
        (corrupt("id", 17), TypeError),
        (corrupt("max_tokens", -1), ValueError),
        (corrupt("max_tokens", 1 << 32), ValueError),
        (corrupt("priority", -5), ValueError),
        (corrupt("priority", 1.5), TypeError),
        (corrupt("admission_tokens", -1), ValueError),
        (corrupt("prompt_tokens", None), TypeError),
        (corrupt("status", 3), TypeError),
        (corrupt("prefix_restore", 6), TypeError),
        (corrupt("cache_affinity", None), TypeError),
    ],
)
def test_submit_revalidates_mutated_fields(impl, mutate, error):
    s, _ = busy(impl)
    s.cancel("w")  # make room in the queue
    before = state(s)
    with pytest.raises(error):
        s.submit(mutate(seq("x", 3, 4)))
    assert_unchanged(s, before)


@pytest.mark.parametrize("value", [None, "x", ("x", [1], 4), 5])
def test_submit_rejects_non_sequences(impl, value):
    s, _ = busy(impl)
    before = state(s)
    with pytest.raises(TypeError):
        s.submit(value)
    assert_unchanged(s, before)


# -- observe / complete -------------------------------------------------------------------------


def test_stale_plan_after_completion(impl):
    s, plan = busy(impl)
    complete(s, plan, [pred(0, 1)])
    before = state(s)
    with pytest.raises(StalePlanError):
        s.observe_iteration_duration(plan, 0.01)
    with pytest.raises(StalePlanError):
        complete(s, plan, [pred(0, 1)])
    assert_unchanged(s, before)


def test_stale_plan_after_a_newer_plan(impl):
    s, plan = busy(impl)
    s.plan_iteration()
    before = state(s)
    with pytest.raises(ValueError):
        s.observe_iteration_duration(plan, 0.01)
    with pytest.raises(ValueError):
        complete(s, plan, [pred(0, 1)])
    assert_unchanged(s, before)


def test_plan_of_another_scheduler_is_not_live(impl):
    s, plan = busy(impl)
    other, other_plan = busy(impl)
    before = state(s)
    with pytest.raises(ValueError):
        complete(s, other_plan, [pred(0, 1)])
    with pytest.raises(ValueError):
        s.observe_iteration_duration(other_plan, 0.01)
    assert_unchanged(s, before)
    complete(s, plan, [pred(0, 1)])


@pytest.mark.parametrize("plan_value", [None, [], "plan", 3])
def test_plan_arguments_must_be_plans(impl, plan_value):
    s, plan = busy(impl)
    before = state(s)
    with pytest.raises(TypeError):
        s.observe_iteration_duration(plan_value, 0.01)
    with pytest.raises(TypeError):
        complete(s, plan_value, [])
    assert_unchanged(s, before)


@pytest.mark.parametrize("elapsed", [None, "10ms", True, [0.01]])
def test_observe_rejects_non_numbers(impl, elapsed):
    s, plan = busy(impl)
    before = state(s)
    with pytest.raises(TypeError):
        s.observe_iteration_duration(plan, elapsed)
    assert_unchanged(s, before)


@pytest.mark.parametrize("elapsed", [0.0, -1.0, math.nan, math.inf])
def test_observe_ignores_unusable_durations(impl, elapsed):
    s, plan = busy(impl)
    before = state(s)
    s.observe_iteration_duration(plan, elapsed)
    assert_unchanged(s, before)
    complete(s, plan, [pred(0, 1)])  # the plan is still live


@pytest.mark.parametrize(
    "predictions, error",
    [
        ([pred(2, 5)], MalformedOutputs),
        ([pred(0, 5), pred(0, 6)], MalformedOutputs),
        ([pred(1, 5)], MalformedOutputs),
    ],
)
def test_complete_rejects_bad_predictions(impl, predictions, error):
    s, plan = busy(impl)
    before = state(s)
    with pytest.raises(error):
        complete(s, plan, predictions)
    assert_unchanged(s, before)
    telemetry = complete(s, plan, [pred(0, 1)])
    assert telemetry.iteration == 1 and telemetry.failed_ids == []


@pytest.mark.parametrize(
    "entries, count",
    [([(2, 5)], 1), ([(0, 5), (0, 6)], 2), ([(1, 5)], 1), ([(0, 5)], 3)],
    ids=["out-of-range", "repeated", "non-sampling", "count-above-rows"],
)
def test_complete_rejects_bad_outputs_blocks(impl, entries, count):
    s, plan = busy(impl)
    before = state(s)
    with pytest.raises(ValueError):
        for k, (index, token) in enumerate(entries):
            plan.outputs.request_indexes[k] = index
            plan.outputs.predicted_tokens[k] = token
        plan.outputs.count = count
        s.complete_iteration(plan)
    assert_unchanged(s, before)
    plan.outputs.request_indexes[0] = 0
    plan.outputs.predicted_tokens[0] = 1
    plan.outputs.count = 1
    telemetry = s.complete_iteration(plan)
    assert telemetry.failed_ids == [] and list(s.sequence("a").generated_tokens) == [1]


def test_outputs_count_must_be_a_non_negative_int(impl):
    s, plan = busy(impl)
    with pytest.raises((TypeError, ValueError)):
        plan.outputs.count = -1
    with pytest.raises(TypeError):
        plan.outputs.count = 1.5
    assert plan.outputs.count == 0


def test_prediction_values_are_validated_at_construction():
    with pytest.raises(ValueError):
        IterationPrediction(0, (1 << 31))
    with pytest.raises(TypeError):
        IterationPrediction("0", 1)
    assert np.int32(-1) == IterationPrediction(0, np.int32(-1)).token


# -- preempt / cancel / sequence ---------------------------------------------------------------


@pytest.mark.parametrize(
    "used, error",
    [([-1], ValueError), ([1 << 64], ValueError), ([True], TypeError), ([1.5], TypeError), (["3"], TypeError),
     (None, TypeError), (7, TypeError), ("12", TypeError)],
)
def test_preempt_rejects_bad_byte_counts(impl, used, error):
    s, _ = busy(impl)
    before = state(s)
    with pytest.raises(error):
        s.preempt_for_component_pressure(used)
    assert_unchanged(s, before)


@pytest.mark.parametrize("value", [None, 3, b"a", ["a"]])
def test_cancel_and_sequence_reject_non_string_ids(impl, value):
    s, _ = busy(impl)
    before = state(s)
    with pytest.raises(TypeError):
        s.cancel(value)
    with pytest.raises(TypeError):
        s.sequence(value)
    assert_unchanged(s, before)
    assert s.cancel("nope") is False and s.sequence("nope") is None
    assert_unchanged(s, before)


def test_scheduler_stays_usable_after_errors(impl):
    s, plan = busy(impl)
    for bad in (lambda: s.submit(Sequence("e", [], 1)), lambda: complete(s, plan, [pred(9, 1)]),
                lambda: s.preempt_for_component_pressure([-1]), lambda: s.cancel(1)):
        with pytest.raises((ValueError, TypeError, AdmissionError)):
            bad()
    complete(s, plan, [pred(0, 3)])
    plan = s.plan_iteration()
    assert row_ids(plan) == ["b"]  # prefill first, then the decode of "a"
    complete(s, plan, [pred(0, 4)])
    plan = s.plan_iteration()
    assert sorted(row_ids(plan)) == ["a", "b"]
    every = set(s.snapshot().active_ids) | set(s.snapshot().waiting_ids)
    assert every == {"a", "b", "w"}


def test_ids_must_have_a_utf8_encoding(impl):
    s, _ = busy(impl)
    before = state(s)
    with pytest.raises(ValueError):
        Sequence("\ud800", [1], 1)
    with pytest.raises(ValueError):
        s.cancel("\udc00")
    with pytest.raises(ValueError):
        s.sequence("\udc00")
    assert_unchanged(s, before)
    s = make_scheduler(impl)
    for odd in ("", "a\x00b", "ñé✓", "x" * 5000):
        s.submit(Sequence(odd, [1], 1))
        assert s.sequence(odd).id == odd
    assert s.cancel("a\x00b") and s.sequence("a\x00b") is None and s.sequence("") is not None


@pytest.mark.parametrize("cls", [Scheduler, TwinScheduler])
def test_the_config_a_scheduler_gives_is_a_copy(cls):
    """Changing the config a scheduler reports changes nothing it does, nor what it reports
    next (an engine reads it to set itself up)."""
    s = cls(SchedulerConfig(max_active_sequences=3, max_tokens_per_iteration=64))
    got = s.config
    got.max_active_sequences = 1
    got.max_inflight_plans = 2
    assert s.config.max_active_sequences == 3 and s.config.max_inflight_plans == 1
    for i in range(3):
        s.submit(Sequence(f"r{i}", [1, 2], 4))
    assert len(s.plan_iteration()) == 3


# -- numbers past a double, bounds the core keeps ------------------------------------------------


def test_an_int_past_a_double_is_a_value_error_everywhere(impl):
    from skippy_scheduler.cost_model import StepCost
    from skippy_scheduler.policies import FairShareAdmission
    from skippy_scheduler.sampling import SamplingParams

    huge = 10 ** 400  # float() of it raises OverflowError
    s = make_scheduler(impl)
    before = state(s)
    calls = [lambda: s.set_clock(huge),
             lambda: Sequence("a", [1, 2], 2).with_deadlines(ttft_deadline=huge),
             lambda: SchedulerConfig(iteration_interval=huge),
             lambda: SchedulerConfig(slack_safety=huge),
             lambda: StepCost(base_us=huge),
             lambda: SamplingParams(temperature=huge),
             lambda: FairShareAdmission({"x": huge}),
             lambda: FairShareAdmission(prefill_cost=huge)]
    for call in calls:
        with pytest.raises(ValueError):
            call()
    assert_unchanged(s, before)


def test_a_session_address_past_a_size_t_is_a_value_error():
    s = Scheduler(SchedulerConfig())
    before = state(s)
    with pytest.raises(ValueError, match="session must be an address"):
        s.submit(seq("a", 2, 2), session=2 ** 64)
    assert_unchanged(s, before)


def test_more_plans_in_flight_than_the_core_keeps_are_refused(impl):
    with pytest.raises(ValueError, match=r"max_inflight_plans must be in \[0, 255\]"):
        SchedulerConfig(max_inflight_plans=256)
    s = make_scheduler(impl, max_inflight_plans=255)
    assert s.config.max_inflight_plans == 255


def test_admission_tokens_set_below_the_prompt_reserve_the_prompt(impl):
    # 90-token prompts against 100 tokens of KV: the field set to 0 must not let five in.
    s = make_scheduler(impl, max_active_sequences=8,
                       memory_components=[MemoryComponent("kv", 100, 0, 1, 0)])
    for i in range(5):
        q = seq(f"s{i}", 90, 4)
        q.admission_tokens = 0
        s.submit(q)
    s.plan_iteration()
    assert len(s.snapshot().active_ids) == 1
    assert s.sequence("s0").admission_tokens == 90
    assert s.snapshot().component_used_bytes == [("kv", 90)]


def test_metrics_of_a_scheduler_never_initialised_is_an_error():
    with pytest.raises(ValueError, match="scheduler is NULL"):
        Scheduler.__new__(Scheduler).metrics()


def test_fill_deferred_checks_its_source_plan():
    config = SchedulerConfig(max_inflight_plans=2)
    a, b = Scheduler(config), Scheduler(config)
    for s in (a, b):
        s.submit(Sequence("a", [1, 2, 3], 4))
    pa1, pb1 = a.plan_iteration(), b.plan_iteration()
    pa2 = a.plan_iteration()
    assert len(pa2.deferred_rows) == 1
    with pytest.raises(ValueError, match="another scheduler"):
        pa2.fill_deferred(pb1)
    pa1.native.outputs.count = 50_000_000  # a count a runtime could not fit
    with pytest.raises(MalformedOutputs, match="50000000 sampled outputs for a plan of 1 rows"):
        pa2.fill_deferred(pa1)


def test_a_prefix_store_serves_one_scheduler_native_or_twin():
    from skippy_scheduler import PrefixStore

    for first, second in ((Scheduler, TwinScheduler), (TwinScheduler, Scheduler)):
        store = PrefixStore(capacity_tokens=64)
        one, other = first(SchedulerConfig()), second(SchedulerConfig())
        one.attach_prefix_store(store)
        with pytest.raises(ValueError, match="serves another scheduler"):
            other.attach_prefix_store(store)
        assert other.prefix_store is None
        one.attach_prefix_store(None)
        other.attach_prefix_store(store)  # free again once detached
        assert other.prefix_store is store


def test_a_plan_array_kept_past_its_plan_stays_memory_of_its_own():
    # The token arena grows (16 prompts of 40 000-token chunks) while a host still holds an
    # array of the first plan: it keeps reading what it read, and writing through it touches nothing
    # the scheduler uses (the core keeps the old block until it is freed itself).
    config = SchedulerConfig(max_active_sequences=16, max_waiting_sequences=32,
                             max_tokens_per_iteration=1 << 22, prefill_chunk_tokens=40_000)
    s = Scheduler(config)
    s.submit(Sequence("a", list(range(1, 1000)), 1))
    plan = s.plan_iteration()
    kept = plan.tokens
    assert int(kept.sum()) == 499_500
    complete(s, plan, [(0, 5)])
    for i in range(16):
        s.submit(Sequence(f"b{i}", list(range(1, 1000)), 1))
    grown = s.plan_iteration()
    assert int(kept.sum()) == 499_500
    kept[:] = 7
    assert int(grown.tokens.sum()) == 16 * 499_500
    assert all(list(w.tokens) == list(range(1, 1000)) for w in grown.work)
    complete(s, grown, [(k, 5) for k in range(len(grown))])
    assert sorted(s.snapshot().active_ids) == []
