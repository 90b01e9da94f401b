"""Public pure-Python types of the scheduler (behaviour.md §0.1, §1).

Both schedulers (the native one and the pure-Python twin) take and return these types. The cache
affinity types live in `cache_policy` and are re-exported here for convenience.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field, replace as _dc_replace
from typing import Any, Optional

from ._validate import (
    I32_MAX,
    I32_MIN,
    U32_MAX,
    U64_MAX,
    USIZE_MAX,
    check_bool,
    check_optional_uint,
    check_str,
    check_uint,
    as_float,
    as_int,
    sat,
    sat_sub,
)
from .cache_policy import CacheAffinity, CacheAwareCandidate, StageCacheAffinity
from .slack import (
    PlanningRule,
    StepCost,
    check_planning_rule,
    check_positive_seconds,
    check_safety,
    check_step_cost,
)
from ._sequence import (
    PrefixRestore,
    PrefixRestoreKind,
    RenamedMembers,
    Sequence,
    SequenceStatus,
    keep_old_spellings,
)

# Default size of the holder-id space (`SchedulerConfig.sequence_id_limit`): the runtime ids an
# active sequence or a resident prefix occupies one each of (a llama.cpp context has 256).
DEFAULT_SEQUENCE_ID_LIMIT = 256

__all__ = [
    "DEFAULT_SEQUENCE_ID_LIMIT",
    "IterationPhase",
    "FinishReason",
    "ReleaseReason",
    "RejectReason",
    "SequenceStatus",
    "PrefixRestoreKind",
    "MemoryComponent",
    "SchedulerConfig",
    "PlanningRule",
    "StepCost",
    "PrefixRestore",
    "Sequence",
    "IterationWork",
    "IterationPrediction",
    "IterationTelemetry",
    "SchedulerMetrics",
    "SchedulerSnapshot",
    "AdmissionError",
    "QueueFull",
    "DuplicateSequence",
    "EmptyPrompt",
    "StalePlanError",
    "MalformedOutputs",
    "CacheAffinity",
    "CacheAwareCandidate",
    "StageCacheAffinity",
]


class IterationPhase(enum.Enum, metaclass=RenamedMembers):
    """Kind of a plan row; the values match the C `skippy_phase`."""

    PREFILL = 0
    RECOMPUTE = 1
    DECODE = 2


keep_old_spellings(IterationPhase)


class FinishReason(enum.Enum):
    """Why a sequence ended, as the scheduler decided it (`IterationTelemetry.finish_reasons`).

    The values are the OpenAI-style strings a server reports.

    STOP: the host sampled an end token (a negative token) for it.
    LENGTH: it reached `max_tokens` generated tokens.
    FAILED: a sampling row of it got no output, or its token could not be kept.
    CANCELLED: `cancel` removed it (waiting or active); never in a completion's telemetry.
    """

    STOP = "stop"
    LENGTH = "length"
    FAILED = "failed"
    CANCELLED = "cancelled"


# How a request the engine took ended (`FinishEvent.reason`, `RequestRecord.finish_reason`): a
# `FinishReason` value, or REJECTED when `submit` refused it before the scheduler held it.
REJECTED = "rejected"
# The ends that complete a request: it stopped, or generated all it was allowed to.
COMPLETED_REASONS: tuple[str, ...] = (FinishReason.LENGTH.value, FinishReason.STOP.value)
# The ends that do not (a server answers them with an error).
UNCOMPLETED_REASONS: tuple[str, ...] = (FinishReason.FAILED.value, FinishReason.CANCELLED.value,
                                        REJECTED)
# Every end, in the order the engine's summary counts them.
FINISH_REASONS = COMPLETED_REASONS + UNCOMPLETED_REASONS


class ReleaseReason(enum.Enum):
    """Why a host is told to let go of a sequence's runtime state (`Host.release`).

    FINISHED: it ended normally (`FinishReason.STOP` or `LENGTH`); a host may keep its prefix.
    PREEMPTED: the scheduler took it out of the active set under memory pressure; it waits
        again and will be re-admitted, replaying from its restore (new row, `restored_tokens`).
    CANCELLED: the caller cancelled it.
    FAILED: it failed (`FinishReason.FAILED`), or the host itself could not run it.
    """

    FINISHED = "finished"
    PREEMPTED = "preempted"
    CANCELLED = "cancelled"
    FAILED = "failed"


class RejectReason(enum.Enum):
    """Why `submit` refused a sequence: the `reason` of each `AdmissionError` subclass.

    QUEUE_FULL: the waiting queue is at `max_waiting_sequences` (retry later; HTTP 503).
    DUPLICATE: the id is already waiting or active.
    EMPTY_PROMPT: the prompt has no token.
    """

    QUEUE_FULL = "queue_full"
    DUPLICATE = "duplicate"
    EMPTY_PROMPT = "empty_prompt"


# ---------------------------------------------------------------------------------------------
# Configuration (§1.1, §1.2)


@dataclass(frozen=True)
class MemoryComponent:
    """One memory pool that admission reserves bytes in (KV cells, recurrent state, ...)."""

    name: str
    capacity_bytes: int
    resident_bytes: int
    bytes_per_token: int
    bytes_per_sequence: int

    def __post_init__(self) -> None:
        check_str("name", self.name)
        for name in ("capacity_bytes", "resident_bytes", "bytes_per_token", "bytes_per_sequence"):
            object.__setattr__(self, name, check_uint(name, getattr(self, name)))

    def available_bytes(self) -> int:
        return sat_sub(self.capacity_bytes, self.resident_bytes)

    def request_bytes(self, prompt_tokens: int, max_tokens: int) -> int:
        tokens = sat(check_uint("prompt_tokens", prompt_tokens) + check_uint("max_tokens", max_tokens))
        return sat(self.bytes_per_sequence + sat(self.bytes_per_token * tokens))

    def reservation_bytes(self, admission_tokens: int) -> int:
        tokens = check_uint("admission_tokens", admission_tokens)
        return sat(self.bytes_per_sequence + sat(self.bytes_per_token * tokens))


def _check_interval(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds, got {type(value).__name__}")
    seconds = as_float(value)
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"{name} must be a finite, non-negative number of seconds, got {value}")
    return seconds


def _check_components(name: str, value: object) -> list[MemoryComponent]:
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise TypeError(f"{name} must be a list of MemoryComponent, got {type(value).__name__}")
    components = list(value)
    for component in components:
        if not isinstance(component, MemoryComponent):
            raise TypeError(f"{name} must hold MemoryComponent values, got {type(component).__name__}")
    return components


#: The most plans a scheduler keeps live at once (the native core's bound; docs/behaviour.md
#: §2.11).
MAX_INFLIGHT_PLANS = 255

_CONFIG_CHECKS = {
    "max_active_sequences": lambda n, v: check_uint(n, v, USIZE_MAX),
    "sequence_id_limit": lambda n, v: check_uint(n, v, USIZE_MAX),
    "reserved_sequence_ids": lambda n, v: check_uint(n, v, USIZE_MAX),
    "max_waiting_sequences": lambda n, v: check_uint(n, v, USIZE_MAX),
    "max_tokens_per_iteration": lambda n, v: check_uint(n, v, USIZE_MAX),
    "prefill_chunk_tokens": lambda n, v: check_uint(n, v, USIZE_MAX),
    "max_prefill_sequences_per_iteration": lambda n, v: check_optional_uint(n, v, USIZE_MAX),
    "max_consecutive_prefill_iterations": lambda n, v: check_optional_uint(n, v, USIZE_MAX),
    "mixed_prefill_decode": check_bool,
    "cache_aging_cost_per_iteration": lambda n, v: check_uint(n, v, U64_MAX),
    "group_waiting_prefixes": check_bool,
    "max_inflight_plans": lambda n, v: check_uint(n, v, MAX_INFLIGHT_PLANS),
    "priority_preemption": check_bool,
    "priority_preemption_guard_steps": lambda n, v: check_uint(n, v, USIZE_MAX),
    "max_priority_preemptions_per_step": lambda n, v: check_uint(n, v, USIZE_MAX),
    "disjoint_inflight_plans": check_bool,
    "iteration_interval": _check_interval,
    "memory_components": _check_components,
    "planning_rule": check_planning_rule,
    "itl_target": check_positive_seconds,
    "slack_safety": check_safety,
    "slack_interleave_max": lambda n, v: check_uint(n, v, USIZE_MAX),
    "slack_min_chunk_tokens": lambda n, v: check_uint(n, v, USIZE_MAX),
    "cold_prefix_hold_tokens": lambda n, v: check_uint(n, v, USIZE_MAX),
    "cold_prefix_hold_max_steps": lambda n, v: check_uint(n, v, U32_MAX),
    "slack_prefill_age_max": _check_interval,  # 0 is meaningful: the walk order (§2.13)
    "slack_first_token_hold": check_bool,
    "step_cost": check_step_cost,
}


@dataclass
class SchedulerConfig:
    """Scheduler limits (§1.2). Values are stored as given; `normalized()` clamps them.

    Every assignment is validated (TypeError for a wrong type or a bool where an int is
    expected, ValueError for a negative or oversized value). `None` means unbounded for the two
    optional limits.
    """

    max_active_sequences: int = 32
    sequence_id_limit: int = DEFAULT_SEQUENCE_ID_LIMIT
    reserved_sequence_ids: int = 16
    max_waiting_sequences: int = 256
    max_tokens_per_iteration: int = 2048
    prefill_chunk_tokens: int = 256
    max_prefill_sequences_per_iteration: int | None = None
    max_consecutive_prefill_iterations: int | None = None
    mixed_prefill_decode: bool = False
    cache_aging_cost_per_iteration: int = 4096
    group_waiting_prefixes: bool = True
    # Plans that may be live at once (made, not yet completed or aborted): D (§2.11). At 1,
    # making a plan while one is live aborts the live one first.
    max_inflight_plans: int = 1
    # Preemption for priority (§2.8a), off by default: a waiting sequence of strictly higher
    # priority that cannot be admitted takes lanes and memory from lower-priority running ones.
    # A sequence so preempted is not preempted for priority again during the next
    # `priority_preemption_guard_steps` plans, and one plan preempts at most
    # `max_priority_preemptions_per_step` sequences for priority (0: none).
    priority_preemption: bool = False
    priority_preemption_guard_steps: int = 8
    max_priority_preemptions_per_step: int = 4
    # Disjoint plans in flight (§2.11a), off by default: with max_inflight_plans > 1 a sequence
    # whose row is in a live plan is left out of the next plan (no row is ever deferred), so a
    # pipeline of stages can run every plan in flight at once.
    disjoint_inflight_plans: bool = False
    iteration_interval: float = 0.002
    memory_components: list[MemoryComponent] = field(default_factory=list)
    # The slack rule (§2.13), off by default (the reference's rule): when prefill and live decode
    # both wait, the prefill chunk is sized so the step's predicted time (`step_cost`) times
    # `slack_safety` fits the tightest decode slack under the inter-token target `itl_target`
    # (seconds; a sequence's own `itl_target` overrides it); at most `slack_interleave_max`
    # decode-only steps run in a row before a chunk of `slack_min_chunk_tokens` does.
    planning_rule: PlanningRule = PlanningRule.REFERENCE
    itl_target: float = 0.1
    slack_safety: float = 1.2
    slack_interleave_max: int = 4
    slack_min_chunk_tokens: int = 32
    step_cost: StepCost = field(default_factory=StepCost)
    # Cold prefix hold (§2.3a), off by default (0): with a prefix store attached, a waiting
    # sequence whose prompt shares at least this many tokens past its restore with a running
    # sequence's prompt (being computed, or computed and then kept from the running lane)
    # waits (at most `cold_prefix_hold_max_steps` plans) until that prompt is resident, then
    # restores it instead of prefilling it again.
    cold_prefix_hold_tokens: int = 0
    cold_prefix_hold_max_steps: int = 64
    # The slack rule's prefill order (§2.13): its prefill walks visit the sequences submitted at
    # least `slack_prefill_age_max` seconds ago (on the clock of `set_clock`; with a first-token
    # deadline still to meet, that long past the deadline) first, in walk order, then the
    # deadlines that can be met, then the others by fewest prefill tokens left; 0 = walk order,
    # as the reference.
    slack_prefill_age_max: float = 2.0
    # The first-token hold (§2.13), off by default: under the slack rule, while the prefill
    # that waits would take at least half the time to the nearest first-token deadline among
    # it, a prompt whose own deadline is further off than a few full steps keeps its last token
    # back (it starts no decode rows that would slow the others' prefill); the token goes in
    # beside the decode rows once its deadline comes near or nothing longer waits.
    slack_first_token_hold: bool = False

    def __setattr__(self, name: str, value: Any) -> None:
        check = _CONFIG_CHECKS.get(name)
        if check is None:
            raise AttributeError(f"SchedulerConfig has no field {name!r}")
        object.__setattr__(self, name, check(name, value))

    def replace(self, **changes: Any) -> "SchedulerConfig":
        """A copy with the given fields changed (validated like the constructor)."""
        return _dc_replace(self, **changes)

    def hard_sequence_limit(self) -> int:
        """Largest number of active sequences the sequence-id space allows (§0.4d)."""
        return max(1, sat_sub(max(self.sequence_id_limit, 1), self.reserved_sequence_ids))

    def normalized(self) -> "SchedulerConfig":
        max_tokens = max(self.max_tokens_per_iteration, 1)
        return _dc_replace(
            self,
            max_active_sequences=min(max(self.max_active_sequences, 1), self.hard_sequence_limit()),
            sequence_id_limit=max(self.sequence_id_limit, 1),
            max_waiting_sequences=max(self.max_waiting_sequences, 1),
            max_tokens_per_iteration=max_tokens,
            prefill_chunk_tokens=min(max(self.prefill_chunk_tokens, 1), max_tokens),
            max_prefill_sequences_per_iteration=(
                None
                if self.max_prefill_sequences_per_iteration is None
                else max(self.max_prefill_sequences_per_iteration, 1)
            ),
            max_consecutive_prefill_iterations=(
                None
                if self.max_consecutive_prefill_iterations is None
                else max(self.max_consecutive_prefill_iterations, 1)
            ),
            cache_aging_cost_per_iteration=max(self.cache_aging_cost_per_iteration, 1),
            max_inflight_plans=max(self.max_inflight_plans, 1),
            memory_components=list(self.memory_components),
            slack_min_chunk_tokens=min(max(self.slack_min_chunk_tokens, 1), max_tokens),
        )


# ---------------------------------------------------------------------------------------------
# Plan rows and predictions (§1.3)


@dataclass(frozen=True)
class IterationWork:
    """One row of an iteration plan: a contiguous span of one sequence's tokens."""

    sequence_id: str
    tokens: tuple[int, ...]
    positions: tuple[int, ...]
    sample_last: bool
    phase: IterationPhase
    sampling: Any = None
    # With an attached prefix store: the holder id of the entry the sequence's restored prefix
    # is copied from (the host copies positions [0, first row's position) from it), else None.
    restore_holder: Optional[int] = None
    # The first row of the sequence since its admission (a first admission, or a resume after
    # preemption): the host sets up the sequence's state here.
    new_row: bool = False
    # For a new row: positions [0, restored_tokens) the host must already hold before the row
    # (copied from `restore_holder`, or left in the cache by the caller); 0 for other rows.
    restored_tokens: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokens", tuple(self.tokens))
        object.__setattr__(self, "positions", tuple(self.positions))


