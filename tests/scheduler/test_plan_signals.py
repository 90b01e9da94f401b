"""What a plan and its telemetry tell the host, so it never reconstructs the scheduler's
decisions: which rows are new and what each restored (behaviour.md §1.3), and why every
sequence that ended did so (§1.5, §2.7). Each test runs on the twin and the native core."""
from dataclasses import fields

import pytest

from skippy_scheduler import (
    DuplicateSequence,
    EmptyPrompt,
    FinishReason,
    IterationPrediction,
    IterationTelemetry,
    MemoryComponent,
    PrefixRestore,
    QueueFull,
    RejectReason,
    SchedulerConfig,
    Sequence,
)
from sched_helpers import complete


def _new(plan):
    """(sequence id, restored tokens) of each new row, from the arrays; checked against work."""
    new = plan.new_rows.tolist()
    restored = plan.restored_tokens.tolist()
    assert new == [int(w.new_row) for w in plan.work]
    assert restored == [w.restored_tokens for w in plan.work]
    assert all(r == 0 for r, n in zip(restored, new) if not n)
    return [(w.sequence_id, r) for w, n, r in zip(plan.work, new, restored) if n]


def _complete(s, plan, tokens):
    """Complete `plan` with `tokens[row]` for each sampling row (None: no output)."""
    preds = [IterationPrediction(r, tokens[r]) for r in plan.sample_rows.tolist()
             if tokens.get(r) is not None]
    return complete(s, plan, preds)


def _tokens(plan, value=5):
    return {r: value for r in plan.sample_rows.tolist()}


def test_only_the_first_row_after_admission_is_new(impl):
    s = impl(SchedulerConfig(prefill_chunk_tokens=4, max_tokens_per_iteration=64))
    s.submit(Sequence("a", list(range(10)), 3))
    s.submit(Sequence("b", [1, 2], 3))
    plan = s.plan_iteration()
    assert _new(plan) == [("a", 0), ("b", 0)]
    _complete(s, plan, _tokens(plan))
    for _ in range(3):  # a's later chunks, then decode rows: none is new
        plan = s.plan_iteration()
        assert len(plan) and _new(plan) == []
        _complete(s, plan, _tokens(plan))


def test_a_sequence_admitted_before_its_first_row_gets_the_new_row_later(impl):
    s = impl(SchedulerConfig(max_prefill_sequences_per_iteration=1))
    s.submit(Sequence("a", [1, 2, 3], 4))
    s.submit(Sequence("b", [4, 5, 6], 4))
    plan = s.plan_iteration()
    assert plan.admitted == 2 and _new(plan) == [("a", 0)]
    _complete(s, plan, _tokens(plan))
    plan = s.plan_iteration()
    assert _new(plan) == [("b", 0)]


def test_a_restore_is_what_the_new_row_starts_after(impl):
    s = impl(SchedulerConfig())
    s.submit(Sequence("r", list(range(8)), 4).with_prefix_restore(PrefixRestore("page", 5)))
    plan = s.plan_iteration()
    assert _new(plan) == [("r", 5)]
    assert plan.work[0].positions[0] == 5


def test_a_sequence_that_arrives_decode_ready_gets_a_new_decode_row(impl):
    # Its first row is a decode row (the native core leaves its lean decode path for it).
    s = impl(SchedulerConfig())
    s.submit(Sequence("d", [1, 2, 3], 5).with_prefilled_generation([7]))
    plan = s.plan_iteration()
    assert [w.phase.value for w in plan.work] == [2]
    assert _new(plan) == [("d", 3)]
    _complete(s, plan, _tokens(plan))
    plan = s.plan_iteration()
    assert _new(plan) == []


def test_a_resume_after_preemption_is_new_again(impl):
    kv = MemoryComponent("kv", 1000, 0, 1, 0)
    s = impl(SchedulerConfig(memory_components=[kv]))
    s.submit(Sequence("p", list(range(6)), 4).with_prefix_restore(PrefixRestore("page", 2)))
    plan = s.plan_iteration()
    assert _new(plan) == [("p", 2)]
    _complete(s, plan, _tokens(plan))
    plan = s.plan_iteration()
    assert _new(plan) == []
    _complete(s, plan, _tokens(plan))
    assert s.preempt_for_component_pressure([2000]) == ["p"]
    assert s.preempt_for_component_pressure([0]) == []  # the pressure is gone: it fits again
    plan = s.plan_iteration()
    assert _new(plan) == [("p", 2)]  # replays from its restore, a recompute row


