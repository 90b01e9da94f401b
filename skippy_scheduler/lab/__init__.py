"""The scheduler lab: a deterministic discrete-event driver around the scheduler (§5).

No model runs: requests are lengths and arrival times, every sampled token is fixed and time
comes from a `StepCost` (by default `LAB_COST`). `simulate` is the lab run of
docs/behaviour.md §5.4; `scenarios` holds its 13 scenarios and the fixture replay; `suite` replays seeded synthetic workloads under several
admission policies and planning modes and `replay` production traces, both on one model-free
runtime host (`LabHost`, with the settings of `RunOptions`).
"""
from .backend import Backend, BackendUnavailable, resolve_backend
from .host import LabHost
from .model import (LAB_COST, SimRequest, StepCost, apply_resident_radix_affinity, burst_requests,
                    staggered_prefill_requests)
from .options import ReplayOptions, RunOptions, SuiteOptions
from .simulate import RequestMetrics, SimulationError, SimulationReport, percentile, simulate

__all__ = [
    "Backend", "BackendUnavailable", "resolve_backend", "LabHost", "ReplayOptions", "RunOptions",
    "SuiteOptions", "LAB_COST", "StepCost", "SimRequest",
    "apply_resident_radix_affinity", "burst_requests", "staggered_prefill_requests",
    "RequestMetrics", "SimulationError", "SimulationReport", "percentile", "simulate",
]