@dataclass(frozen=True)
class IterationPrediction:
    """The token sampled for plan row `work_index`; a negative token means end of sequence."""

    work_index: int
    token: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "work_index", check_uint("work_index", self.work_index, USIZE_MAX))
        token = as_int("token", self.token)
        if token < I32_MIN or token > I32_MAX:
            raise ValueError(f"token must be in [{I32_MIN}, {I32_MAX}], got {token}")
        object.__setattr__(self, "token", token)


# ---------------------------------------------------------------------------------------------
# Telemetry (§1.5)


@dataclass
class IterationTelemetry:
    """What one `complete_iteration` did; the last four counters are cumulative copies."""

    iteration: int = 0
    active_sequences: int = 0
    waiting_sequences: int = 0
    admitted: int = 0
    preempted: int = 0
    prefill_tokens: int = 0
    recompute_tokens: int = 0
    decode_tokens: int = 0
    component_used_bytes: list[tuple[str, int]] = field(default_factory=list)
    component_available_bytes: list[tuple[str, int]] = field(default_factory=list)
    prefix_hits: int = 0
    prefix_misses: int = 0
    finished: int = 0
    failed: int = 0
    cancelled: int = 0
    rejected_overload: int = 0
    # Sequences that became terminal in this completion, in plan order.
    finished_ids: list[str] = field(default_factory=list)
    failed_ids: list[str] = field(default_factory=list)
    stale_refreshes: int = 0  # cumulative copy (attached prefix store, §2.12)
    # Every sequence that ended in this completion (those of finished_ids and failed_ids), in
    # plan order, with why: STOP, LENGTH or FAILED.
    finish_reasons: dict[str, FinishReason] = field(default_factory=dict)
    # Cold prefix hold (behaviour.md §2.3a): (id, prompt length) of each active leader a waiting
    # sequence was held on that has confirmed a token since its admission as of this completion
    # (its prompt is computed), in walk order, each once: the host keeps that prompt as a
    # resident prefix now.
    prompt_keeps: tuple[tuple[str, int], ...] = ()


