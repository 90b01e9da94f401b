"""Every row of the bad-input table in docs/reliability.md, checked on both schedulers: the
named exception is raised and snapshot, sequence views and metrics stay as they were (for a
full queue only `rejected_overload` moves, as §2.1 says); a refused completion leaves the plan
live. The table in the document must list exactly these rows."""
import math
import os
import re

import pytest

from skippy_scheduler import (
    DuplicateSequence,
    EmptyPrompt,
    IterationPrediction,
    MalformedOutputs,
    MemoryComponent,
    PrefixRestore,
    QueueFull,
    Scheduler,
    SchedulerConfig,
    Sequence,
    StalePlanError,
    TwinScheduler,
)
from sched_helpers import complete

DOC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "docs",
                   "reliability.md")


def busy(impl):
    """Active "a" (samples this plan) and "b" (mid-prefill, no sample), waiting "w", a live plan."""
    s = impl(SchedulerConfig(max_active_sequences=2, max_waiting_sequences=3, max_tokens_per_iteration=6,
                             prefill_chunk_tokens=4, memory_components=[MemoryComponent("kv", 1000, 0, 1, 0)]))
    s.submit(Sequence("a", [7, 8], 4))
    s.submit(Sequence("b", list(range(6)), 4))
    s.submit(Sequence("w", [9], 4))
    plan = s.plan_iteration()
    assert [(w.sequence_id, w.sample_last) for w in plan.work] == [("a", True), ("b", False)]
    return s, plan


def state(s):
    snap = s.snapshot()
    return snap, s.metrics(), {i: s.sequence(i) for i in snap.active_ids + snap.waiting_ids}


def seq_with(**fields):
    q = Sequence("x", [1, 2, 3], 2)
    for name, value in fields.items():
        setattr(q, name, value)
    return q


def outputs(s, plan, entries, count=None):
    for k, (index, token) in enumerate(entries):
        plan.outputs.request_indexes[k] = index
        plan.outputs.predicted_tokens[k] = token
    plan.outputs.count = len(entries) if count is None else count
    return s.complete_iteration(plan)


def other_plan(impl):
    return busy(impl)[1]


def full_queue(s, plan):
    s.submit(Sequence("w2", [1], 1))
    s.submit(Sequence("w3", [1], 1))  # with "w" the queue now holds its limit of 3


# label (as in the document), exception, action(s, plan, impl)
ROWS = [
    ("submit: empty prompt", EmptyPrompt, lambda s, p, i: s.submit(Sequence("e", [], 4))),
    ("submit: id already waiting or active", DuplicateSequence, lambda s, p, i: s.submit(Sequence("w", [1], 4))),
    ("submit: waiting queue full", QueueFull, lambda s, p, i: s.submit(Sequence("w4", [1], 1))),
    ("submit: not a Sequence", TypeError, lambda s, p, i: s.submit(("x", [1], 2))),
    ("submit: token outside [0, 2^31-1]", ValueError, lambda s, p, i: s.submit(seq_with(prompt_tokens=[1, -1]))),
    ("submit: bool, float or str token", TypeError, lambda s, p, i: s.submit(seq_with(prompt_tokens=[1, True]))),
    ("submit: field of the wrong type", TypeError, lambda s, p, i: s.submit(seq_with(priority=1.5))),
    ("submit: negative or oversized count", ValueError, lambda s, p, i: s.submit(seq_with(max_tokens=1 << 32))),
    ("complete/observe: plan completed or replaced", StalePlanError, None),
    ("complete/observe: not a plan", TypeError, lambda s, p, i: complete(s, "plan", [])),
    ("complete/observe: another scheduler's plan", ValueError, lambda s, p, i: complete(s, other_plan(i), [])),
    ("complete: prediction outside the plan", MalformedOutputs,
     lambda s, p, i: complete(s, p, [IterationPrediction(2, 1)])),
    ("complete: same row predicted twice", MalformedOutputs,
     lambda s, p, i: complete(s, p, [IterationPrediction(0, 1), IterationPrediction(0, 2)])),
    ("complete: prediction for a non-sampling row", MalformedOutputs,
     lambda s, p, i: complete(s, p, [IterationPrediction(1, 1)])),
    ("complete: outputs block naming a bad row", MalformedOutputs, lambda s, p, i: outputs(s, p, [(1, 5)])),
    ("complete: outputs count above the rows", ValueError, lambda s, p, i: outputs(s, p, [(0, 5)], count=3)),
    ("complete: an argument besides the plan (outputs go in `plan.outputs`)", TypeError,
     lambda s, p, i: s.complete_iteration(p, [(0, 1)])),
    ("observe: duration not a number", TypeError, lambda s, p, i: s.observe_iteration_duration(p, "10ms")),
    ("preempt: byte count negative or above 2^64-1", ValueError,
     lambda s, p, i: s.preempt_for_component_pressure([-1])),
    ("preempt: byte count not an int, or not a list", TypeError,
     lambda s, p, i: s.preempt_for_component_pressure([1.5])),
    ("cancel/sequence: id not a str", TypeError, lambda s, p, i: s.cancel(b"a")),
    ("cancel/sequence: id with no UTF-8 encoding (a lone surrogate)", ValueError,
     lambda s, p, i: s.sequence("\ud800")),
]

