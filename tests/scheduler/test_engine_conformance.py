"""behaviour.md §6.1: the engine conformance cases, on every scheduler implementation."""
import pytest
from sched_helpers import affinity, complete, make_scheduler, pred, row_ids, seq

from skippy_scheduler import (
    IterationPhase,
    MemoryComponent,
    PrefixRestore,
    PrefixRestoreKind,
    QueueFull,
    Sequence,
)

Prefill, Recompute, Decode = IterationPhase.PREFILL, IterationPhase.RECOMPUTE, IterationPhase.DECODE


def calibrated_decoder(s, sequence_id, prompt_len, max_tokens, prefill_seconds=None):
    """Prefill `sequence_id` (token 42), then one decode-only plan observed at 10 ms (token 43)."""
    s.submit(seq(sequence_id, prompt_len, max_tokens))
    plan = s.plan_iteration()
    assert row_ids(plan) == [sequence_id] and plan.work[0].sample_last
    if prefill_seconds is not None:
        s.observe_iteration_duration(plan, prefill_seconds)
    complete(s, plan, [pred(0, 42)])
    plan = s.plan_iteration()
    assert [w.phase for w in plan.work] == [Decode]
    s.observe_iteration_duration(plan, 0.010)
    complete(s, plan, [pred(0, 43)])


def test_01_iteration_separates_prefill_and_decode_without_replaying_final_prompt_token(impl):
    s = make_scheduler(impl, max_tokens_per_iteration=8, prefill_chunk_tokens=4)
    s.submit(seq("decode", 2, 4))
    plan = s.plan_iteration()
    assert row_ids(plan) == ["decode"] and plan.work[0].sample_last
    complete(s, plan, [pred(0, 42)])
    s.submit(seq("prefill", 8, 4))

    plan = s.plan_iteration()
    assert len(plan) == 1
    row = plan.work[0]
    assert (row.sequence_id, row.phase, row.sample_last) == ("prefill", Prefill, False)
    assert list(row.tokens) == [0, 1, 2, 3]
    complete(s, plan, [])

    plan = s.plan_iteration()
    assert len(plan) == 1
    row = plan.work[0]
    assert (row.sequence_id, row.phase, row.sample_last) == ("prefill", Prefill, True)
    assert list(row.tokens) == [4, 5, 6, 7]
    complete(s, plan, [pred(0, 100)])

    plan = s.plan_iteration()
    assert all(w.phase is Decode for w in plan.work)
    decode_rows = [w for w in plan.work if w.sequence_id == "decode"]
    assert len(decode_rows) == 1
    assert list(decode_rows[0].tokens) == [42] and list(decode_rows[0].positions) == [2]
    assert plan.token_count == 2


def test_02_prefilled_generation_resumes_at_the_next_decode_position(impl):
    s = make_scheduler(impl)
    s.submit(seq("resumed", 3, 4).with_prefilled_generation([42]))
    plan = s.plan_iteration()
    assert len(plan) == 1
    row = plan.work[0]
    assert (row.phase, list(row.tokens), list(row.positions), row.sample_last) == (Decode, [42], [3], True)


def test_03_bounded_prefill_iterations_allow_live_decode_progress(impl):
    s = make_scheduler(impl, max_tokens_per_iteration=8, prefill_chunk_tokens=4, max_consecutive_prefill_iterations=1)
    s.submit(seq("decode", 2, 4))
    complete(s, s.plan_iteration(), [pred(0, 42)])
    s.submit(seq("prefill", 8, 4))
    plan = s.plan_iteration()
    assert [(w.sequence_id, w.phase) for w in plan.work] == [("prefill", Prefill)]
    complete(s, plan, [])
    plan = s.plan_iteration()
    assert [(w.sequence_id, w.phase) for w in plan.work] == [("decode", Decode)]
    complete(s, plan, [pred(0, 43)])
    plan = s.plan_iteration()
    assert [(w.sequence_id, w.phase) for w in plan.work] == [("prefill", Prefill)]


def test_04_mixed_iteration_schedules_decode_first_and_fills_remaining_budget(impl):
    s = make_scheduler(impl, max_tokens_per_iteration=5, prefill_chunk_tokens=5, mixed_prefill_decode=True)
    calibrated_decoder(s, "decode", 2, 4, prefill_seconds=200e-6)
    s.submit(seq("prefill", 8, 4))
    plan = s.plan_iteration()
    assert plan.token_count == 5
    assert [(w.sequence_id, w.phase) for w in plan.work] == [("decode", Decode), ("prefill", Prefill)]
    assert list(plan.work[0].tokens) == [43]
    assert list(plan.work[1].tokens) == [0, 1, 2, 3] and not plan.work[1].sample_last