def test_an_aborted_new_row_makes_the_next_row_new(impl):
    s = impl(SchedulerConfig())
    s.submit(Sequence("a", [1, 2, 3], 4))
    plan = s.plan_iteration()
    assert _new(plan) == [("a", 0)]
    s.abort_iteration(plan)
    plan = s.plan_iteration()
    assert _new(plan) == [("a", 0)]
    # At depth 1 a new plan replaces (aborts) the live one, with the same effect.
    plan = s.plan_iteration()
    assert _new(plan) == [("a", 0)]


def test_in_flight_plans_flag_only_the_first_plan_row(impl):
    s = impl(SchedulerConfig(max_inflight_plans=2))
    s.submit(Sequence("a", [1, 2], 5))
    first = s.plan_iteration()
    second = s.plan_iteration()
    assert _new(first) == [("a", 0)] and _new(second) == []


def test_every_ended_sequence_has_its_finish_reason_in_plan_order(impl):
    s = impl(SchedulerConfig(max_active_sequences=4))
    s.submit(Sequence("len", [1, 2, 3], 2))
    s.submit(Sequence("stop", [4, 5], 5))
    s.submit(Sequence("fail", [6], 5))
    s.submit(Sequence("on", [7], 5))
    plan = s.plan_iteration()
    t = _complete(s, plan, _tokens(plan, 10))
    assert t.finish_reasons == {}
    plan = s.plan_iteration()
    rows = {w.sequence_id: r for r, w in enumerate(plan.work)}
    t = _complete(s, plan, {rows["len"]: 11, rows["stop"]: -1, rows["on"]: 3})
    assert list(t.finish_reasons.items()) == [
        ("len", FinishReason.LENGTH), ("stop", FinishReason.STOP), ("fail", FinishReason.FAILED)]
    assert list(t.finish_reasons) == [w.sequence_id for w in plan.work
                                      if w.sequence_id in t.finish_reasons]
    assert set(t.finish_reasons) == set(t.finished_ids) | set(t.failed_ids)
    assert FinishReason.STOP.value == "stop" and FinishReason.LENGTH.value == "length"


def test_rejections_carry_a_typed_reason(impl):
    s = impl(SchedulerConfig(max_waiting_sequences=1))
    s.submit(Sequence("a", [1], 2))
    with pytest.raises(DuplicateSequence) as dup:
        s.submit(Sequence("a", [1], 2))
    with pytest.raises(QueueFull) as full:
        s.submit(Sequence("b", [1], 2))
    assert (dup.value.reason, full.value.reason) == (RejectReason.DUPLICATE,
                                                     RejectReason.QUEUE_FULL)
    assert EmptyPrompt().reason is RejectReason.EMPTY_PROMPT


def _busy_telemetry(impl):
    """A completion in which every telemetry field has a value other than its default."""
    kv = MemoryComponent("kv", 10_000, 100, 1, 0)
    s = impl(SchedulerConfig(max_active_sequences=3, max_waiting_sequences=4,
                             memory_components=[kv]))
    s.submit(Sequence("x", [1], 1).with_prefix_restore(PrefixRestore("page", 1)))
    s.submit(Sequence("gone", [9], 4))
    s.cancel("gone")
    for k in range(3):
        s.submit(Sequence(f"s{k}", [k + 1, k + 2], 3))
    with pytest.raises(QueueFull):
        s.submit(Sequence("over", [1], 1))
    plan = s.plan_iteration()
    tokens = _tokens(plan, 4)
    tokens[[w.sequence_id for w in plan.work].index("s1")] = None  # fails
    return _complete(s, plan, tokens)


def test_telemetry_fields_follow_the_core():
    """The native core fills IterationTelemetry field by field in declaration order; a field
    added to the dataclass and left out there would stay at its default and differ here."""
    from skippy_scheduler import Scheduler, TwinScheduler

    native, twin = _busy_telemetry(Scheduler), _busy_telemetry(TwinScheduler)
    assert native == twin
    defaults = IterationTelemetry()
    unset = [f.name for f in fields(IterationTelemetry)
             if getattr(native, f.name) == getattr(defaults, f.name)]
    # preempted is always 0 from a plan, a first plan has neither recompute nor decode rows,
    # and no store is attached (no refresh, no prompt to keep); a new field must be given a
    # value here (and in both cores).
    assert unset == ["preempted", "recompute_tokens", "decode_tokens", "stale_refreshes",
                     "prompt_keeps"]
