"""Which scheduler implementation the lab drives: the one place that chooses.

`native` is `skippy_scheduler.Scheduler` (the C core); `twin` is the pure-Python
`skippy_scheduler.TwinScheduler` with the same API, used as an oracle and for debugging.
`auto` is native (the compiled core is part of every installation).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

BACKENDS = ("auto", "native", "twin")


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


def resolve_backend(name: str | Backend | None = "auto") -> Backend:
    from .. import Scheduler, TwinScheduler

    if isinstance(name, Backend):
        return name
    name = name or "auto"
    if name not in BACKENDS:
        raise ValueError(f"unknown scheduler backend {name!r} (choose from {', '.join(BACKENDS)})")
    if name == "twin":
        return Backend("twin", TwinScheduler)
    return Backend("native", Scheduler)
