"""Plans are views of native memory: numpy arrays, cffi rows and the output block share it."""
import numpy as np
import pytest

from skippy_scheduler import (
    IterationPhase,
    MalformedOutputs,
    Scheduler,
    SchedulerConfig,
    Sequence,
    StalePlanError,
)
from skippy_scheduler._abi import ffi


def _sched(**kw):
    return Scheduler(SchedulerConfig(**kw))


def test_writes_through_plan_tokens_are_seen_by_the_request_rows():
    s = _sched(prefill_chunk_tokens=4, max_tokens_per_iteration=16)
    s.submit(Sequence("a", [5, 6, 7, 8, 9], 4))
    s.submit(Sequence("b", [1, 2], 4))
    plan = s.plan_iteration()
    assert len(plan) == 2
    req = plan.requests
    assert ffi.typeof(req) is ffi.typeof("skippy_iteration_request *")
    assert ffi.sizeof("skippy_iteration_request") == 72
    tokens = plan.tokens
    offs = plan.row_offsets
    assert list(offs) == [0, 4, 6]
    assert [req[0].token_ids[i] for i in range(4)] == [5, 6, 7, 8]
    tokens[0] = 4242
    tokens[5] = -7
    assert req[0].token_ids[0] == 4242
    assert req[1].token_ids[1] == -7
    # token_ids point into the arena itself, row by row.
    base = int(ffi.cast("uintptr_t", req[0].token_ids))
    assert tokens.ctypes.data == base
    assert int(ffi.cast("uintptr_t", req[1].token_ids)) == base + 4 * 4
    assert req[1].token_count == 2 and req[1].position_count == 2
    assert [req[1].positions[i] for i in range(2)] == [0, 1]
    assert bool(req[1].sample_last) is True and bool(req[0].sample_last) is False
    assert list(plan.sample_rows) == [1]
    assert list(plan.phases) == [IterationPhase.PREFILL.value] * 2


def test_output_block_is_the_native_compact_outputs():
    s = _sched()
    s.submit(Sequence("a", [1, 2, 3], 2))
    plan = s.plan_iteration()
    out = plan.outputs
    native = plan.native
    out.request_indexes[0] = 0
    out.predicted_tokens[0] = 77
    out.count = 1
    assert native.outputs.count == 1
    assert native.outputs.sampled_request_indexes[0] == 0
    assert native.outputs.predicted_tokens[0] == 77
    assert out.request_indexes.ctypes.data == int(ffi.cast("uintptr_t", native.outputs.sampled_request_indexes))
    telem = s.complete_iteration(plan)
    assert telem.prefill_tokens == 3
    assert s.sequence("a").generated_tokens == (77,)


def test_native_host_can_write_outputs_through_cffi():
    s = _sched()
    for i in range(3):
        s.submit(Sequence(f"s{i}", [i + 1], 3))
    plan = s.plan_iteration()
    p = plan.native
    # What a runtime's skippy_iteration_batch_sampled does: compact entries in row order.
    for k in range(p.request_count):
        p.outputs.sampled_request_indexes[k] = k
        p.outputs.predicted_tokens[k] = 100 + k
    p.outputs.count = p.request_count
    s.complete_iteration(plan)
    assert [s.sequence(f"s{i}").generated_tokens for i in range(3)] == [(100,), (101,), (102,)]


def test_views_are_stable_between_plans_and_stale_plans_raise():
    s = _sched()
    s.submit(Sequence("a", [1, 2, 3], 5))
    p1 = s.plan_iteration()
    addr = p1.tokens.ctypes.data
    p1.outputs.request_indexes[0] = 0
    p1.outputs.predicted_tokens[0] = 9
    p1.outputs.count = 1
    s.complete_iteration(p1)
    with pytest.raises(StalePlanError):
        p1.tokens
    with pytest.raises(StalePlanError):
        s.complete_iteration(p1)
    p2 = s.plan_iteration()
    assert p2.tokens.ctypes.data == addr
    assert list(p2.tokens) == [9] and list(p2.positions) == [3]
    p3 = s.plan_iteration()  # replaces p2 without completing it
    with pytest.raises(StalePlanError):
        s.observe_iteration_duration(p2, 0.001)
    # The pending token was never completed, so it is decoded again (docs/behaviour.md §0.4f).
    assert [(w.tokens, w.positions) for w in p3.work] == [((9,), (3,))]


def test_malformed_output_block_raises_and_leaves_the_plan_live():
    s = _sched()
    s.submit(Sequence("a", [1], 3))
    s.submit(Sequence("b", [2], 3))
    plan = s.plan_iteration()
    before = (s.snapshot(), s.metrics())
    out = plan.outputs
    out.request_indexes[:2] = [0, 0]
    out.predicted_tokens[:2] = [1, 2]
    out.count = 2
    with pytest.raises(MalformedOutputs):
        s.complete_iteration(plan)
    out.request_indexes[1] = 5
    with pytest.raises(MalformedOutputs):
        s.complete_iteration(plan)
    assert (s.snapshot(), s.metrics()) == before
    with pytest.raises(ValueError):
        out.count = out.capacity + 1
    out.request_indexes[1] = 1
    s.complete_iteration(plan)
    assert s.sequence("a").generated_tokens == (1,)
    assert s.sequence("b").generated_tokens == (2,)


def test_sampling_config_pointer_travels_in_each_row():
    cfg = ffi.new("skippy_sampling_config *")
    cfg.version = 1
    cfg.flags = 1
    cfg.temperature = 0.5
    s = _sched()
    s.submit(Sequence("a", [1, 2], 3, sampling=cfg))
    plan = s.plan_iteration()
    assert plan.requests[0].sampling == cfg
    assert plan.work[0].sampling is cfg


def test_views_follow_plan_arrays_when_they_grow():
    # The arena and the row arrays grow as more sequences become active; every view must follow
    # its own array (a realloc may move one array and not another, or grow one in place).
    for trial in range(200):
        s = _sched(max_active_sequences=2 + trial % 3, max_tokens_per_iteration=512)
        pending = [Sequence(f"w{i}", [1, 300 + i, 301, 302], 4) for i in range(5)]
        s.submit(pending.pop(0))
        it = 0
        while True:
            if pending and it % 2 == 1:
                s.submit(pending.pop(0))
            plan = s.plan_iteration()
            if len(plan) == 0:
                if pending:
                    s.submit(pending.pop(0))
                    continue
                break
            offs = plan.row_offsets
            assert offs[-1] == plan.token_count
            req = plan.requests
            for r, w in enumerate(plan.work):
                a, b = offs[r], offs[r + 1]
                assert list(plan.tokens[a:b]) == list(w.tokens)
                assert list(plan.positions[a:b]) == list(w.positions)
                assert [req[r].positions[i] for i in range(b - a)] == list(w.positions)
                assert max(w.positions) < 100
            k = len(plan.sample_rows)
            out = plan.outputs
            out.request_indexes[:k] = plan.sample_rows
            out.predicted_tokens[:k] = 5
            out.count = k
            s.complete_iteration(plan)
            it += 1