def test_05_mixed_decode_budget_rotates_across_all_live_sequences(impl):
    s = make_scheduler(impl, max_active_sequences=3, max_tokens_per_iteration=2, mixed_prefill_decode=True)
    for x in "abc":
        s.submit(Sequence(x, [1], 10, None, 1).with_prefilled_generation([42]))
    plan = s.plan_iteration()
    assert row_ids(plan) == ["a", "b"] and all(w.phase is Decode for w in plan.work)
    s.observe_iteration_duration(plan, 0.001)
    complete(s, plan, [pred(0, 43), pred(1, 44)])
    assert completed_rows(s, 3) == [["a", "b"], ["c", "a"], ["b", "c"]]


def completed_rows(s, n):
    """Row ids of `n` plans, each completed with a token for every sampling row (a plan that is
    replaced before completion is undone, §0.4f, so the rotation only moves on completion)."""
    observed = []
    for _ in range(n):
        plan = s.plan_iteration()
        observed.append(row_ids(plan))
        complete(s, plan, [pred(i, 50) for i in plan.sample_rows.tolist()])
    return observed


def test_05b_mixed_decode_cursor_advances_by_sequences_examined(impl):
    # A fourth active sequence with no live decode still moves the rotation cursor.
    s = make_scheduler(impl, max_active_sequences=4, max_tokens_per_iteration=2, mixed_prefill_decode=True)
    for x in "abc":
        s.submit(Sequence(x, [1], 10, None, 1).with_prefilled_generation([42]))
    plan = s.plan_iteration()
    s.observe_iteration_duration(plan, 0.001)
    complete(s, plan, [pred(0, 43), pred(1, 44)])
    s.submit(Sequence("d", [5, 6, 7, 8, 9, 10], 10, None, 1))
    assert completed_rows(s, 4) == [["a", "b"], ["c", "a"], ["b", "c"], ["a", "b"]]


def test_06_duration_aware_mixed_admission_caps_slow_prompt_work(impl):
    s = make_scheduler(impl, max_tokens_per_iteration=128, prefill_chunk_tokens=128, mixed_prefill_decode=True)
    calibrated_decoder(s, "decode", 2, 8)
    s.submit(seq("prefill", 256, 4))
    plan = s.plan_iteration()
    assert [w.phase for w in plan.work] == [Decode, Prefill]
    assert len(plan.work[1].tokens) == 127
    s.observe_iteration_duration(plan, 0.170)
    complete(s, plan, [pred(0, 44)])
    plan = s.plan_iteration()
    assert len(plan) == 1 and plan.work[0].phase is Prefill
    assert len(plan.work[0].tokens) == 128 and plan.token_count == 128


def test_07_mixed_admission_waits_for_the_matching_decode_row_baseline(impl):
    s = make_scheduler(
        impl, max_active_sequences=3, max_tokens_per_iteration=128, prefill_chunk_tokens=128, mixed_prefill_decode=True
    )
    calibrated_decoder(s, "d1", 2, 4)
    s.submit(seq("d2", 2, 4))
    plan = s.plan_iteration()
    assert [(w.sequence_id, w.phase, len(w.tokens), w.sample_last) for w in plan.work] == [
        ("d1", Decode, 1, True),
        ("d2", Prefill, 2, True),
    ]
    complete(s, plan, [pred(0, 44), pred(1, 50)])
    s.submit(seq("prefill", 256, 4))
    plan = s.plan_iteration()
    assert [(w.sequence_id, w.phase, len(w.tokens)) for w in plan.work] == [("prefill", Prefill, 128)]


def test_08_duration_aware_mixed_admission_keeps_cheap_prompt_work(impl):
    s = make_scheduler(impl, max_tokens_per_iteration=128, prefill_chunk_tokens=128, mixed_prefill_decode=True)
    calibrated_decoder(s, "decode", 2, 8)
    s.submit(seq("prefill", 256, 4))
    plan = s.plan_iteration()
    assert [w.phase for w in plan.work] == [Decode, Prefill]
    s.observe_iteration_duration(plan, 0.018)  # extra exactly 8 000 µs: not above the allowance
    complete(s, plan, [pred(0, 44)])
    plan = s.plan_iteration()
    assert [(w.sequence_id, w.phase) for w in plan.work] == [("decode", Decode), ("prefill", Prefill)]


