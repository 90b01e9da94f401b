"""The deliberate choices of docs/behaviour.md §0.4 (a–f) and other scheduler details (§2, §7)."""
import numpy as np
import pytest
from sched_helpers import affinity, complete, make_scheduler, pred, row_ids, seq

from skippy_scheduler import (
    IterationPhase,
    MalformedOutputs,
    MemoryComponent,
    PrefixRestore,
    Sequence,
    SequenceStatus,
)

Prefill, Recompute, Decode = IterationPhase.PREFILL, IterationPhase.RECOMPUTE, IterationPhase.DECODE


def test_a_active_sequences_are_walked_in_admission_order(impl):
    # §7.1's example: id order would give B 4 tokens, aa 2, zz nothing.
    s = make_scheduler(impl, max_tokens_per_iteration=6, prefill_chunk_tokens=4)
    for sequence_id in ("zz", "aa", "B"):
        s.submit(seq(sequence_id, 5, 4))
    plan = s.plan_iteration()
    assert [(w.sequence_id, len(w.tokens)) for w in plan.work] == [("zz", 4), ("aa", 2)]
    assert set(s.snapshot().active_ids) == {"zz", "aa", "B"}


def test_a_readmitted_sequence_walks_last(impl):
    s = make_scheduler(impl, memory_components=[MemoryComponent("kv", 1000, 0, 1, 0)])
    for sequence_id in ("a", "b", "c"):
        s.submit(seq(sequence_id, 2, 2))
    plan = s.plan_iteration()
    assert row_ids(plan) == ["a", "b", "c"]
    complete(s, plan, [pred(0, 5), pred(1, 5), pred(2, 5)])
    # Equal priorities: the newest admission ("c") is the victim; it comes back after "b".
    assert s.preempt_for_component_pressure([1000 + 4]) == ["c"]
    s.preempt_for_component_pressure([8])
    plan = s.plan_iteration()
    assert row_ids(plan) == ["c"] and plan.work[0].phase is Recompute
    complete(s, plan, [])
    plan = s.plan_iteration()
    assert row_ids(plan) == ["a", "b", "c"] and all(w.phase is Decode for w in plan.work)


def test_b_preempted_fully_restored_sequence_does_not_stall(impl):
    s = make_scheduler(impl, memory_components=[MemoryComponent("kv", 100, 0, 1, 0)])
    s.submit(seq("a", 4, 4).with_prefix_restore(PrefixRestore("page", 4)))
    plan = s.plan_iteration()
    assert [(list(w.tokens), list(w.positions), w.sample_last) for w in plan.work] == [([3], [3], True)]
    assert s.preempt_for_component_pressure([101]) == ["a"]
    s.preempt_for_component_pressure([0])
    assert s.sequence("a").prefill_cursor == 3
    assert s.sequence("a").status is SequenceStatus.PREEMPTED
    plan = s.plan_iteration()
    assert plan.admitted == 1
    assert [(list(w.tokens), list(w.positions), w.sample_last, w.phase) for w in plan.work] == [
        ([3], [3], True, Prefill)
    ]


def test_b_prefilled_generation_of_nothing_is_rejected():
    with pytest.raises(ValueError):
        seq("a", 2, 4).with_prefilled_generation([])


def test_c_admitted_at_is_a_strictly_increasing_admission_counter(impl):
    s = make_scheduler(impl, memory_components=[MemoryComponent("kv", 100, 0, 1, 0)])
    s.submit(seq("a", 2, 4))
    s.submit(seq("b", 2, 4))
    assert s.sequence("a").admitted_at is None
    s.plan_iteration()
    assert (s.sequence("a").admitted_at, s.sequence("b").admitted_at) == (1, 2)
    assert s.preempt_for_component_pressure([101]) == ["b"]
    assert s.sequence("b").admitted_at is None
    s.preempt_for_component_pressure([6])
    s.plan_iteration()
    assert s.sequence("b").admitted_at == 3 and s.sequence("a").admitted_at == 1


def test_d_sequence_id_limit_bounds_the_active_set(impl):
    s = make_scheduler(impl, max_active_sequences=32, sequence_id_limit=20, reserved_sequence_ids=16)
    assert s.config.max_active_sequences == 4
    for i in range(6):
        s.submit(seq(f"s{i}", 1, 1))
    plan = s.plan_iteration()
    assert plan.admitted == 4 and len(s.snapshot().waiting_ids) == 2


