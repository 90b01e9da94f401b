"""The reference scheduler's iteration plan and sampled-output block.

Owns `TwinPlan` and `TwinOutputs`, the same surface as the native `IterationPlan` and
`PlanOutputs` (row views as numpy arrays, an outputs block written in place), the reading of
a completion's outputs block against a plan (behaviour.md §0.4e), and what plans in flight keep
per sequence and per row (`Flight`, `RowUndo`, §2.11).
"""
from __future__ import annotations

from typing import Hashable, Iterator, Optional

import numpy as np

from .._validate import check_uint
from ..types import IterationPhase, IterationWork, MalformedOutputs, Sequence, StalePlanError

PLACEHOLDER = -1  # a generated token whose sampling row is still in flight (§2.11)


class Flight:
    """In-flight state of one sequence incarnation: `epoch` changes whenever rows planned for
    it become void (preemption; a new submit is a new incarnation), `pending` counts its
    placeholder tokens, `source` is the (plan step, work index) that samples the newest one.
    Fair share: `request` names the submission for the lift rule (it survives preemption) and
    `tenant` is whose service it is."""

    __slots__ = ("epoch", "pending", "source", "request", "tenant", "priority_preempted_at",
                 "last_token_us", "submitted_us", "planned", "held_steps", "held_walk", "lead",
                 "lead_base", "admit_gen", "held_restore", "held_on", "no_lead", "slo_relegated")

    def __init__(self, epoch: int, tenant: Hashable = None, submitted_us: float = 0.0) -> None:
        self.epoch = epoch
        self.pending = 0
        self.source: Optional[tuple[int, int]] = None
        self.request = epoch
        self.tenant = tenant
        # Disjoint plans in flight (§2.11a): the step of the last plan with a row of it.
        self.planned: Optional[int] = None
        # The plan step of its last preemption for priority (§2.8a), None if none.
        self.priority_preempted_at: Optional[int] = None
        # The scheduler clock (µs) at its last token, or at its admission (§2.13).
        self.last_token_us = 0.0
        # The scheduler clock (µs) at its submit, kept across preemption: its age in the slack
        # rule's prefill order (§2.13).
        self.submitted_us = submitted_us
        # Cold prefix hold (§2.3a, hold.py): plans it was held while waiting, the admission
        # walk that last held it (0: none), its restore and leader then, its leader state, its
        # confirmed tokens when first held on and at its admission, and whether it may lead (not
        # when admitted after a hold that gained it nothing, its leader still active).
        self.held_steps = 0
        self.held_walk = 0
        self.held_restore = 0
        self.held_on: Optional[tuple[str, Optional[int]]] = None  # (id, admitted_at)
        self.lead = 0
        self.lead_base = 0
        self.admit_gen = 0
        self.no_lead = False
        # Put behind by the prefill order for its first-token deadline (§2.13), counted once.
        self.slo_relegated = False


class RowUndo:
    """What undoing one planned row needs (abort_iteration)."""

    __slots__ = ("seq", "epoch", "cursor", "sampled", "source", "new")

    def __init__(self, seq: Sequence, epoch: int, cursor: int, sampled: bool,
                 source: Optional[tuple[int, int]], new: bool) -> None:
        self.seq = seq
        self.epoch = epoch
        self.cursor = cursor
        self.sampled = sampled
        self.source = source
        self.new = new



class TwinOutputs:
    """Sampled-output block: entry k says row `request_indexes[k]` sampled `predicted_tokens[k]`.

    As the native block: `count` needs its plan live (StalePlanError otherwise); the arrays,
    once handed out, and `capacity` do not.
    """

    __slots__ = ("_request_indexes", "_predicted_tokens", "_count", "_plan")

    def __init__(self, capacity: int, plan: Optional["TwinPlan"] = None) -> None:
        self._request_indexes = np.zeros(capacity, dtype=np.uint64)
        self._predicted_tokens = np.zeros(capacity, dtype=np.int32)
        self._count = 0
        self._plan = plan  # whose liveness `count` checks (None: a block of no plan)

    # The arrays are written in place (like native output buffers), never replaced.
    @property
    def request_indexes(self) -> np.ndarray:
        return self._request_indexes

    @property
    def predicted_tokens(self) -> np.ndarray:
        return self._predicted_tokens

    @property
    def capacity(self) -> int:
        return len(self._request_indexes)

    @property
    def count(self) -> int:
        if self._plan is not None:
            self._plan._check()
        return self._count

    @count.setter
    def count(self, value: int) -> None:
        if self._plan is not None:
            self._plan._check()
        count = check_uint("outputs.count", value)
        if count > self.capacity:  # (as the native block refuses it)
            raise ValueError(f"count must be in [0, {self.capacity}]")
        self._count = count


