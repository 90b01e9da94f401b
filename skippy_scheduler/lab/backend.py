"""Which scheduler implementation the lab drives: the one place that chooses.

`native` is `skippy_scheduler.Scheduler` (the C core); `twin` is the pure-Python
`skippy_scheduler.twin.TwinScheduler` with the same API, used as an oracle and for debugging.
`auto` picks native when it is importable and the twin otherwise.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable

BACKENDS = ("auto", "native", "twin")


class BackendUnavailable(RuntimeError):
    """The requested scheduler implementation is not part of this installation."""


@dataclass(frozen=True)
class Backend:
    name: str  # "native" or "twin"
    scheduler_class: Callable[..., Any]

    def make(self, config, admission=None, preemption=None):
        kwargs = {}
        if admission is not None:
            kwargs["admission"] = admission
        if preemption is not None:
            kwargs["preemption"] = preemption
        return self.scheduler_class(config, **kwargs)


def _native():
    module = importlib.import_module("skippy_scheduler")
    cls = getattr(module, "Scheduler", None)
    if cls is None:
        raise BackendUnavailable("skippy_scheduler.Scheduler (native) is not available")
    return cls


def _twin():
    try:
        module = importlib.import_module("skippy_scheduler.reference")
    except ImportError as exc:
        raise BackendUnavailable(f"skippy_scheduler.twin is not available: {exc}") from exc
    return module.TwinScheduler


def resolve_backend(name: str | Backend | None = "auto") -> Backend:
    if isinstance(name, Backend):
        return name
    name = name or "auto"
    if name not in BACKENDS:
        raise ValueError(f"unknown scheduler backend {name!r} (choose from {', '.join(BACKENDS)})")
    if name == "native":
        return Backend("native", _native())
    if name == "twin":
        return Backend("twin", _twin())
    try:
        return Backend("native", _native())
    except (BackendUnavailable, ImportError):
        return Backend("twin", _twin())


def types_module():
    """The module holding Sequence, PrefixRestore, SchedulerConfig, ... (spec names)."""
    try:
        return importlib.import_module("skippy_scheduler.types")
    except ImportError:
        return importlib.import_module("skippy_scheduler")
