"""The numpy views of a native plan always cover the plan's current native arrays.

Regression: the views were rebuilt only when the `requests` (or `tokens`) array moved, but
every plan array is reallocated on its own when the plan grows. When `requests` happened to
grow in place the outputs block and the other views kept pointing at freed memory, and a
runtime writing its sampled outputs corrupted the heap (found by bench/soak.py).
"""
from skippy_scheduler import Scheduler, SchedulerConfig, Sequence
from skippy_scheduler._abi import ffi


def address(pointer):
    return int(ffi.cast("uintptr_t", pointer))


def assert_views_match(plan):
    native = plan.native
    rows = len(plan)
    assert plan.tokens.ctypes.data == address(native.tokens) or plan.token_count == 0
    assert plan.positions.ctypes.data == address(native.positions) or plan.token_count == 0
    assert plan.row_offsets.ctypes.data == address(native.row_offsets)
    if rows:
        assert plan.sample_last.ctypes.data == address(native.sample_last)
        assert plan.phases.ctypes.data == address(native.phases)
        assert plan.slots.ctypes.data == address(native.slots)
        assert plan.outputs.request_indexes.ctypes.data == address(native.outputs.sampled_request_indexes)
        assert plan.outputs.predicted_tokens.ctypes.data == address(native.outputs.predicted_tokens)
        assert len(plan.outputs.request_indexes) >= rows


def test_views_follow_every_growth_of_the_plan_arrays():
    s = Scheduler(SchedulerConfig(max_active_sequences=200, sequence_id_limit=1024, max_waiting_sequences=1000,
                                  max_tokens_per_iteration=4096, prefill_chunk_tokens=8))
    n = 0
    for step in range(60):
        for _ in range(step % 7 + 1):  # the active set, and so the plan's capacity, keeps growing
            s.submit(Sequence(f"s{n}", [n % 50 + 1] * (1 + n % 5), 1000))
            n += 1
        plan = s.plan_iteration()
        assert_views_match(plan)
        rows = plan.sample_rows
        k = len(rows)
        plan.outputs.request_indexes[:k] = rows
        plan.outputs.predicted_tokens[:k] = 7
        plan.outputs.count = k
        telemetry = s.complete_iteration(plan)
        assert telemetry.failed_ids == []
    assert len(s.snapshot().active_ids) == 200
    # Sampled tokens went to the right sequences through the block.
    assert list(s.sequence("s0").generated_tokens) == [7] * len(s.sequence("s0").generated_tokens) != []