class TwinPlan:
    """Rows of one iteration plus flat numpy views of them (row index = work index).

    `step` counts the scheduler's plans from 0. `deferred_rows[j]`'s input token is the token
    that plan `deferred_source_steps[j]` samples at work index `deferred_source_indexes[j]`
    (the arena holds -1 there until `resolve_deferred` writes it, §2.11).

    As the native `IterationPlan` (behaviour.md §0.7): the views (arrays, `outputs`,
    `prefill_positions`) raise StalePlanError once the plan is no longer live; `token_count`,
    `admitted`, `preempted`, `priority_victims`, `step`, `live` and `len()` stay readable, and
    so do `work` and `sequence_ids` once read while it was live (`sequence_ids` always with
    plans in flight, `ids_kept`). The scheduler reads its own copies (`_rows`, `_outputs`).
    """

    def __init__(self, work: list[IterationWork], token_count: int, admitted: int,
                 step: int = 0, deferred: list[tuple[int, int, int]] | None = None,
                 ids_kept: bool = False) -> None:
        # The scheduler reads its own copy of the rows, so editing `work` cannot confuse it.
        self._rows = tuple(work)
        self._work = work
        self._work_read = False  # `work` was read while live: readable afterwards
        self.token_count = token_count
        self.admitted = admitted
        self.preempted = 0
        self.priority_victims: tuple[str, ...] = ()  # ids its admission preempted (§2.8a)
        rows = len(work)
        lengths = np.fromiter((len(w.tokens) for w in work), dtype=np.intp, count=rows)
        self._row_offsets = np.zeros(rows + 1, dtype=np.intp)
        np.cumsum(lengths, out=self._row_offsets[1:])
        self._tokens = np.fromiter((t for w in work for t in w.tokens), dtype=np.int32,
                                   count=token_count)
        self._positions = np.fromiter((p for w in work for p in w.positions), dtype=np.int32,
                                      count=token_count)
        self._sample_last = np.fromiter((w.sample_last for w in work), dtype=np.bool_,
                                        count=rows)
        self._phases = np.fromiter((w.phase.value for w in work), dtype=np.uint8, count=rows)
        self._sample_rows = np.flatnonzero(self._sample_last).astype(np.intp)
        # First row of its sequence since admission, and what that row restored (0 otherwise).
        self._new_rows = np.fromiter((w.new_row for w in work), dtype=np.uint8, count=rows)
        self._restored_tokens = np.fromiter((w.restored_tokens for w in work), dtype=np.uintp,
                                            count=rows)
        self._ids = [w.sequence_id for w in work]
        # With plans in flight the native plan keeps its rows' ids from the start.
        self._ids_read = ids_kept
        self._outputs = TwinOutputs(rows, self)
        self.step = step
        table = deferred or []
        self._deferred_rows = np.array([d[0] for d in table], dtype=np.uintp)
        self._deferred_source_steps = np.array([d[1] for d in table], dtype=np.uint64)
        self._deferred_source_indexes = np.array([d[2] for d in table], dtype=np.uintp)
        # Scheduler-private: how to undo each row, and the planner counters before this plan.
        self._undo: list[RowUndo] = []
        self._counters: tuple[int, int, int] = (0, 0, 0)
        self._live_list: list[TwinPlan] | None = None  # the scheduler's live plans, when made

    @property
    def live(self) -> bool:
        """Not completed, aborted or replaced yet."""
        return self._live_list is not None and any(p is self for p in self._live_list)

    def _check(self) -> None:
        """StalePlanError unless the plan is live (the native message; serial = step + 1)."""
        if not self.live:
            raise StalePlanError(stale_message(self))

    # -- views: the plan must be live (native `IterationPlan._check`) -----------------------

    @property
    def tokens(self) -> np.ndarray:
        self._check()
        return self._tokens

    @property
    def positions(self) -> np.ndarray:
        self._check()
        return self._positions

    @property
    def row_offsets(self) -> np.ndarray:
        self._check()
        return self._row_offsets

    @property
    def sample_last(self) -> np.ndarray:
        self._check()
        return self._sample_last

    @property
    def phases(self) -> np.ndarray:
        self._check()
        return self._phases

    @property
    def sample_rows(self) -> np.ndarray:
        self._check()
        return self._sample_rows

    @property
    def new_rows(self) -> np.ndarray:
        self._check()
        return self._new_rows

    @property
    def restored_tokens(self) -> np.ndarray:
        self._check()
        return self._restored_tokens

    @property
    def deferred_rows(self) -> np.ndarray:
        self._check()
        return self._deferred_rows

    @property
    def deferred_source_steps(self) -> np.ndarray:
        self._check()
        return self._deferred_source_steps

    @property
    def deferred_source_indexes(self) -> np.ndarray:
        self._check()
        return self._deferred_source_indexes

    @property
    def outputs(self) -> TwinOutputs:
        self._check()
        return self._outputs

    @property
    def prefill_positions(self) -> int:
        """Sum of the positions of the prefill and recompute tokens (`StepCost`, §2.13)."""
        self._check()
        return sum(sum(w.positions) for w in self._rows if w.phase is not IterationPhase.DECODE)

    # -- built on first use (native): readable afterwards once read while live ---------------

    @property
    def work(self) -> list[IterationWork]:
        if not self._work_read:
            self._check()
            self._work_read = True
        return self._work

    @property
    def sequence_ids(self) -> list[str]:
        if not self._ids_read:
            self._check()
            self._ids_read = True
        return self._ids

    def __len__(self) -> int:
        return len(self._rows)

    def __iter__(self) -> Iterator[IterationWork]:
        return iter(self.work)

    def __getitem__(self, index: int) -> IterationWork:
        return self.work[index]

    def decode_rows(self) -> int:
        self._check()
        return sum(1 for w in self._rows if w.phase is IterationPhase.DECODE)

    def __repr__(self) -> str:
        rows = ", ".join(f"{w.sequence_id}:{w.phase.name}x{len(w.tokens)}" for w in self._rows)
        return f"TwinPlan(token_count={self.token_count}, admitted={self.admitted}, rows=[{rows}])"


def stale_message(plan: TwinPlan) -> str:
    """The native StalePlanError message (a plan's serial is its step + 1)."""
    return f"plan {plan.step + 1} is no longer live (completed, aborted or replaced)"


def read_outputs(plan: TwinPlan) -> dict[int, int]:
    """Work index -> token, from the plan's outputs block.

    Raises MalformedOutputs for a count above the rows, an index outside the plan, a repeated
    index or a row that does not sample (§0.4e); nothing has changed at that point.
    """
    rows = len(plan._rows)
    outputs = plan._outputs  # (the scheduler's own read: no liveness check)
    count = outputs._count
    if count > rows:
        raise MalformedOutputs(f"outputs.count {count} exceeds the plan's {rows} rows")
    indexes = outputs._request_indexes[:count].tolist()
    tokens = outputs._predicted_tokens[:count].tolist()
    slots: dict[int, int] = {}
    for index, token in zip(indexes, tokens):
        if index >= rows:
            raise MalformedOutputs(f"output names work index {index}, the plan has {rows} rows")
        if index in slots:
            raise MalformedOutputs(f"work index {index} has more than one output")
        if not plan._rows[index].sample_last:
            raise MalformedOutputs(f"work index {index} does not sample")
        slots[index] = token
    return slots
