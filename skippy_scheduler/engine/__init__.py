"""One loop for every driver: a scheduler, a host that runs plans, a clock and a recorder.

    engine = Engine(Scheduler(config), host, clock=VirtualClock(cost))
    report = engine.run(requests)

The lab's scenarios and workload suite, `run` on llama.cpp, the benchmarks, the soak and the
server all run on it; a runtime plugs in by implementing the `Host` contract
(engine/contract.py, docs/hosts.md, docs/architecture.md).
"""
from ..types import ReleaseReason
from .clock import Clock, VirtualClock, WallClock
from .contract import (AsyncHost, ChainingHost, ConfigCheckingHost, DetailReportingHost,
                       ExecutionHandle, Host, HostHooks, HostOutOfMemory, HostState,
                       MemoryReportingHost, PipelinedHost, Plan, PlanOutputs, PrefixHoldingHost,
                       PrefixRestoringHost, PromptKeepingHost, RequestLike, ResettableHost,
                       SchedulerLike, StateReportingHost, attach)
from .core import (AcceptEvent, Engine, EngineStalled, Event, EventStream, FinishEvent, Request,
                   RequestNeverFits, TokenEvent)
from .host import CostModelHost
from .observers import BaseObserver, StepObserver
from .record import FINISH_REASONS, EngineReport, Recorder, RequestRecord, TokenTimeline, percentile

__all__ = [
    "AcceptEvent", "AsyncHost", "BaseObserver", "ChainingHost", "Clock", "ConfigCheckingHost",
    "CostModelHost", "DetailReportingHost", "Engine", "EngineReport", "EngineStalled", "Event",
    "EventStream", "ExecutionHandle", "FINISH_REASONS", "FinishEvent", "Host", "HostHooks",
    "HostOutOfMemory", "HostState", "MemoryReportingHost", "PipelinedHost", "Plan",
    "PlanOutputs", "PrefixHoldingHost", "PrefixRestoringHost", "PromptKeepingHost", "Recorder",
    "ReleaseReason", "Request", "RequestLike", "RequestNeverFits", "RequestRecord",
    "ResettableHost", "SchedulerLike", "StateReportingHost", "StepObserver", "TokenEvent",
    "TokenTimeline", "VirtualClock", "WallClock", "attach", "percentile",
]