@dataclass
class SchedulerMetrics:
    """Cumulative scheduler counters (`metrics()`), all ints, since the scheduler was made.

    iterations: completed iterations (one per `complete_iteration`).
    admitted: admissions counted by completed plans; a sequence re-admitted after a preemption
        counts again.
    preempted: preemptions (a sequence preempted twice counts twice).
    finished: sequences that ended normally (an end token or `max_tokens` reached).
    failed: sequences failed by a completion (a sampling row left without an output).
    cancelled: sequences removed by `cancel`, waiting or active.
    rejected_overload: submits refused with `QueueFull`.
    prefill_tokens, recompute_tokens, decode_tokens: tokens of completed plans, by row phase.
    prefix_hits, prefix_misses: accepted submits with and without a `PrefixRestore`.
    active_sequences, waiting_sequences: the current sizes of the active set and the waiting
        queue (not cumulative).
    discarded_rows: sampling rows of completed plans whose sequence had ended, been cancelled
        or been preempted after the plan was made (the output is dropped, §2.11).
    aborted_plans: plans undone by `abort_iteration`, or replaced before completion at depth 1.
    restored_tokens: with an attached prefix store, prompt tokens admitted as prefix restores
        (a re-admission after preemption counts again).
    stale_refreshes: with an attached prefix store, waiting sequences whose restore or saved
        cost changed when re-read before a selection (§2.12).
    preempted_priority: of `preempted`, the preemptions made for priority (§2.8a); the others
        were made for memory pressure.
    slo_relegated: sequences a slack-rule prefill order put behind the others because their
        first-token deadline could no longer be met (§2.13), each counted once.

    With an attached prefix store, prefix_hits / prefix_misses count admissions with and without
    a restore instead of submits.
    """

    iterations: int = 0
    admitted: int = 0
    preempted: int = 0
    finished: int = 0
    failed: int = 0
    cancelled: int = 0
    rejected_overload: int = 0
    prefill_tokens: int = 0
    recompute_tokens: int = 0
    decode_tokens: int = 0
    prefix_hits: int = 0
    prefix_misses: int = 0
    active_sequences: int = 0
    waiting_sequences: int = 0
    discarded_rows: int = 0
    aborted_plans: int = 0
    restored_tokens: int = 0
    stale_refreshes: int = 0
    preempted_priority: int = 0
    slo_relegated: int = 0

    def copy(self) -> "SchedulerMetrics":
        return _dc_replace(self)


