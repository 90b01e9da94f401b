"""One loop for every driver: a scheduler, a host that runs plans, a clock and a recorder.

    engine = Engine(Scheduler(config), host, clock=VirtualClock(cost))
    report = engine.run(requests)

The lab's scenarios and workload suite, `run` on llama.cpp, the benchmarks and the soak all
run on it; a runtime plugs in by implementing `Host` (docs/hosts.md).
"""
from .clock import Clock, VirtualClock, WallClock
from .core import Engine, EngineStalled, Event, FinishEvent, Request, TokenEvent
from .host import CostModelHost, Host, MemoryReportingHost, PrefixRestoringHost
from .record import FINISH_REASONS, EngineReport, Recorder, RequestRecord, TokenTimeline, percentile

__all__ = [
    "Clock", "CostModelHost", "Engine", "EngineReport", "EngineStalled", "Event",
    "FINISH_REASONS", "FinishEvent", "Host", "MemoryReportingHost", "PrefixRestoringHost",
    "Recorder", "Request", "RequestRecord", "TokenEvent", "TokenTimeline", "VirtualClock",
    "WallClock", "percentile",
]