def test_09_sparse_iteration_predictions_map_to_their_explicit_work_rows(impl):
    s = make_scheduler(
        impl, max_active_sequences=3, max_tokens_per_iteration=8, prefill_chunk_tokens=4, mixed_prefill_decode=True
    )
    calibrated_decoder(s, "a-decode", 2, 4, prefill_seconds=200e-6)
    s.submit(seq("b-prefill", 8, 4))
    s.submit(seq("c-final", 2, 4))
    plan = s.plan_iteration()
    assert [(w.sequence_id, w.phase, len(w.tokens), w.sample_last) for w in plan.work] == [
        ("a-decode", Decode, 1, True),
        ("b-prefill", Prefill, 4, False),
        ("c-final", Prefill, 2, True),
    ]
    assert plan.token_count == 7
    complete(s, plan, [pred(0, 44), pred(2, 99)])
    assert list(s.sequence("a-decode").generated_tokens) == [42, 43, 44]
    assert list(s.sequence("c-final").generated_tokens) == [99]
    assert s.sequence("b-prefill") is not None
    assert list(s.sequence("b-prefill").generated_tokens) == []


def two_components():
    return [
        MemoryComponent("full-attention", 10_000, 0, 1, 0),
        MemoryComponent("recurrent", 1_024, 0, 0, 1_024),
    ]


def test_10_admission_uses_effective_minimum_across_components(impl):
    s = make_scheduler(impl, max_active_sequences=8, memory_components=two_components())
    s.submit(seq("a", 10, 10))
    s.submit(seq("b", 10, 10))
    plan = s.plan_iteration()
    assert plan.admitted == 1
    snap = s.snapshot()
    assert snap.active_ids == ["a"] and snap.waiting_ids == ["b"]
    assert snap.component_used_bytes == [("full-attention", 20), ("recurrent", 1_024)]


def test_11_admission_groups_the_heaviest_waiting_prefix_subtree(impl):
    s = make_scheduler(impl, max_active_sequences=1)
    s.submit(Sequence("unique", [9, 9, 9], 1, None, 0))
    s.submit(Sequence("shared-a", [1, 2, 3], 1, None, 0))
    s.submit(Sequence("shared-b", [1, 2, 4], 1, None, 0))
    plan = s.plan_iteration()
    assert plan.admitted == 1
    assert s.snapshot().active_ids == ["shared-a"]


def test_12_prefill_sequence_limit_serializes_recurrent_prefills(impl):
    s = make_scheduler(impl, max_active_sequences=2, max_prefill_sequences_per_iteration=1)
    s.submit(seq("a", 2, 1))
    s.submit(seq("b", 2, 1))
    plan = s.plan_iteration()
    assert row_ids(plan) == ["a"]
    telemetry = complete(s, plan, [pred(0, 10)])
    assert telemetry.finished_ids == ["a"]
    assert row_ids(s.plan_iteration()) == ["b"]


def test_13_prefix_restore_skips_only_the_restored_token_span(impl):
    s = make_scheduler(impl)
    s.submit(seq("a", 8, 4).with_prefix_restore(PrefixRestore("page", 6, PrefixRestoreKind.RECURRENT_WHOLE_STATE)))
    plan = s.plan_iteration()
    assert len(plan) == 1
    assert list(plan.work[0].tokens) == [6, 7] and list(plan.work[0].positions) == [6, 7]
    assert s.metrics().prefix_hits == 1 and s.metrics().prefix_misses == 0


def test_14_full_prefix_restore_replays_the_final_token_for_logits(impl):
    s = make_scheduler(impl)
    s.submit(seq("a", 8, 4).with_prefix_restore(PrefixRestore("page", 8, PrefixRestoreKind.RESIDENT_KV)))
    plan = s.plan_iteration()
    assert len(plan) == 1
    row = plan.work[0]
    assert (list(row.tokens), list(row.positions), row.sample_last) == ([7], [7], True)


def test_15_overload_is_rejected_before_native_decode(impl):
    s = make_scheduler(impl, max_waiting_sequences=1)
    s.submit(seq("a", 2, 4))
    with pytest.raises(QueueFull) as info:
        s.submit(seq("b", 2, 4))
    assert info.value.capacity == 1
    assert info.value == QueueFull(1)
    assert s.metrics().rejected_overload == 1
    assert s.snapshot().waiting_ids == ["a"]


@pytest.mark.parametrize("via_outputs", [False, True], ids=["empty-list", "empty-outputs"])
def test_16_missing_sample_prediction_fails_instead_of_finishing_sequence(impl, via_outputs):
    s = make_scheduler(impl)
    s.submit(seq("a", 2, 4))
    plan = s.plan_iteration()
    telemetry = s.complete_iteration(plan) if via_outputs else complete(s, plan, [])
    assert s.sequence("a") is None
    assert s.snapshot().active_ids == []
    m = s.metrics()
    assert (m.failed, m.finished) == (1, 0)
    assert telemetry.failed_ids == ["a"] and telemetry.finished_ids == []