@dataclass
class SchedulerSnapshot:
    """Who is where, and the memory they hold (`snapshot()`); a copy, not a live view.

    active_ids: ids of the active sequences, in walk (admission) order (§0.4a).
    waiting_ids: ids of the waiting sequences, in queue order (front first; a preempted
        sequence goes back to the front).
    component_used_bytes: (name, used bytes) per configured memory component, in config
        order, as the scheduler counts them: admissions add their reservations, releases take
        them back, and a measured value given to `preempt_for_component_pressure` replaces
        the count.
    """

    active_ids: list[str] = field(default_factory=list)
    waiting_ids: list[str] = field(default_factory=list)
    component_used_bytes: list[tuple[str, int]] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------
# Errors (§1.4, §0.4e, §0.7)


class AdmissionError(Exception):
    """`submit` refused a sequence; compare with ==. `reason` says why (a `RejectReason`)."""

    reason: RejectReason

    def _key(self) -> tuple[object, ...]:
        return (type(self), self.args)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, AdmissionError):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())


class QueueFull(AdmissionError):
    reason = RejectReason.QUEUE_FULL

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.capacity = capacity

    def __str__(self) -> str:
        return f"scheduler waiting queue is full ({self.capacity} requests)"


class DuplicateSequence(AdmissionError):
    reason = RejectReason.DUPLICATE

    def __init__(self, id: str) -> None:  # noqa: A002 - the public attribute name
        super().__init__(id)
        self.id = id

    def __str__(self) -> str:
        return f"sequence id is already queued or active: {self.id}"


class EmptyPrompt(AdmissionError):
    reason = RejectReason.EMPTY_PROMPT

    def __init__(self) -> None:
        super().__init__()

    def __str__(self) -> str:
        return "sequence prompt must contain at least one token"


class StalePlanError(ValueError):
    """The plan was already completed or a newer plan replaced it."""


class PlanInFlight(ValueError):
    """A plan cannot be made (max_inflight_plans are live) or a live plan was completed out of
    the order the plans were made in; nothing changed (§2.11)."""


class MalformedOutputs(ValueError):
    """Sampled outputs that name a row outside the plan, a row twice, or a non-sampling row."""

