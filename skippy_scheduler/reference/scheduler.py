"""Reference scheduler engine (behaviour.md §2 with the §0 decisions).

Owns `TwinScheduler`: admission, chunked and mixed planning, completion, preemption and
cancel, written for clarity rather than speed. The native `Scheduler` must produce the same
plans, telemetry and state for every input. Every method validates its arguments before it
changes anything.
"""
from __future__ import annotations

import itertools
import math
import numbers
import weakref
from typing import Hashable, Iterable, Optional

from .._validate import I32_MAX, USIZE_MAX, check_id, check_uint, sat, sat_sub
from .plan import TwinPlan, read_predictions
from ..cache_policy import CacheAwareCandidate
from ..prefix_store import store_affinity
from ..policies import (
    AdmissionKind,
    AdmissionPolicy,
    CacheAwareAdmission,
    FairShareAdmission,
    LowestPriorityNewest,
    PreemptionPolicy,
    VictimCandidate,
    VirtualTokenCounters,
)
from ..types import (
    DuplicateSequence,
    EmptyPrompt,
    FinishReason,
    IterationPhase,
    IterationPrediction,
    IterationTelemetry,
    IterationWork,
    PlanInFlight,
    QueueFull,
    SchedulerConfig,
    SchedulerMetrics,
    SchedulerSnapshot,
    Sequence,
    SequenceStatus,
    StalePlanError,
)

EWMA_ALPHA = 0.25
MIXED_SLOWDOWN_FRACTION = 0.20
MIXED_MIN_EXTRA_US = 8_000.0
MIXED_MAX_EXTRA_US = 20_000.0


PLACEHOLDER = -1  # a generated token whose sampling row is still in flight (§2.11)


class _Flight:
    """In-flight state of one sequence incarnation: `epoch` changes whenever rows planned for
    it become void (preemption; a new submit is a new incarnation), `pending` counts its
    placeholder tokens, `source` is the (plan step, work index) that samples the newest one.
    Fair share: `request` names the submission for the lift rule (it survives preemption) and
    `tenant` is whose service it is."""

    __slots__ = ("epoch", "pending", "source", "request", "tenant")

    def __init__(self, epoch: int, tenant: Hashable = None) -> None:
        self.epoch = epoch
        self.pending = 0
        self.source: Optional[tuple[int, int]] = None
        self.request = epoch
        self.tenant = tenant


class _RowUndo:
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


def _prefill_pending(s: Sequence) -> bool:
    return s.prefill_cursor < s.recompute_token_count()


def _release_pins(store: object, pinned: dict) -> None:
    for entry in pinned.values():
        if getattr(entry, "alive", False):
            store.unpin(entry)  # type: ignore[attr-defined]
    pinned.clear()