def test_17_cancellation_releases_memory_and_removes_waiting_or_active_sequence(impl):
    s = make_scheduler(impl, memory_components=[MemoryComponent("kv", 16, 0, 1, 0)])
    s.submit(seq("active", 2, 4).with_admission_tokens(8))
    s.submit(seq("waiting", 2, 4).with_admission_tokens(16))
    s.plan_iteration()
    snap = s.snapshot()
    assert snap.active_ids == ["active"] and snap.waiting_ids == ["waiting"]
    assert snap.component_used_bytes == [("kv", 8)]
    assert s.cancel("active") is True
    assert s.cancel("waiting") is True
    snap = s.snapshot()
    assert snap.active_ids == [] and snap.waiting_ids == []
    assert snap.component_used_bytes == [("kv", 0)]
    assert s.metrics().cancelled == 2
    assert s.cancel("active") is False


def test_18_repeated_component_preemption_preserves_aging_credit(impl):
    s = make_scheduler(
        impl, max_active_sequences=1, cache_aging_cost_per_iteration=10, memory_components=[MemoryComponent("kv", 2, 0, 1, 0)]
    )
    s.submit(seq("cold", 2, 4).with_admission_tokens(1))
    first = s.plan_iteration()
    assert first.admitted == 1 and row_ids(first) == ["cold"]
    rows = [(list(w.tokens), list(w.positions)) for w in first.work]
    for _ in range(9):
        # Each new plan aborts the uncompleted one and plans the same work again (§0.4f);
        # the waiting turn still advances every time.
        again = s.plan_iteration()
        assert [(list(w.tokens), list(w.positions)) for w in again.work] == rows
    for hot in ("hot-a", "hot-b"):
        assert s.preempt_for_component_pressure([3]) == ["cold"]
        assert s.preempt_for_component_pressure([0]) == []
        s.submit(seq(hot, 2, 4).with_admission_tokens(1).with_cache_affinity(affinity(80)))
        s.plan_iteration()
        assert s.snapshot().active_ids == ["cold"]
        assert s.sequence("cold").enqueued_turn == 0
    assert s.snapshot().waiting_ids == ["hot-a", "hot-b"]
    assert s.metrics().preempted == 2


@pytest.mark.parametrize(
    "observations, mixed_ms, still_mixed",
    [
        ([0.010, 0.020], 20.4, True),
        ([0.010, 0.020], 21.0, False),
        ([0.050], 59.0, True),
        ([0.050], 61.0, False),
        ([0.150], 169.0, True),
        ([0.150], 171.0, False),
    ],
)
def test_19_mixed_viability_constants(impl, observations, mixed_ms, still_mixed):
    s = make_scheduler(impl, max_tokens_per_iteration=128, prefill_chunk_tokens=128, mixed_prefill_decode=True)
    s.submit(seq("d", 2, 100))
    complete(s, s.plan_iteration(), [pred(0, 5)])
    for seconds in observations:
        plan = s.plan_iteration()
        assert [w.phase for w in plan.work] == [Decode]
        s.observe_iteration_duration(plan, seconds)
        complete(s, plan, [pred(0, 5)])
    s.submit(seq("p", 1000, 4))
    plan = s.plan_iteration()
    assert [(w.sequence_id, w.phase) for w in plan.work] == [("d", Decode), ("p", Prefill)]
    s.observe_iteration_duration(plan, mixed_ms / 1000.0)
    complete(s, plan, [pred(0, 5)])
    plan = s.plan_iteration()
    expected = [("d", Decode), ("p", Prefill)] if still_mixed else [("p", Prefill)]
    assert [(w.sequence_id, w.phase) for w in plan.work] == expected


def test_20_cancelling_an_active_sequence_does_not_rerank_waiting(impl):
    s = make_scheduler(impl, max_active_sequences=1)
    s.submit(Sequence("r0", [2, 10], 1, None, 0))
    s.submit(Sequence("r1", [1, 2, 11], 1, None, 0))
    s.submit(Sequence("r2", [1, 12], 1, None, 0).with_cache_affinity(affinity(45)))
    s.plan_iteration()
    snap = s.snapshot()
    assert snap.active_ids == ["r2"] and snap.waiting_ids == ["r1", "r0"]
    assert s.cancel("r2") is True
    s.plan_iteration()
    assert s.snapshot().active_ids == ["r1"]
