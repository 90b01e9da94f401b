"""skippy-scheduler: iteration-level scheduling policy for LLM serving."""
from ._native_check import check_native as _check_native
from ._version import __version__

_check_native()


def _installed_dir(name: str) -> str:
    # NOTE: next to the compiled modules, not this file: an editable install keeps the Python
    # sources in the checkout and the built files (extensions, headers, library) elsewhere.
    import os

    from . import _core

    return os.path.join(os.path.dirname(os.path.abspath(_core.__file__)), name)


def get_include() -> str:
    """Directory of the installed C headers (skippy_abi.h, skippy_scheduler.h)."""
    return _installed_dir("include")


def get_library_dir() -> str:
    """Directory of the installed static core library (link with -lskippy_scheduler_core)."""
    return _installed_dir("lib")


from ._core import IterationPlan, PlanOutputs, Scheduler  # noqa: E402
from .cache_policy import (  # noqa: E402
    CacheAffinity,
    CacheAwareCandidate,
    StageCacheAffinity,
    order_cache_aware_candidates,
)
from .engine import Engine, Host, Request  # noqa: E402
from .inflight import resolve_deferred  # noqa: E402
from .policies import (  # noqa: E402
    AdmissionPolicy,
    CacheAwareAdmission,
    FairShareAdmission,
    FcfsAdmission,
    FewestComputedTokens,
    LowestPriorityNewest,
    PreemptionPolicy,
    PriorityAdmission,
    VictimCandidate,
)
from .prefix_store import PrefixStore  # noqa: E402
from .radix import UnifiedRadixCache  # noqa: E402
from .reference import TwinScheduler  # noqa: E402
from .sampling import SamplingParams  # noqa: E402
from .types import (  # noqa: E402
    AdmissionError,
    DuplicateSequence,
    EmptyPrompt,
    FinishReason,
    IterationPhase,
    IterationPrediction,
    IterationTelemetry,
    IterationWork,
    MalformedOutputs,
    MemoryComponent,
    PlanInFlight,
    PlanningRule,
    PrefixRestore,
    PrefixRestoreKind,
    QueueFull,
    RejectReason,
    ReleaseReason,
    SchedulerConfig,
    SchedulerMetrics,
    SchedulerSnapshot,
    Sequence,
    SequenceStatus,
    StalePlanError,
    StepCost,
)

# What a user needs, by layer: the driver loop and the host it runs; the scheduler (native, or
# its pure-Python twin) with its config, requests, plan and telemetry types; the policies; the
# prefix store; the errors. Lower-level pieces stay in their modules (`skippy_scheduler.radix`,
# `.cache_policy`, `.reference`, `.hosts`, `.lab`, ...).
__all__ = [
    "__version__",
    "get_include",
    "get_library_dir",
    # driving
    "Engine",
    "Host",
    "Request",
    # the scheduler and its types
    "Scheduler",
    "TwinScheduler",
    "SchedulerConfig",
    "PlanningRule",
    "StepCost",
    "MemoryComponent",
    "Sequence",
    "SequenceStatus",
    "PrefixRestore",
    "PrefixRestoreKind",
    "SamplingParams",
    "IterationPlan",
    "IterationPhase",
    "IterationWork",
    "IterationPrediction",
    "PlanOutputs",
    "resolve_deferred",
    "IterationTelemetry",
    "FinishReason",
    "ReleaseReason",
    "SchedulerMetrics",
    "SchedulerSnapshot",
    # policies
    "AdmissionPolicy",
    "CacheAwareAdmission",
    "FairShareAdmission",
    "FcfsAdmission",
    "PriorityAdmission",
    "PreemptionPolicy",
    "LowestPriorityNewest",
    "FewestComputedTokens",
    "VictimCandidate",
    "CacheAwareCandidate",
    "CacheAffinity",
    "StageCacheAffinity",
    "order_cache_aware_candidates",
    # prefixes
    "PrefixStore",
    "UnifiedRadixCache",
    # errors
    "AdmissionError",
    "QueueFull",
    "DuplicateSequence",
    "EmptyPrompt",
    "RejectReason",
    "StalePlanError",
    "PlanInFlight",
    "MalformedOutputs",
]
