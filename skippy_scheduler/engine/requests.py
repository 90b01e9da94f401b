"""What the engine takes and emits: requests, per-request events, and its own bookkeeping.

`Request` is the plain request a caller submits (any object with `id`, `arrival_us` and
`to_sequence()` works the same); `TokenEvent` and `FinishEvent` are what listeners and streams
receive. `_Entry` (one submission) and `_InFlight` (one plan between plan and completion) are the
engine's own records.
"""
from __future__ import annotations

import math
import numbers
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Sequence as _Seq, Union

import numpy as np
import numpy.typing as npt

from .._validate import as_float
from ..inflight import StampedFuture
from ..sampling import SampleDetail
from ..types import RejectReason, Sequence

if TYPE_CHECKING:  # pragma: no cover
    from .contract import ExecutionHandle, Plan


# A request's prompt: token ids as a sequence of ints or a one-dimensional integer array (what
# `Sequence` copies them from).
TokenIds = Union[_Seq[int], npt.NDArray[np.integer[Any]]]


class EngineStalled(RuntimeError):
    """The scheduler made an empty plan while requests were waiting or running: nothing the
    engine can do will ever make progress (e.g. a prompt that can never fit in memory)."""


class RequestNeverFits(EngineStalled, ValueError):
    """A request whose reservation exceeds what a memory component of the scheduler's config
    holds even with nothing else admitted (docs/behaviour.md §2.10): it could never run, and
    would stall the engine once it was alone. Refused when it arrives, before the scheduler
    takes it; it ends as `rejected` (docs/hosts.md, "Requests that could never run"). An
    `EngineStalled` (the run could not progress with it) and a `ValueError`, as a bad request
    is."""


def _check_budget(request_id: Any, name: str, value: Any) -> None:
    """`ttft_ms` / `itl_ms`: None, or a finite number of ms > 0 (TypeError, ValueError)."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"request {request_id!r}: {name} must be a number of ms or None, got "
                        f"{type(value).__name__}")
    ms = as_float(value)
    if not (math.isfinite(ms) and ms > 0):
        raise ValueError(f"request {request_id!r}: {name} must be a finite number of ms > 0, "
                         f"got {value}")


@dataclass
class Request:
    """A request as the engine takes it: an id, an arrival time and how to build the sequence.

    `arrival_us` is on the engine's clock; None means "when submitted". Any object with `id`,
    `arrival_us` and `to_sequence()` works the same (the lab's workloads build theirs lazily).
    `ttft_ms` (a first-token deadline, from the arrival) and `itl_ms` (an inter-token target)
    are the request's own deadlines (docs/behaviour.md §2.13), None for none.
    `prompt_tokens` is a sequence of ints or a one-dimensional integer array (`np.arange(...)`),
    copied into the `Sequence` when the request arrives.
    """

    id: str
    prompt_tokens: TokenIds
    max_tokens: int
    arrival_us: Optional[float] = None
    priority: int = 0
    sampling: Any = None
    ttft_ms: Optional[float] = None
    itl_ms: Optional[float] = None

    def check_budgets(self) -> None:
        """`ttft_ms` and `itl_ms`: None or a finite number of ms > 0 (TypeError, ValueError
        naming the field)."""
        for name in ("ttft_ms", "itl_ms"):
            _check_budget(self.id, name, getattr(self, name))

    def to_sequence(self) -> Sequence:
        self.check_budgets()
        seq = Sequence(self.id, self.prompt_tokens, self.max_tokens, self.sampling,
                       self.priority)
        if self.itl_ms is not None:
            seq.with_deadlines(itl_target=self.itl_ms / 1e3)
        return seq


@dataclass(frozen=True)
class TokenEvent:
    """`request_id` sampled `token` at `time_us` (end of the iteration).

    `detail` is what the host reported with the sample (`SampleDetail`: log-probabilities),
    None when the sequence asked for nothing (`SamplingParams.output`). Only an event with a
    detail may carry a negative token: the end signal, sent to deliver its detail."""

    request_id: str
    token: int
    time_us: float
    detail: Optional[SampleDetail] = None


@dataclass(frozen=True)
class AcceptEvent:
    """The scheduler took `request_id` at `time_us` (it waits or runs from now on)."""

    request_id: str
    time_us: float


@dataclass(frozen=True)
class FinishEvent:
    """`request_id` ended at `time_us`: reason is length, stop, failed, cancelled or rejected
    (the values of `FinishReason`, and "rejected").

    A rejected request never reached the scheduler's queues; `rejection` says why (a
    `RejectReason`: QUEUE_FULL is "try again later", the others a bad request), or is None when
    the request itself was invalid (its `to_sequence` or the host's `prepare_sequence` raised
    TypeError or ValueError; `error` has the message)."""

    request_id: str
    reason: str
    time_us: float
    error: Optional[str] = None
    rejection: Optional[RejectReason] = None


Event = Union[AcceptEvent, TokenEvent, FinishEvent]

_PENDING, _SUBMITTED, _ENDED = 0, 1, 2


class _InFlight:
    """A plan between plan_iteration and complete_iteration, as the engine tracks it.

    NOTE: only `plan` is set per plan; every other field keeps its class default until a
    clock, an observer or a pipelined step writes it, so the bare step allocates almost nothing.
    """

    start: float = 0
    owners: list[int] = []  # never mutated: a recorder assigns a list of its own
    token_count = 0
    decode = 0
    measured_us = 0.0
    handle: Optional["ExecutionHandle"] = None
    t0 = 0
    done_ns = 0  # when the host's worker finished it (a handle's done callback), 0: not seen
    entries: Optional[list[Any]] = None  # depth > 1: each row's request, and its
    voids: list[int] = []                # preemption count when the plan was made

    def __init__(self, plan: "Plan") -> None:
        self.plan = plan

    def row_current(self, row: int) -> bool:
        """Row `row`'s request has neither ended nor been preempted since the plan was made
        (always, at depth 1: nothing happens between making and running a plan there). For
        observers; the step's own path tests the same inline."""
        entries = self.entries
        return entries is None or (entries[row].state == _SUBMITTED
                                   and entries[row].voids == self.voids[row])

    def stamp_done(self, _handle: Any) -> None:
        """A handle's done callback (on the host's worker thread): the execution's end."""
        if not self.done_ns:
            # A worker that holds a handle until the next plan launches stamps the end itself.
            ended = _handle.ended_ns if isinstance(_handle, StampedFuture) else 0
            self.done_ns = ended or time.perf_counter_ns()


class _Entry:
    """Engine-side state of one submission (the recorder keeps what it looked like)."""

    __slots__ = ("id", "state", "record", "request", "voids", "quiet")

    def __init__(self, request: Any, record: int) -> None:
        self.id: str = request.id
        self.state = _PENDING
        self.voids = 0  # preemptions: rows planned before one are void (their output is dropped)
        self.record = record  # index in the recorder, -1 without one
        self.request = request
        # Submitted from another thread (through the inbox): its refusals are events only,
        # never raised on the engine's thread.
        self.quiet = False


class _SequenceRequest:
    __slots__ = ("id", "arrival_us", "_sequence")

    def __init__(self, sequence: Sequence, arrival_us: Optional[float]) -> None:
        self.id = sequence.id
        self.arrival_us = arrival_us
        self._sequence = sequence

    def to_sequence(self) -> Sequence:
        return self._sequence