class TwinScheduler:
    """Iteration-level scheduler: admission, chunked prefill, decode and preemption."""

    def __init__(
        self,
        config: SchedulerConfig | None = None,
        admission: AdmissionPolicy | None = None,
        preemption: PreemptionPolicy | None = None,
    ) -> None:
        if config is None:
            config = SchedulerConfig()
        if not isinstance(config, SchedulerConfig):
            raise TypeError(f"config must be a SchedulerConfig, got {type(config).__name__}")
        if admission is None:
            admission = CacheAwareAdmission()
        if not isinstance(admission, AdmissionPolicy):
            raise TypeError(f"admission must be an AdmissionPolicy, got {type(admission).__name__}")
        if preemption is None:
            preemption = LowestPriorityNewest()
        if not isinstance(preemption, PreemptionPolicy):
            raise TypeError(f"preemption must be a PreemptionPolicy, got {type(preemption).__name__}")
        self._config = config.normalized()
        self._admission = admission.resolved(self._config)
        self._preemption = preemption
        self._components = list(self._config.memory_components)
        self._used = [0] * len(self._components)
        self._waiting: list[Sequence] = []
        self._active: dict[str, Sequence] = {}  # insertion order = admission (walk) order
        self._fresh: set[str] = set()  # active ids with no row planned since admission
        self._retired: list[Sequence] = []  # left since the last plan, as snapshots
        self._metrics = SchedulerMetrics()
        self._consecutive_prefill = 0
        self._waiting_turn = 0
        self._next_order = 0
        self._dirty = False
        self._admission_counter = 0
        self._decode_us_ewma: dict[int, float] = {}
        self._mixed_viable = True
        self._mixed_cursor = 0
        self._live_plans: list[TwinPlan] = []  # oldest first
        self._steps = 0
        self._flights: dict[str, _Flight] = {}
        self._epochs = itertools.count(1)
        self._row_undo: list[tuple[Sequence, int]] = []  # (sequence, cursor before) per row
        # attached prefix store (§2.12)
        self._store: Optional[object] = None
        self._aff_costs = (1, 0)
        self._store_epoch = 0
        self._restore_entry: dict[str, object] = {}  # waiting: the entry of its last read
        self._pinned: dict[str, object] = {}  # active: the entry pinned at admission
        self._pin_finalizer: Optional[weakref.finalize] = None

        # Fair share as the core runs it (AdmissionKind.FAIR_SHARE, behaviour.md §3.6): this
        # scheduler's own counters, seeded with the policy's settings, and the tenants seen.
        self._fair: Optional[FairShareAdmission] = None
        self._tenants: dict[Hashable, None] = {}
        a = self._admission
        if type(a) is FairShareAdmission and a.native_kind == AdmissionKind.FAIR_SHARE:
            self._fair = FairShareAdmission(within=a.within, counters=a.counters.blank())
            self._tenants = dict.fromkeys([None, *a.counters.weights])

    # -- prefix store (§2.12) -------------------------------------------------------------------

    def attach_prefix_store(self, store: object, *, prefill_cost_per_token: int = 1,
                            restore_cost_per_token: int = 0) -> None:
        prefill = check_uint("prefill_cost_per_token", prefill_cost_per_token)
        restore = check_uint("restore_cost_per_token", restore_cost_per_token)
        if self._waiting or self._active or self._live_plans:
            raise ValueError("a prefix store can only be attached or detached while the "
                             "scheduler holds no sequence and no live plan")
        # A store serves one scheduler at a time: its pins are that scheduler's. The owner is
        # held weakly, so a scheduler that is gone releases its store as a freed one does.
        owner = getattr(store, "_owner", None) if store is not None else None
        if owner is not None and owner() is not None and owner() is not self:
            raise ValueError("the prefix store serves another scheduler")
        if self._store is not None and self._store is not store:
            self._store._owner = None  # type: ignore[attr-defined]
        if self._pin_finalizer is not None:
            self._pin_finalizer.detach()
            self._pin_finalizer = None
        if store is not None:
            store._owner = weakref.ref(self)  # type: ignore[attr-defined]
            # A scheduler dropped while sequences are active gives their pins back (the store
            # may serve the next one). The finalizer holds the pin table, not the scheduler.
            self._pin_finalizer = weakref.finalize(self, _release_pins, store, self._pinned)
        self._store = store
        self._aff_costs = (prefill, restore)
        self._store_epoch = store.epoch if store is not None else 0  # type: ignore[attr-defined]

    @property
    def prefix_store(self) -> Optional[object]:
        return self._store

    def _read_affinity(self, s: Sequence, keep_epoch: bool = False) -> bool:
        """Reads `s`'s restore from the store; True when its restore or saved cost changed."""
        store = self._store
        assert store is not None
        hit = store.match(s.prompt_tokens)  # type: ignore[attr-defined]
        before = (s.prefix_restore.token_count if s.prefix_restore is not None else 0,
                  s.cache_affinity.estimated_saved_cost())
        epoch = store.epoch  # type: ignore[attr-defined]
        restore, affinity = store_affinity(hit.matched_tokens, *self._aff_costs, epoch)
        changed = (hit.matched_tokens, affinity.estimated_saved_cost()) != before
        if changed or not keep_epoch:
            s.prefix_restore, s.cache_affinity = restore, affinity
        self._restore_entry[s.id] = hit.entry if hit.matched_tokens else None
        replay_len = s.recompute_token_count()
        cursor = min(hit.matched_tokens, replay_len)
        if not s.generated_tokens:
            cursor = min(cursor, sat_sub(replay_len, 1))
        s.prefill_cursor = cursor
        return changed

    def _refresh_affinity(self) -> None:
        """Before selection: every waiting sequence re-read if the store changed since."""
        store = self._store
        if store is None or store.epoch == self._store_epoch:  # type: ignore[attr-defined]
            return
        for s in self._waiting:
            if self._read_affinity(s, keep_epoch=True):
                self._metrics.stale_refreshes = sat(self._metrics.stale_refreshes + 1)
                self._dirty = True
        self._store_epoch = store.epoch  # type: ignore[attr-defined]

    def _restore_holder(self, s: Sequence) -> Optional[int]:
        """The holder of the entry `s` was admitted with, which every row of it names."""
        entry = self._pinned.get(s.id)
        return None if entry is None else entry.holder  # type: ignore[attr-defined]

    def _unpin(self, s: Sequence) -> None:
        entry = self._pinned.pop(s.id, None)
        if entry is not None:
            self._store.unpin(entry)  # type: ignore[union-attr]

    @property
    def config(self) -> SchedulerConfig:
        return self._config.replace()

    @property
    def admission_policy(self) -> AdmissionPolicy:
        return self._admission

    @property
    def preemption_policy(self) -> PreemptionPolicy:
        return self._preemption

    # -- submit / admission ---------------------------------------------------------------------

    def submit(self, seq: Sequence) -> None:
        if not isinstance(seq, Sequence):
            raise TypeError(f"submit takes a Sequence, got {type(seq).__name__}")
        s = seq._validated_copy()
        if not s.prompt_tokens:
            raise EmptyPrompt()
        if s.id in self._active or any(w.id == s.id for w in self._waiting):
            raise DuplicateSequence(s.id)
        if len(self._waiting) >= self._config.max_waiting_sequences:
            self._metrics.rejected_overload = sat(self._metrics.rejected_overload + 1)
            raise QueueFull(self._config.max_waiting_sequences)
        if self._store is not None:
            if s.prefix_restore is not None or s.cache_affinity.stages or s.prefill_cursor:
                raise ValueError("a prefix store is attached: it decides prefix restores and "
                                 "saved costs, so the descriptor must carry none")
            self._read_affinity(s)
        elif s.prefix_restore is not None:
            self._metrics.prefix_hits = sat(self._metrics.prefix_hits + 1)
        else:
            self._metrics.prefix_misses = sat(self._metrics.prefix_misses + 1)
        # A caller-set cursor never skips the pending token nor leaves nothing runnable (§0.4b),
        # and admission numbers come only from this scheduler's counter (§0.4c).
        replay_len = s.recompute_token_count()
        s.prefill_cursor = min(s.prefill_cursor, replay_len)
        if not s.generated_tokens and s.prefill_cursor >= replay_len:
            s.prefill_cursor = replay_len - 1
        s.admitted_at = None
        s.enqueued_turn = self._waiting_turn
        s.enqueue_order = self._next_order
        self._next_order = sat(self._next_order + 1)
        self._waiting.append(s)
        tenant = None
        if self._fair is not None:
            tenant = FairShareAdmission.tenant_of_sequence(s)
            self._tenants.setdefault(tenant, None)
        self._flights[s.id] = _Flight(next(self._epochs), tenant)
        self._dirty = True
        self._refresh_counts()

    def _live_decode(self, s: Sequence) -> bool:
        """Has a pending token to feed, and its in-flight samples leave room under max_tokens."""
        if not s.generated_tokens or s.prefill_cursor < s.recompute_token_count():
            return False
        fl = self._flights[s.id]
        return not (fl.pending and len(s.generated_tokens) >= s.max_tokens)

    def _confirmed(self, s: Sequence) -> list[int]:
        fl = self._flights.get(s.id)
        n = len(s.generated_tokens) - (fl.pending if fl is not None else 0)
        return s.generated_tokens[:n]

    def _drop_placeholders(self, s: Sequence) -> None:
        fl = self._flights[s.id]
        if fl.pending:
            del s.generated_tokens[len(s.generated_tokens) - fl.pending:]
            fl.pending = 0
        fl.source = None

    def _reservation(self, s: Sequence) -> list[int]:
        return [c.reservation_bytes(s.admission_tokens) for c in self._components]

    def _fits(self, reservation: list[int]) -> bool:
        return all(
            sat(used + r) <= c.available_bytes()
            for used, r, c in zip(self._used, reservation, self._components)
        )

    def _ranked_waiting(self, turn: int) -> list[Sequence]:
        candidates = [
            CacheAwareCandidate(
                index=i,
                priority=s.priority,
                affinity=s.cache_affinity,
                prompt_tokens=tuple(s.prompt_tokens),  # a policy cannot edit the queue's prompts
                enqueued_turn=s.enqueued_turn,
                order=s.enqueue_order,
                tenant=s.tenant,
            )
            for i, s in enumerate(self._waiting)
        ]
        if self._fair is not None:
            flights = [self._flights[s.id] for s in self._waiting]
            order = self._fair.rank(
                candidates, turn, [f.tenant for f in flights], [f.request for f in flights],
                [sat_sub(len(s.prompt_tokens),
                         s.prefix_restore.token_count if s.prefix_restore is not None else 0)
                 for s in self._waiting])
        else:
            order = self._admission.order(candidates, turn)
        try:
            order = [int(i) for i in order]
        except (TypeError, ValueError):
            raise TypeError("admission policy must return a list of candidate indexes") from None
        if sorted(order) != list(range(len(candidates))):
            raise ValueError("admission policy must return a permutation of the candidate indexes")
        return [self._waiting[i] for i in order]

    def _admit_waiting(self) -> int:
        """Admit front to back; a request that does not fit is skipped, not waited on (§2.3)."""
        admitted = 0
        deferred: list[Sequence] = []
        for s in self._waiting:
            if len(self._active) >= self._config.max_active_sequences:
                deferred.append(s)
                continue
            reservation = self._reservation(s)
            if not self._fits(reservation):
                deferred.append(s)
                continue
            self._used = [sat(u + r) for u, r in zip(self._used, reservation)]
            if self._store is not None:
                m = self._metrics
                if s.prefix_restore is not None:
                    m.prefix_hits = sat(m.prefix_hits + 1)
                    m.restored_tokens = sat(m.restored_tokens + s.prefix_restore.token_count)
                else:
                    m.prefix_misses = sat(m.prefix_misses + 1)
                entry = self._restore_entry.pop(s.id, None)
                if entry is not None:
                    self._store.pin(entry)  # type: ignore[attr-defined]
                    self._pinned[s.id] = entry
            s.status = SequenceStatus.Running
            self._admission_counter = sat(self._admission_counter + 1)
            s.admitted_at = self._admission_counter
            self._active[s.id] = s
            self._fresh.add(s.id)
            admitted += 1
        self._waiting = deferred
        self._refresh_counts()
        return admitted

    # -- planning -------------------------------------------------------------------------------

    def retired(self) -> list[Sequence]:
        """Sequences that left since the last plan (finished, failed, cancelled), as snapshots
        with their generated tokens; the next `plan_iteration` forgets them."""
        return list(self._retired)

    def plan_iteration(self) -> TwinPlan:
        depth = self._config.max_inflight_plans
        if depth > 1 and len(self._live_plans) >= depth:
            raise PlanInFlight(f"{depth} plans are in flight (max_inflight_plans); complete "
                               "or abort the oldest first")
        self._retired = []
        turn = sat(self._waiting_turn + 1)
        self._refresh_affinity()
        if self._dirty:
            # Rank first so that a failing user policy leaves everything as it was.
            self._waiting = self._ranked_waiting(turn)
            self._dirty = False
        self._waiting_turn = turn
        admitted = self._admit_waiting()
        if depth == 1 and self._live_plans:
            # Depth 1: the new plan replaces the live one, which is undone first (§0.4f). It
            # comes after ranking and admission, which it does not affect, so a failing
            # admission policy leaves the live plan as it was.
            self._abort_from(0)
        counters = (self._consecutive_prefill, self._mixed_cursor)
        live = sum(1 for s in self._active.values() if self._live_decode(s))
        rows = min(live, self._config.max_tokens_per_iteration)
        self._row_undo = []
        if (
            self._config.mixed_prefill_decode
            and self._mixed_viable
            and rows > 0
            and rows in self._decode_us_ewma
        ):
            work = self._plan_mixed()
        else:
            work = self._plan_homogeneous()
        step = self._steps
        self._steps += 1
        undo: list[_RowUndo] = []
        deferred: list[tuple[int, int, int]] = []
        for r, (w, (s, before)) in enumerate(zip(work, self._row_undo)):
            fl = self._flights[s.id]
            previous = fl.source
            if w.phase is IterationPhase.Decode and fl.pending:
                assert previous is not None
                deferred.append((r, previous[0], previous[1]))  # its input is still in flight
            if w.sample_last:
                s.generated_tokens.append(PLACEHOLDER)
                fl.pending += 1
                fl.source = (step, r)
            undo.append(_RowUndo(s, fl.epoch, before, w.sample_last, previous, w.new_row))
        plan = TwinPlan(work, sum(len(w.tokens) for w in work), admitted, step, deferred)
        plan._undo = undo
        plan._counters = counters
        plan._live_list = self._live_plans
        self._live_plans.append(plan)
        return plan

    def _take_new(self, s: Sequence) -> bool:
        """Whether the row being planned is `s`'s first since admission (then no later one is)."""
        if s.id not in self._fresh:
            return False
        self._fresh.discard(s.id)
        return True

    def _prefill_row(self, s: Sequence, budget: int) -> IterationWork:
        replay = s.recompute_tokens()
        start = s.prefill_cursor
        count = min(self._config.prefill_chunk_tokens, len(replay) - start, budget)
        end = start + count
        fresh = not s.generated_tokens
        new = self._take_new(s)
        self._row_undo.append((s, start))
        s.prefill_cursor = end
        return IterationWork(
            sequence_id=s.id,
            tokens=tuple(replay[start:end]),
            positions=tuple(min(p, I32_MAX) for p in range(start, end)),
            sample_last=end == len(replay) and fresh,
            phase=IterationPhase.Prefill if fresh else IterationPhase.Recompute,
            sampling=s.sampling,
            restore_holder=self._restore_holder(s),
            new_row=new,
            restored_tokens=start if new else 0,
        )

    def _decode_row(self, s: Sequence) -> IterationWork:
        position = s.recompute_token_count()
        before = s.prefill_cursor
        new = self._take_new(s)
        self._row_undo.append((s, before))
        s.prefill_cursor = sat(position + 1)  # the fed token is never replayed
        return IterationWork(
            sequence_id=s.id,
            tokens=(s.generated_tokens[-1],),
            positions=(min(position, I32_MAX),),
            sample_last=True,
            phase=IterationPhase.Decode,
            sampling=s.sampling,
            restore_holder=self._restore_holder(s),
            new_row=new,
            restored_tokens=before if new else 0,
        )

    def _prefill_limit(self) -> int:
        limit = self._config.max_prefill_sequences_per_iteration
        return USIZE_MAX if limit is None else limit

    def _plan_homogeneous(self) -> list[IterationWork]:
        active = list(self._active.values())
        has_prefill = any(_prefill_pending(s) for s in active)
        has_live_decode = any(self._live_decode(s) for s in active)
        max_consecutive = self._config.max_consecutive_prefill_iterations
        run_prefill = has_prefill and (
            not has_live_decode or max_consecutive is None or self._consecutive_prefill < max_consecutive
        )
        budget = self._config.max_tokens_per_iteration
        prefill_limit = self._prefill_limit()
        prefill_rows = 0
        work: list[IterationWork] = []
        for s in active:
            if budget == 0:
                break
            if _prefill_pending(s):
                if not run_prefill or prefill_rows >= prefill_limit:
                    continue
                row = self._prefill_row(s, budget)
                prefill_rows += 1
                budget -= len(row.tokens)
                work.append(row)
            elif not run_prefill and self._live_decode(s):
                work.append(self._decode_row(s))
                budget -= 1
        if any(w.phase is not IterationPhase.Decode for w in work):
            self._consecutive_prefill = sat(self._consecutive_prefill + 1) if has_live_decode else 0
        elif work:
            self._consecutive_prefill = 0
        return work

    def _plan_mixed(self) -> list[IterationWork]:
        active = list(self._active.values())
        n = len(active)
        budget = self._config.max_tokens_per_iteration
        work: list[IterationWork] = []
        start = self._mixed_cursor % n if n else 0
        examined = 0
        for offset in range(n):
            if budget == 0:
                break
            examined = offset + 1
            s = active[(start + offset) % n]
            if self._live_decode(s):
                work.append(self._decode_row(s))
                budget -= 1
        if n:
            self._mixed_cursor = (start + examined) % n
        prefill_limit = self._prefill_limit()
        prefill_rows = 0
        for s in active:
            if budget == 0 or prefill_rows >= prefill_limit:
                break
            if not _prefill_pending(s):
                continue
            row = self._prefill_row(s, budget)
            prefill_rows += 1
            budget -= len(row.tokens)
            work.append(row)
        self._consecutive_prefill = 0
        return work

    # -- plan feedback --------------------------------------------------------------------------

    def _check_live(self, plan: object) -> TwinPlan:
        if not isinstance(plan, TwinPlan):
            raise TypeError(f"plan must be a plan made by this scheduler, got {type(plan).__name__}")
        if not any(p is plan for p in self._live_plans):
            raise StalePlanError("the plan is no longer live (completed, aborted or replaced)")
        return plan

    @property
    def live_plans(self) -> int:
        """Plans made and not yet completed or aborted."""
        return len(self._live_plans)

    def abort_iteration(self, plan: TwinPlan) -> None:
        """Undo `plan` and every later live plan: the runtime could not run them (§2.11)."""
        self._check_live(plan)
        self._abort_from(next(i for i, p in enumerate(self._live_plans) if p is plan))

    def _abort_from(self, first: int) -> None:
        aborted = self._live_plans[first:]
        for plan in reversed(aborted):
            for u in reversed(plan._undo):
                s = u.seq
                fl = self._flights.get(s.id)
                if self._active.get(s.id) is not s or fl is None or fl.epoch != u.epoch:
                    continue  # ended, cancelled or preempted since: nothing of it to undo
                s.prefill_cursor = u.cursor
                if u.new:  # its first row is undone: the next one is new again
                    self._fresh.add(s.id)
                if u.sampled:
                    popped = s.generated_tokens.pop()
                    assert popped == PLACEHOLDER
                    fl.pending -= 1
                    fl.source = u.source
        self._consecutive_prefill, self._mixed_cursor = aborted[0]._counters
        del self._live_plans[first:]
        self._metrics.aborted_plans = sat(self._metrics.aborted_plans + len(aborted))

    def observe_iteration_duration(self, plan: TwinPlan, elapsed_seconds: float) -> None:
        self._check_live(plan)
        if isinstance(elapsed_seconds, bool) or not isinstance(elapsed_seconds, numbers.Real):
            raise TypeError(f"elapsed_seconds must be a number, got {type(elapsed_seconds).__name__}")
        elapsed_us = float(elapsed_seconds) * 1e6
        if not math.isfinite(elapsed_us) or elapsed_us <= 0:
            return
        prefill_tokens = sum(len(w.tokens) for w in plan._rows if w.phase is not IterationPhase.Decode)
        decode_rows = sum(1 for w in plan._rows if w.phase is IterationPhase.Decode)
        if decode_rows == 0:
            return
        if prefill_tokens == 0:
            previous = self._decode_us_ewma.get(decode_rows, elapsed_us)
            self._decode_us_ewma[decode_rows] = previous + EWMA_ALPHA * (elapsed_us - previous)
            return
        predicted = self._decode_us_ewma.get(decode_rows)
        if predicted is None:
            return
        observed_extra = max(elapsed_us - predicted, 1.0)
        allowed = min(max(predicted * MIXED_SLOWDOWN_FRACTION, MIXED_MIN_EXTRA_US), MIXED_MAX_EXTRA_US)
        if observed_extra > allowed:
            self._mixed_viable = False

    def complete_iteration(
        self, plan: TwinPlan, predictions: Iterable[IterationPrediction] | None = None
    ) -> IterationTelemetry:
        self._check_live(plan)
        if plan is not self._live_plans[0]:
            raise PlanInFlight(f"plan {plan.step} completed before plan "
                               f"{self._live_plans[0].step}: complete plans in the order they "
                               "were made")
        slots = read_predictions(plan, predictions)
        if self._fair is not None:
            self._charge(plan)
        counts = {IterationPhase.Prefill: 0, IterationPhase.Recompute: 0, IterationPhase.Decode: 0}
        terminal: list[tuple[str, FinishReason]] = []
        m = self._metrics
        for index, row in enumerate(plan._rows):
            counts[row.phase] += len(row.tokens)
            if not row.sample_last:
                continue
            u = plan._undo[index]
            s = u.seq
            fl = self._flights.get(s.id)
            if self._active.get(s.id) is not s or fl is None or fl.epoch != u.epoch:
                m.discarded_rows = sat(m.discarded_rows + 1)  # it ended or lost its KV since
                continue
            # Plans complete in order, so this row fills the oldest placeholder.
            at = len(s.generated_tokens) - fl.pending
            fl.pending -= 1
            token = slots.get(index)
            if token is None or token < 0:
                del s.generated_tokens[at:]  # the end signal and later placeholders go
                fl.pending = 0
                s.status = SequenceStatus.Failed if token is None else SequenceStatus.Finished
                terminal.append((s.id, FinishReason.FAILED if token is None else FinishReason.STOP))
            else:
                s.generated_tokens[at] = token
                if at + 1 >= s.max_tokens:
                    s.status = SequenceStatus.Finished
                    terminal.append((s.id, FinishReason.LENGTH))
        finished_ids: list[str] = []
        failed_ids: list[str] = []
        for sequence_id, reason in terminal:
            s = self._active.pop(sequence_id)
            self._fresh.discard(sequence_id)
            self._release(s)
            self._unpin(s)
            self._retired.append(s._snapshot())
            if reason is FinishReason.FAILED:
                m.failed = sat(m.failed + 1)
                failed_ids.append(sequence_id)
            else:
                m.finished = sat(m.finished + 1)
                finished_ids.append(sequence_id)
        m.iterations = sat(m.iterations + 1)
        m.admitted = sat(m.admitted + plan.admitted)
        m.prefill_tokens = sat(m.prefill_tokens + counts[IterationPhase.Prefill])
        m.recompute_tokens = sat(m.recompute_tokens + counts[IterationPhase.Recompute])
        m.decode_tokens = sat(m.decode_tokens + counts[IterationPhase.Decode])
        self._refresh_counts()
        self._live_plans.pop(0)
        return IterationTelemetry(
            iteration=m.iterations,
            active_sequences=m.active_sequences,
            waiting_sequences=m.waiting_sequences,
            admitted=plan.admitted,
            preempted=plan.preempted,
            prefill_tokens=counts[IterationPhase.Prefill],
            recompute_tokens=counts[IterationPhase.Recompute],
            decode_tokens=counts[IterationPhase.Decode],
            component_used_bytes=self._used_pairs(),
            component_available_bytes=[(c.name, c.available_bytes()) for c in self._components],
            prefix_hits=m.prefix_hits,
            prefix_misses=m.prefix_misses,
            finished=m.finished,
            failed=m.failed,
            cancelled=m.cancelled,
            rejected_overload=m.rejected_overload,
            finished_ids=finished_ids,
            failed_ids=failed_ids,
            stale_refreshes=m.stale_refreshes,
            finish_reasons=dict(terminal),
        )

    def _planned_for(self, plan: TwinPlan, index: int) -> bool:
        """Row `index`'s sequence is still the one it was planned for: not ended, cancelled or
        preempted since (completion drops the output of a row for which this is false)."""
        u = plan._undo[index]
        fl = self._flights.get(u.seq.id)
        return self._active.get(u.seq.id) is u.seq and fl is not None and fl.epoch == u.epoch

    def _charge(self, plan: TwinPlan) -> None:
        """Fair share: each row of the plan whose sequence is still the one it was planned for
        adds its tokens to the tenant's counter, in row order (behaviour.md §3.6)."""
        assert self._fair is not None
        counters = self._fair.counters
        for index, row in enumerate(plan._rows):
            if not self._planned_for(plan, index):
                continue
            tenant = self._flights[row.sequence_id].tenant
            if row.phase is IterationPhase.Decode:
                counters.charge(tenant, 0, len(row.tokens))
            else:
                counters.charge(tenant, len(row.tokens), 0)

    # -- fair share -----------------------------------------------------------------------------

    def set_tenant_weight(self, tenant: Hashable, weight: float) -> None:
        """Give `tenant` the fair-share weight `weight` (a finite number > 0) from now on."""
        if self._fair is None:
            raise ValueError("tenant weights apply to the native fair-share admission only")
        weight = VirtualTokenCounters._check_weight("weight", weight)
        self._tenants.setdefault(tenant, None)
        self._fair.counters.weights[tenant] = weight

    def tenant_counters(self) -> dict[Hashable, float]:
        """Fair share: each tenant seen (submitted or weighted) with its service counter; empty
        under any other admission policy."""
        if self._fair is None:
            return {}
        return {t: self._fair.counters.counter(t) for t in self._tenants}

    @property
    def fair_share_lifts(self) -> int:
        return self._fair.counters.lifts if self._fair is not None else 0

    # -- preemption, cancel, views --------------------------------------------------------------

    def _release(self, s: Sequence) -> None:
        self._used = [sat_sub(u, r) for u, r in zip(self._used, self._reservation(s))]

    def _over_budget(self, used: list[int]) -> bool:
        return any(u > c.available_bytes() for u, c in zip(used, self._components))

    def preempt_for_component_pressure(self, used_bytes: Iterable[int]) -> list[str]:
        if isinstance(used_bytes, (str, bytes)) or not hasattr(used_bytes, "__iter__"):
            raise TypeError("used_bytes must be a list of ints")
        measured = [check_uint(f"used_bytes[{i}]", v) for i, v in enumerate(used_bytes)]
        used = list(self._used)
        used[: len(measured)] = measured[: len(used)]
        # Choose every victim before touching state, so a failing policy changes nothing.
        remaining = list(self._active.values())
        victims: list[Sequence] = []
        while self._over_budget(used) and remaining:
            candidates = [
                VictimCandidate(
                    sequence_id=s.id,
                    priority=s.priority,
                    admitted_at=s.admitted_at or 0,
                    computed_tokens=s.prefill_cursor,
                    generated_tokens=len(self._confirmed(s)),
                )
                for s in remaining
            ]
            choice = self._preemption.select_victim(candidates)
            if choice is None:
                break
            if isinstance(choice, bool) or not isinstance(choice, int) or not 0 <= choice < len(remaining):
                raise ValueError(f"preemption policy returned {choice!r}, not a candidate position")
            victim = remaining.pop(choice)
            used = [sat_sub(u, r) for u, r in zip(used, self._reservation(victim))]
            victims.append(victim)
        self._used = used
        for s in victims:
            del self._active[s.id]
            self._fresh.discard(s.id)
            self._drop_placeholders(s)  # its in-flight rows are void: the KV they build is gone
            self._flights[s.id].epoch = next(self._epochs)
            self._unpin(s)
            self._reset_for_recompute(s)
            if self._store is not None:
                self._read_affinity(s)
            s.enqueue_order = self._next_order
            self._next_order = sat(self._next_order + 1)
            self._waiting.insert(0, s)
            self._dirty = True
            self._metrics.preempted = sat(self._metrics.preempted + 1)
        self._refresh_counts()
        return [s.id for s in victims]

    @staticmethod
    def _reset_for_recompute(s: Sequence) -> None:
        s.status = SequenceStatus.Preempted
        s.admitted_at = None
        replay_len = s.recompute_token_count()
        restored = s.prefix_restore.token_count if s.prefix_restore is not None else 0
        cursor = min(restored, replay_len)
        if not s.generated_tokens:
            # Without a pending token the last replay token must run to produce logits (§0.4b).
            cursor = min(cursor, sat_sub(replay_len, 1))
        s.prefill_cursor = cursor

    def cancel(self, sequence_id: str) -> bool:
        check_id("sequence_id", sequence_id)
        s = self._active.pop(sequence_id, None)
        if s is not None:
            self._fresh.discard(sequence_id)
            self._release(s)
            self._unpin(s)
        else:
            for i, w in enumerate(self._waiting):
                if w.id == sequence_id:
                    s = self._waiting.pop(i)
                    self._restore_entry.pop(s.id, None)
                    self._dirty = True
                    break
            else:
                return False
        self._drop_placeholders(s)
        self._retired.append(s._snapshot(SequenceStatus.Cancelled))
        self._metrics.cancelled = sat(self._metrics.cancelled + 1)
        self._refresh_counts()
        return True

    def _used_pairs(self) -> list[tuple[str, int]]:
        return [(c.name, u) for c, u in zip(self._components, self._used)]

    def snapshot(self) -> SchedulerSnapshot:
        return SchedulerSnapshot(
            active_ids=list(self._active),
            waiting_ids=[s.id for s in self._waiting],
            component_used_bytes=self._used_pairs(),
        )

    def sequence(self, sequence_id: str) -> Sequence | None:
        check_id("sequence_id", sequence_id)
        s = self._active.get(sequence_id)
        if s is None:
            s = next((w for w in self._waiting if w.id == sequence_id), None)
        if s is None:
            return None
        snap = s._snapshot()
        if self._flights[s.id].pending:  # in-flight samples are not tokens yet
            object.__setattr__(snap, "generated_tokens", tuple(self._confirmed(s)))
        return snap

    def metrics(self) -> SchedulerMetrics:
        return self._metrics.copy()

    def _refresh_counts(self) -> None:
        self._metrics.active_sequences = len(self._active)
        self._metrics.waiting_sequences = len(self._waiting)
