"""One loop for every driver: a scheduler, a host that runs plans, a clock and a recorder.

    engine = Engine(Scheduler(config), host, clock=VirtualClock(cost))
    report = engine.run(requests)

The lab's scenarios and workload suite, `run` on llama.cpp, the benchmarks, the soak and the
server all run on it; a runtime plugs in by implementing the `Host` contract
(engine/contract.py, docs/hosts.md, docs/architecture.md).
"""
from ..types import ReleaseReason
from .clock import Clock, VirtualClock, WallClock
from .contract import (AsyncHost, ExecutionHandle, Host, HostHooks, HostState,
                       MemoryReportingHost, Plan, PlanOutputs, PrefixHoldingHost,
                       PrefixRestoringHost, RequestLike, ResettableHost, SchedulerLike,
                       StateReportingHost, attach)
from .core import (AcceptEvent, Engine, EngineStalled, Event, EventStream, FinishEvent, Request,
                   TokenEvent)
from .host import CostModelHost
from .observers import BaseObserver, StepObserver
from .record import FINISH_REASONS, EngineReport, Recorder, RequestRecord, TokenTimeline, percentile

__all__ = [
    "AcceptEvent", "AsyncHost", "BaseObserver", "Clock", "CostModelHost", "Engine", "EngineReport",
    "EngineStalled", "Event", "EventStream", "ExecutionHandle", "FINISH_REASONS", "FinishEvent",
    "Host", "HostHooks", "HostState", "MemoryReportingHost", "Plan", "PlanOutputs", "PrefixHoldingHost",
    "PrefixRestoringHost", "Recorder", "ReleaseReason", "Request", "RequestLike",
    "RequestRecord", "ResettableHost", "SchedulerLike", "StateReportingHost", "StepObserver",
    "TokenEvent", "TokenTimeline", "VirtualClock", "WallClock", "attach", "percentile",
]
