"""Which scheduler implementation the lab drives, picked by the package's one selector.

`native` is `skippy_scheduler.Scheduler` (the C core); `twin` is the pure-Python
`skippy_scheduler.TwinScheduler` with the same API, used as an oracle and for debugging
(`skippy_scheduler.selection`, which the command line's `--scheduler` uses too). A `Backend`
carries the chosen class and its name through a lab run; its name is what the reports print.
"auto", the old lab spelling, is native (the compiled core is part of every installation).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ..selection import DEFAULT_IMPLEMENTATION, IMPLEMENTATIONS, scheduler_class

BACKENDS: tuple[str, ...] = ("auto",) + IMPLEMENTATIONS


class BackendUnavailable(RuntimeError):
    """The requested scheduler implementation is not part of this installation."""


@dataclass(frozen=True)
class Backend:
    name: str  # "native" or "twin"
    scheduler_class: Callable[..., Any]

    def make(self, config: Any, admission: Any = None, preemption: Any = None) -> Any:
        kwargs = {}
        if admission is not None:
            kwargs["admission"] = admission
        if preemption is not None:
            kwargs["preemption"] = preemption
        return self.scheduler_class(config, **kwargs)


def resolve_backend(name: str | Backend | None = DEFAULT_IMPLEMENTATION) -> Backend:
    if isinstance(name, Backend):
        return name
    name = name or DEFAULT_IMPLEMENTATION
    if name == "auto":
        name = DEFAULT_IMPLEMENTATION
    return Backend(name, scheduler_class(name))