# Bad values refused before they reach a scheduler at all.
VALUE_ROWS = [
    ("IterationPrediction: token outside i32", ValueError, lambda: IterationPrediction(0, 1 << 31)),
    ("SchedulerConfig: negative field", ValueError, lambda: SchedulerConfig(max_tokens_per_iteration=-1)),
    ("SchedulerConfig: field of the wrong type", TypeError, lambda: SchedulerConfig(max_waiting_sequences=None)),
    ("SchedulerConfig: more than 255 plans in flight (the core's bound)", ValueError,
     lambda: SchedulerConfig(max_inflight_plans=256)),
    ("a time, cost or weight that is an int past a float's range (10**400)", ValueError,
     lambda: SchedulerConfig(iteration_interval=10 ** 400)),
    ("with_prefilled_generation: empty list", ValueError, lambda: Sequence("x", [1], 2).with_prefilled_generation([])),
    ("PrefixRestore: negative token count", ValueError, lambda: PrefixRestore("p", -1)),
]

# Inputs that are not errors and change nothing.
NO_OP_ROWS = [
    ("cancel/sequence: unknown id", lambda s, p: (s.cancel("nobody"), s.sequence("nobody")), (False, None)),
    ("observe: NaN, infinite (or past a float's range), zero or negative duration",
     lambda s, p: [s.observe_iteration_duration(p, x)
                   for x in (math.nan, math.inf, 10 ** 400, 0.0, -1.0)], [None] * 5),
]


@pytest.mark.parametrize("impl", [Scheduler, TwinScheduler], ids=["native", "twin"])
@pytest.mark.parametrize("label, error, action", ROWS, ids=[r[0] for r in ROWS])
def test_bad_input_raises_and_changes_nothing(impl, label, error, action):
    s, plan = busy(impl)
    if action is None:  # stale: complete the plan, then use it again
        complete(s, plan, [IterationPrediction(0, 1)])
        before = state(s)
        with pytest.raises(error):
            complete(s, plan, [IterationPrediction(0, 1)])
        with pytest.raises(error):
            s.observe_iteration_duration(plan, 0.01)
        assert state(s) == before
        return
    if error is QueueFull:
        full_queue(s, plan)
    before = state(s)
    with pytest.raises(error):
        action(s, plan, impl)
    after = state(s)
    if error is QueueFull:
        assert after[1].rejected_overload == before[1].rejected_overload + 1
        after[1].rejected_overload -= 1
    assert after == before
    # The live plan survives every refused call and completes normally.
    telemetry = complete(s, plan, [IterationPrediction(0, 5)])
    assert telemetry.failed_ids == [] and list(s.sequence("a").generated_tokens) == [5]


@pytest.mark.parametrize("label, error, action", VALUE_ROWS, ids=[r[0] for r in VALUE_ROWS])
def test_bad_values_are_refused_at_construction(label, error, action):
    with pytest.raises(error):
        action()


@pytest.mark.parametrize("impl", [Scheduler, TwinScheduler], ids=["native", "twin"])
@pytest.mark.parametrize("label, action, result", NO_OP_ROWS, ids=[r[0] for r in NO_OP_ROWS])
def test_harmless_inputs_change_nothing(impl, label, action, result):
    s, plan = busy(impl)
    before = state(s)
    assert action(s, plan) == result
    assert state(s) == before


def test_document_lists_exactly_these_rows():
    with open(DOC, encoding="utf-8") as f:
        text = f.read()
    table = re.findall(r"^\| (.+?) \| `(\w+)` \|", text, flags=re.M)
    documented = {label: exc for label, exc in table}
    expected = {label: err.__name__ for label, err, _ in ROWS + VALUE_ROWS}
    expected.update({label: "None" for label, _, _ in NO_OP_ROWS})
    assert documented == expected
