"""Deterministic evidence that a steady decode step does not grow with context length.

No timings here (they belong to `skippy-scheduler bench`): a decode row carries exactly one
token, its pending one, whatever the history length; the plan's numpy views are the same
objects from step to step (nothing is rebuilt per step); and the native plan memory does not
move or grow once the active set is stable.
"""
import numpy as np
import pytest

from skippy_scheduler import Scheduler, TwinScheduler
from skippy_scheduler.bench import decoding_engine, write_outputs


def _steady(impl, n, prompt, steps=3):
    s = decoding_engine(impl, n, prompt).scheduler
    for _ in range(steps):
        plan = s.plan_iteration()
        write_outputs(plan, token=9)
        s.complete_iteration(plan)
    return s


@pytest.mark.parametrize("impl", [Scheduler, TwinScheduler], ids=["native", "twin"])
@pytest.mark.parametrize("prompt", [512, 8192])
def test_a_decode_step_feeds_one_token_per_row(impl, prompt):
    n = 16
    s = _steady(impl, n, prompt)
    plan = s.plan_iteration()
    assert len(plan) == n and plan.token_count == n
    assert np.asarray(plan.row_offsets).tolist() == list(range(n + 1))
    assert np.asarray(plan.tokens).tolist() == [9] * n  # the pending token, nothing older
    # prompt + 1 prefilled + 3 sampled tokens; the pending one is fed at position R = P + 3.
    assert np.asarray(plan.positions).tolist() == [prompt + 3] * n
    assert np.asarray(plan.sample_rows).tolist() == list(range(n))


def _native_plan_memory(plan):
    p = plan.native
    return (int(p.request_capacity), int(p.token_capacity), int(np.asarray(plan.tokens).ctypes.data),
            int(np.asarray(plan.outputs.request_indexes).ctypes.data))


@pytest.mark.parametrize("prompt", [512, 8192])
def test_native_steady_steps_reuse_plan_memory_and_views(prompt):
    s = _steady(Scheduler, 32, prompt)
    first = s.plan_iteration()
    memory = _native_plan_memory(first)
    views = (first.tokens, first.positions, first.sample_rows, first.outputs.request_indexes,
             first.outputs.predicted_tokens)
    write_outputs(first)
    s.complete_iteration(first)
    for _ in range(20):
        plan = s.plan_iteration()
        assert _native_plan_memory(plan) == memory
        again = (plan.tokens, plan.positions, plan.sample_rows, plan.outputs.request_indexes,
                 plan.outputs.predicted_tokens)
        assert all(a is b for a, b in zip(again, views))
        write_outputs(plan)
        s.complete_iteration(plan)


def test_native_plan_sizes_do_not_depend_on_context_length():
    short, long = _steady(Scheduler, 32, 512), _steady(Scheduler, 32, 8192)
    a, b = short.plan_iteration(), long.plan_iteration()
    assert _native_plan_memory(a)[:2] == _native_plan_memory(b)[:2]
    assert a.token_count == b.token_count == 32