def test_d_sequence_id_limit_can_exceed_llama_max_seq(impl):
    s = make_scheduler(impl, max_active_sequences=2000, sequence_id_limit=1040, max_waiting_sequences=2000)
    assert s.config.max_active_sequences == 1024
    for i in range(1030):
        s.submit(seq(f"s{i:04d}", 1, 1))
    assert s.plan_iteration().admitted == 1024


def planned(impl):
    s = make_scheduler(impl, max_tokens_per_iteration=8, prefill_chunk_tokens=4)
    s.submit(Sequence("a", [7, 8], 4, None, 1))  # not a prefix of "b": "a" ranks first
    s.submit(seq("b", 6, 4))
    plan = s.plan_iteration()
    assert [(w.sequence_id, len(w.tokens), w.sample_last) for w in plan.work] == [("a", 2, True), ("b", 4, False)]
    return s, plan


@pytest.mark.parametrize(
    "predictions",
    [[pred(2, 7)], [pred(0, 7), pred(0, 7)], [pred(1, 7)], [pred(0, 1), pred(1, 7)]],
    ids=["out-of-range", "repeated", "non-sampling", "one-bad-among-good"],
)
def test_e_malformed_predictions_raise_and_leave_the_plan_live(impl, predictions):
    s, plan = planned(impl)
    before = (s.snapshot(), s.metrics(), s.sequence("a"), s.sequence("b"))
    with pytest.raises(MalformedOutputs):
        complete(s, plan, predictions)
    assert (s.snapshot(), s.metrics(), s.sequence("a"), s.sequence("b")) == before
    telemetry = complete(s, plan, [pred(0, 11)])
    assert telemetry.iteration == 1 and telemetry.prefill_tokens == 6
    assert list(s.sequence("a").generated_tokens) == [11]


def test_e_malformed_outputs_block_raises_the_same_way(impl):
    s, plan = planned(impl)
    before = (s.snapshot(), s.metrics())
    plan.outputs.request_indexes[0] = 1
    plan.outputs.predicted_tokens[0] = 9
    plan.outputs.count = 1
    with pytest.raises(ValueError):
        s.complete_iteration(plan)
    with pytest.raises(ValueError):
        plan.outputs.count = 3
        s.complete_iteration(plan)
    assert (s.snapshot(), s.metrics()) == before
    plan.outputs.request_indexes[0] = 0
    plan.outputs.count = 1
    telemetry = s.complete_iteration(plan)
    assert telemetry.failed_ids == [] and list(s.sequence("a").generated_tokens) == [9]


def test_missing_prediction_still_fails_only_its_sequence(impl):
    s = make_scheduler(impl)
    s.submit(seq("a", 2, 4))
    s.submit(seq("b", 2, 4))
    plan = s.plan_iteration()
    telemetry = complete(s, plan, [pred(1, 3)])
    assert telemetry.failed_ids == ["a"] and s.snapshot().active_ids == ["b"]


def test_max_tokens_zero_still_yields_one_token(impl):
    s = make_scheduler(impl)
    s.submit(seq("a", 2, 0))
    plan = s.plan_iteration()
    assert plan.work[0].sample_last
    telemetry = complete(s, plan, [pred(0, 7)])
    assert telemetry.finished_ids == ["a"] and s.metrics().finished == 1


def test_negative_prediction_finishes_without_appending(impl):
    s = make_scheduler(impl)
    s.submit(seq("a", 2, 4))
    complete(s, s.plan_iteration(), [pred(0, 5)])
    plan = s.plan_iteration()
    telemetry = complete(s, plan, [pred(0, -1)])
    assert telemetry.finished_ids == ["a"] and telemetry.decode_tokens == 1


