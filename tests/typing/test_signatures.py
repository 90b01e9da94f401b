"""The compiled modules show real signatures: inspect.signature() reads their functions and
methods (Cython's binding), and each docstring starts with the Python signature (embedsignature),
which is what help() prints."""
import inspect
import pydoc

import pytest

from skippy_scheduler import Scheduler, _boundary, _core, _radix, _rank


def test_scheduler_methods_have_their_signatures():
    assert str(inspect.signature(Scheduler.plan_iteration)) == "(self)"
    assert str(inspect.signature(Scheduler.submit)) == "(self, seq, *, session=None)"
    assert str(inspect.signature(Scheduler.complete_iteration)) == "(self, plan)"
    assert str(inspect.signature(Scheduler.preempt_for_component_pressure)) == "(self, used_bytes)"
    assert str(inspect.signature(Scheduler.sequence)) == "(self, sequence_id)"
    assert str(inspect.signature(Scheduler().metrics)) == "()"  # bound: self is taken


def test_help_shows_the_signatures():
    text = pydoc.render_doc(Scheduler, renderer=pydoc.plaintext)
    for line in ("submit(self, seq, *, session=None)",
                 "complete_iteration(self, plan)",
                 "observe_iteration_duration(self, plan, elapsed)", "plan_iteration(self)"):
        assert line in text, line


def _functions():
    for module in (_boundary, _core, _radix, _rank):
        for name, obj in vars(module).items():
            if name.startswith("_"):
                continue
            if inspect.isclass(obj) and obj.__module__ == module.__name__:
                for attr, member in vars(obj).items():
                    if not attr.startswith("_") and callable(member):
                        yield f"{module.__name__}.{name}.{attr}", attr, member
            elif callable(obj) and getattr(obj, "__module__", None) == module.__name__:
                yield f"{module.__name__}.{name}", name, obj


FUNCTIONS = list(_functions())


def test_every_public_function_is_found():
    names = {qualified for qualified, _, _ in FUNCTIONS}
    assert {"skippy_scheduler._core.Scheduler.submit", "skippy_scheduler._rank.order_candidates",
            "skippy_scheduler._radix.RadixCacheCore.peek_resident",
            "skippy_scheduler._boundary.check_tokens_fast"} <= names


@pytest.mark.parametrize("qualified,name,function", FUNCTIONS, ids=[f[0] for f in FUNCTIONS])
def test_compiled_functions_are_introspectable(qualified, name, function):
    signature = inspect.signature(function)  # raises ValueError without binding
    assert function.__doc__ is not None and function.__doc__.startswith(f"{name}("), qualified
    assert list(signature.parameters) == [
        p.split(":")[0].split("=")[0].strip(" *")
        for p in function.__doc__.split("\n", 1)[0][len(name) + 1:-1].split(",") if p.strip(" *")
    ]


def test_the_scheduler_class_shows_its_constructor():
    assert str(inspect.signature(Scheduler)) == "(config=None, admission=None, preemption=None)"
    text = pydoc.render_doc(Scheduler, renderer=pydoc.plaintext)
    assert "Scheduler(config=None, admission=None, preemption=None)" in text


# Each plan array's docstring opens with "<dtype> array of <length> ..."; the length names
# what the array is as long as.
PLAN_ARRAYS = {
    "tokens": "`token_count`",
    "positions": "`token_count`",
    "row_offsets": "`len(plan) + 1`",
    "sample_last": "`len(plan)`",
    "phases": "`len(plan)`",
    "slots": "`len(plan)`",
    "sample_rows": "the work indexes of the sampling rows",
}


@pytest.fixture(scope="module")
def plan():
    from skippy_scheduler import Sequence

    scheduler = Scheduler()
    scheduler.submit(Sequence("a", [1, 2, 3], max_tokens=2))
    return scheduler, scheduler.plan_iteration()


@pytest.mark.parametrize("name", sorted(PLAN_ARRAYS))
def test_plan_array_docstrings_give_dtype_and_length(plan, name):
    import numpy as np

    from skippy_scheduler import IterationPlan

    doc = inspect.getdoc(getattr(IterationPlan, name))
    assert doc is not None, name
    dtype, rest = doc.split(" array of ", 1)
    assert np.dtype(dtype) == getattr(plan[1], name).dtype, name
    assert rest.startswith(PLAN_ARRAYS[name]), (name, rest)


def test_output_arrays_are_documented(plan):
    import numpy as np

    from skippy_scheduler import PlanOutputs

    doc = inspect.getdoc(PlanOutputs)
    outputs = plan[1].outputs
    for name in ("request_indexes", "predicted_tokens"):
        line = next(l for l in doc.splitlines() if l.startswith(f"{name}: "))
        dtype = line.split(": ", 1)[1].split(" array", 1)[0]
        assert np.dtype(dtype) == getattr(outputs, name).dtype, name
        assert "`capacity` entries" in line, name
    assert inspect.getdoc(PlanOutputs.count) and inspect.getdoc(PlanOutputs.capacity)


def test_metrics_and_snapshot_are_documented_field_by_field():
    from dataclasses import fields

    from skippy_scheduler import SchedulerMetrics, SchedulerSnapshot

    assert "SchedulerMetrics" in inspect.getdoc(Scheduler.metrics)
    assert "SchedulerSnapshot" in inspect.getdoc(Scheduler.snapshot)
    for cls in (SchedulerMetrics, SchedulerSnapshot):
        doc = inspect.getdoc(cls)
        # Entries read "name: meaning" or "name, other: meaning", one per line.
        described = {name.strip() for line in doc.splitlines() if ": " in line
                     for name in line.split(": ", 1)[0].split(",")}
        missing = [f.name for f in fields(cls) if f.name not in described]
        assert not missing, (cls.__name__, missing)
