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
    select_cache_aware_candidate,
)
from .policies import (  # noqa: E402
    AdmissionPolicy,
    CacheAwareAdmission,
    FcfsAdmission,
    FewestComputedTokens,
    LowestPriorityNewest,
    PreemptionPolicy,
    PriorityAdmission,
    VictimCandidate,
)
from .radix import RadixEntry, RadixMatch, RadixStats, UnifiedRadixCache, affinity_from_radix  # noqa: E402
from .reference import TwinOutputs, TwinPlan, TwinScheduler  # noqa: E402
from .types import (  # noqa: E402
    LLAMA_MAX_SEQ,
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
    PlanInFlight,
    StalePlanError,
)
from .inflight import resolve_deferred  # noqa: E402
from .sampling import SamplingParams  # noqa: E402

__all__ = [
    "__version__",
    "get_include",
    "get_library_dir",
    "LLAMA_MAX_SEQ",
    "AdmissionError",
    "AdmissionPolicy",
    "CacheAffinity",
    "CacheAwareAdmission",
    "CacheAwareCandidate",
    "DuplicateSequence",
    "EmptyPrompt",
    "FcfsAdmission",
    "FewestComputedTokens",
    "FinishReason",
    "IterationPhase",
    "IterationPlan",
    "IterationPrediction",
    "IterationTelemetry",
    "IterationWork",
    "LowestPriorityNewest",
    "MalformedOutputs",
    "MemoryComponent",
    "PlanOutputs",
    "PreemptionPolicy",
    "PrefixRestore",
    "PrefixRestoreKind",
    "PriorityAdmission",
    "QueueFull",
    "RadixEntry",
    "RadixMatch",
    "RadixStats",
    "RejectReason",
    "ReleaseReason",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerMetrics",
    "SchedulerSnapshot",
    "Sequence",
    "SequenceStatus",
    "StageCacheAffinity",
    "PlanInFlight",
    "StalePlanError",
    "resolve_deferred",
    "SamplingParams",
    "TwinOutputs",
    "TwinPlan",
    "TwinScheduler",
    "UnifiedRadixCache",
    "affinity_from_radix",
    "VictimCandidate",
    "order_cache_aware_candidates",
    "select_cache_aware_candidate",
]