def test_preemption_round_trip_replays_then_resumes_decode(impl):
    s = make_scheduler(impl, memory_components=[MemoryComponent("kv", 100, 0, 1, 0)])
    s.submit(seq("a", 4, 8))
    complete(s, s.plan_iteration(), [pred(0, 10)])
    plan = s.plan_iteration()
    assert [(list(w.tokens), list(w.positions), w.phase) for w in plan.work] == [([10], [4], Decode)]
    complete(s, plan, [pred(0, 11)])
    assert s.snapshot().component_used_bytes == [("kv", 12)]
    assert s.preempt_for_component_pressure([101]) == ["a"]
    assert s.snapshot().component_used_bytes == [("kv", 89)]
    s.preempt_for_component_pressure([0])
    view = s.sequence("a")
    assert view.status is SequenceStatus.PREEMPTED and view.prefill_cursor == 0
    assert list(view.generated_tokens) == [10, 11]
    m = s.metrics()
    assert (m.preempted, m.active_sequences, m.waiting_sequences) == (1, 0, 1)

    plan = s.plan_iteration()
    assert plan.admitted == 1 and plan.preempted == 0
    assert [(list(w.tokens), list(w.positions), w.phase, w.sample_last) for w in plan.work] == [
        ([0, 1, 2, 3, 10], [0, 1, 2, 3, 4], Recompute, False)
    ]
    telemetry = complete(s, plan, [])
    assert telemetry.recompute_tokens == 5 and telemetry.failed_ids == []
    plan = s.plan_iteration()
    assert [(list(w.tokens), list(w.positions), w.phase, w.sample_last) for w in plan.work] == [
        ([11], [5], Decode, True)
    ]
    complete(s, plan, [pred(0, 12)])
    assert list(s.sequence("a").generated_tokens) == [10, 11, 12]
    m = s.metrics()
    assert (m.prefill_tokens, m.recompute_tokens, m.decode_tokens, m.admitted) == (4, 5, 2, 2)


def test_preemption_prefers_lowest_priority_then_newest(impl):
    s = make_scheduler(impl, memory_components=[MemoryComponent("kv", 100, 0, 1, 0)])
    s.submit(seq("low-old", 2, 2, priority=1))
    s.submit(seq("high", 2, 2, priority=5))
    s.submit(seq("low-new", 2, 2, priority=1))
    s.plan_iteration()
    assert s.preempt_for_component_pressure([105]) == ["low-new", "low-old"]
    assert s.snapshot().waiting_ids[0] == "low-old"
    assert s.snapshot().component_used_bytes == [("kv", 97)]


def test_pressure_overwrites_only_the_given_components(impl):
    comps = [MemoryComponent("a", 100, 0, 1, 0), MemoryComponent("b", 100, 0, 1, 0)]
    s = make_scheduler(impl, memory_components=comps)
    s.submit(seq("x", 2, 2))
    s.plan_iteration()
    assert s.preempt_for_component_pressure([50]) == []
    assert s.snapshot().component_used_bytes == [("a", 50), ("b", 4)]
    assert s.preempt_for_component_pressure([1, 2, 3]) == []
    assert s.snapshot().component_used_bytes == [("a", 1), ("b", 2)]


def test_plan_surface_arrays(impl):
    s = make_scheduler(impl, max_tokens_per_iteration=8, prefill_chunk_tokens=4)
    s.submit(Sequence("a", [7, 8], 4, None, 1))  # not a prefix of "b": "a" ranks first
    s.submit(seq("b", 6, 4))
    plan = s.plan_iteration()
    assert len(plan) == 2 and plan.token_count == 6 and plan.admitted == 2 and plan.preempted == 0
    assert np.asarray(plan.tokens).tolist() == [7, 8, 0, 1, 2, 3]
    assert np.asarray(plan.positions).tolist() == [0, 1, 0, 1, 2, 3]
    assert np.asarray(plan.row_offsets).tolist() == [0, 2, 6]
    assert np.asarray(plan.sample_last).astype(bool).tolist() == [True, False]
    assert np.asarray(plan.phases).tolist() == [0, 0]
    assert np.asarray(plan.sample_rows).tolist() == [0]
    assert len(plan.outputs.request_indexes) == 2 and len(plan.outputs.predicted_tokens) == 2
    assert plan.outputs.count == 0


def test_telemetry_fields(impl):
    s = make_scheduler(impl, memory_components=[MemoryComponent("kv", 100, 10, 1, 2)])
    s.submit(seq("a", 3, 1).with_prefix_restore(PrefixRestore("p", 1)))
    s.submit(seq("b", 2, 4))
    plan = s.plan_iteration()
    t = complete(s, plan, [pred(0, 1), pred(1, 2)])
    assert (t.iteration, t.admitted, t.preempted, t.prefill_tokens, t.decode_tokens) == (1, 2, 0, 4, 0)
    assert (t.active_sequences, t.waiting_sequences, t.finished, t.failed) == (1, 0, 1, 0)
    assert (t.prefix_hits, t.prefix_misses, t.cancelled, t.rejected_overload) == (1, 1, 0, 0)
    assert t.component_used_bytes == [("kv", 8)]
    assert t.component_available_bytes == [("kv", 90)]
    assert t.finished_ids == ["a"] and t.failed_ids == []


