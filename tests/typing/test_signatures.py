"""The compiled modules show real signatures: inspect.signature() reads their functions and
methods (Cython's binding), and each docstring starts with the Python signature (embedsignature),
which is what help() prints."""
import inspect
import pydoc

import pytest

from skippy_scheduler import Scheduler, _core, _fast, _radix, _rank


def test_scheduler_methods_have_their_signatures():
    assert str(inspect.signature(Scheduler.plan_iteration)) == "(self)"
    assert str(inspect.signature(Scheduler.submit)) == "(self, seq, *, session=None)"
    assert str(inspect.signature(Scheduler.complete_iteration)) == "(self, plan, predictions=None)"
    assert str(inspect.signature(Scheduler.preempt_for_component_pressure)) == "(self, used_bytes)"
    assert str(inspect.signature(Scheduler.sequence)) == "(self, sequence_id)"
    assert str(inspect.signature(Scheduler().metrics)) == "()"  # bound: self is taken


def test_help_shows_the_signatures():
    text = pydoc.render_doc(Scheduler, renderer=pydoc.plaintext)
    for line in ("submit(self, seq, *, session=None)",
                 "complete_iteration(self, plan, predictions=None)",
                 "observe_iteration_duration(self, plan, elapsed)", "plan_iteration(self)"):
        assert line in text, line


def _functions():
    for module in (_core, _fast, _radix, _rank):
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
            "skippy_scheduler._fast.check_tokens_fast"} <= names


@pytest.mark.parametrize("qualified,name,function", FUNCTIONS, ids=[f[0] for f in FUNCTIONS])
def test_compiled_functions_are_introspectable(qualified, name, function):
    signature = inspect.signature(function)  # raises ValueError without binding
    assert function.__doc__ is not None and function.__doc__.startswith(f"{name}("), qualified
    assert list(signature.parameters) == [
        p.split(":")[0].split("=")[0].strip(" *")
        for p in function.__doc__.split("\n", 1)[0][len(name) + 1:-1].split(",") if p.strip(" *")
    ]