def test_prediction_for_a_cancelled_sequence_is_ignored(impl):
    s = make_scheduler(impl)
    s.submit(seq("a", 2, 4))
    s.submit(seq("b", 2, 4))
    plan = s.plan_iteration()
    assert s.cancel("a")
    t = complete(s, plan, [pred(0, 3), pred(1, 4)])
    assert t.prefill_tokens == 4 and t.finished_ids == [] and t.failed_ids == []
    assert list(s.sequence("b").generated_tokens) == [4]


def test_f_a_new_plan_at_depth_one_aborts_the_live_one(impl):
    # §0.4f: the replaced plan's rows are undone, so its work is planned again and nothing is
    # stranded (a final prompt chunk whose sample never came would otherwise leave no work).
    s = make_scheduler(impl, max_tokens_per_iteration=4, prefill_chunk_tokens=4)
    s.submit(seq("a", 8, 4))
    first = s.plan_iteration()
    assert first.admitted == 1 and list(first.work[0].tokens) == [0, 1, 2, 3]
    second = s.plan_iteration()
    # Its admission stays (metrics count completed plans only, §7.18): nothing to admit now.
    assert list(second.work[0].tokens) == [0, 1, 2, 3] and second.admitted == 0
    with pytest.raises(ValueError):
        complete(s, first, [])
    complete(s, second, [])
    third = s.plan_iteration()
    assert list(third.work[0].tokens) == [4, 5, 6, 7] and third.work[0].sample_last
    fourth = s.plan_iteration()  # the final chunk's sample never came: it is planned again
    assert list(fourth.work[0].tokens) == [4, 5, 6, 7] and fourth.work[0].sample_last
    complete(s, fourth, [pred(0, 1)])
    m = s.metrics()
    assert m.iterations == 2 and m.prefill_tokens == 8 and m.admitted == 0
    assert m.aborted_plans == 2 and list(s.sequence("a").generated_tokens) == [1]


def test_submit_copies_the_callers_sequence(impl):
    s = make_scheduler(impl)
    mine = seq("a", 3, 4)
    s.submit(mine)
    mine.prompt_tokens.append(99)
    mine.prompt_tokens[0] = 55
    mine.max_tokens = 1
    mine.id = "z"
    view = s.sequence("a")
    assert list(view.prompt_tokens) == [0, 1, 2] and view.max_tokens == 4
    assert s.sequence("z") is None
    with pytest.raises(AttributeError):
        view.max_tokens = 7


def test_cancelling_a_waiting_sequence_reranks_the_queue(impl):
    # Companion of §6.1.20: a waiting-cancel marks the queue dirty.
    s = make_scheduler(impl, max_active_sequences=1)
    s.submit(Sequence("z", [2, 10], 1, None, 0))
    s.submit(Sequence("h", [5], 1, None, 0).with_cache_affinity(affinity(45)))
    s.submit(Sequence("x", [1, 2, 11], 1, None, 0))
    s.submit(Sequence("y", [1, 13], 1, None, 0))
    s.plan_iteration()
    assert s.snapshot().active_ids == ["h"] and s.snapshot().waiting_ids == ["x", "y", "z"]
    assert s.cancel("y") and s.cancel("h")
    s.plan_iteration()
    assert s.snapshot().active_ids == ["z"]  # without "y", "x" no longer leads a shared subtree


@pytest.mark.parametrize(
    "prompt, generated, cursor, expected",
    [
        ([1, 2, 3], [], 99, 2),  # would stall: keep the last prompt token runnable
        ([1, 2, 3], [], 3, 2),
        ([1], [], 1, 0),
        ([1, 2, 3], [4, 5], 99, 4),  # decode-ready: the pending token is never skipped
        ([1, 2, 3], [4, 5], 3, 3),  # caller-chosen replay point is kept
        ([1, 2], [7], 0, 0),
    ],
)
def test_submit_clamps_a_caller_set_cursor(impl, prompt, generated, cursor, expected):
    s = make_scheduler(impl)
    x = Sequence("x", prompt, 5, None, 1)
    x.generated_tokens = generated
    x.prefill_cursor = cursor
    x.admitted_at = 77
    x.enqueued_turn = 50
    x.enqueue_order = 9
    x.status = SequenceStatus.FINISHED  # kept as given until admission (§7.17)
    s.submit(x)
    view = s.sequence("x")
    assert view.prefill_cursor == expected
    assert (view.admitted_at, view.enqueued_turn, view.enqueue_order) == (None, 0, 0)
    assert view.status is SequenceStatus.FINISHED
    plan = s.plan_iteration()
    assert len(plan) == 1 and plan.work[0].positions[0] == expected
    assert s.sequence("x").status is SequenceStatus.RUNNING
