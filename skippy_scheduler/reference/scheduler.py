"""Reference scheduler engine (behaviour.md §2 with the §0 decisions).

Owns `TwinScheduler`: admission, chunked and mixed planning, completion, preemption and
cancel, written for clarity rather than speed. The native `Scheduler` must produce the same
plans, telemetry and state for every input. Every method validates its arguments before it
changes anything.
"""
from __future__ import annotations

import itertools
import numbers
from typing import Hashable, Iterable, Optional

from .._validate import check_id, check_uint, sat, sat_sub
from .admission import AdmissionOrder
from .hold import LEAD_HELD_ON, ColdPrefixHold
from .memory import MemoryLedger
from .plan import PLACEHOLDER, Flight, RowUndo, TwinPlan, read_outputs, stale_message
from .planning import RowPlanner
from .prefix_store import PrefixStoreTwin
from .priority import preempt_for_priority
from .store_link import StoreLink
from ..prefix_store import PrefixStore
from ..slack import PlanningRule, StepCost, check_clock, check_step_cost
from ..policies import (
    AdmissionPolicy,
    CacheAwareAdmission,
    LowestPriorityNewest,
    PreemptionPolicy,
    VictimCandidate,
)
from ..types import (
    DuplicateSequence,
    EmptyPrompt,
    FinishReason,
    IterationPhase,
    IterationTelemetry,
    PlanInFlight,
    QueueFull,
    SchedulerConfig,
    SchedulerMetrics,
    SchedulerSnapshot,
    Sequence,
    SequenceStatus,
    StalePlanError,
)

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
        self._admission = AdmissionOrder(admission.resolved(self._config))
        self._preemption = preemption
        self._in_policy = False  # a policy callback is running (`_changing`)
        self._memory = MemoryLedger(self._config.memory_components)
        self._waiting: list[Sequence] = []
        self._active: dict[str, Sequence] = {}  # insertion order = admission (walk) order
        self._fresh: set[str] = set()  # active ids with no row planned since admission
        self._retired: list[Sequence] = []  # left since the last plan, as snapshots
        self._metrics = SchedulerMetrics()
        self._waiting_turn = 0
        self._next_order = 0
        self._dirty = False
        self._admission_counter = 0
        self._priority_victims: list[str] = []  # ids the last admission preempted for priority
        self._live_plans: list[TwinPlan] = []  # oldest first
        self._steps = 0
        self._flights: dict[str, Flight] = {}
        self._epochs = itertools.count(1)
        self._link = StoreLink()  # the attached prefix store (§2.12)
        # Disjoint plans in flight (§2.11a): only with plans in flight to be disjoint from.
        self._disjoint = (self._config.disjoint_inflight_plans
                          and self._config.max_inflight_plans > 1)
        self._hold = ColdPrefixHold(self._config, lambda s: self._flights[s.id])
        self._planner = RowPlanner(self._config, self._live_decode, self._take_new,
                                   self._link.holder, self._slack_stamp_us,
                                   self._in_flight if self._disjoint else None,
                                   submitted_us=lambda s: self._flights[s.id].submitted_us,
                                   on_relegate=self._relegated,
                                   leading=lambda s: self._flights[s.id].lead == LEAD_HELD_ON)

    # -- the slack rule's inputs (§2.13) ----------------------------------------------------------

    def _slack_stamp_us(self, s: Sequence) -> float:
        """Where a live decode's slack counts from: its last token, but now while its first
        token is still in flight (its stamp is then its admission, and no gap has begun)."""
        fl = self._flights[s.id]
        now = self._planner.slack.now_us
        if len(s.generated_tokens) == fl.pending and fl.last_token_us < now:
            return now
        return fl.last_token_us

    def _relegated(self, s: Sequence) -> None:
        """The prefill order put it behind for its first-token deadline (§2.13): counted once
        per submit (C: sk_seq.slo_relegated)."""
        fl = self._flights[s.id]
        if not fl.slo_relegated:
            fl.slo_relegated = True
            self._metrics.slo_relegated = sat(self._metrics.slo_relegated + 1)

    def set_clock(self, now: float) -> None:
        """The time now (seconds, any monotonic origin): read by the next plan, and stamped on
        the sequences the next completion gives a token. Set it before both."""
        self._changing()
        self._planner.slack.now_us = check_clock(now) * 1e6

    def set_step_cost(self, cost: StepCost) -> None:
        """The slack rule's cost model from now on (the engine refits it online)."""
        self._changing()
        self._planner.slack.cost = check_step_cost("cost", cost)

    @property
    def step_cost(self) -> StepCost:
        return self._planner.slack.cost

    # -- prefix store (§2.12) -------------------------------------------------------------------

    def attach_prefix_store(self, store: object, *, prefill_cost_per_token: int = 1,
                            restore_cost_per_token: int = 0) -> None:
        self._changing()
        prefill = check_uint("prefill_cost_per_token", prefill_cost_per_token)
        restore = check_uint("restore_cost_per_token", restore_cost_per_token)
        # The type before the state, as native (which refuses anything but its PrefixStore).
        if store is not None and not isinstance(store, (PrefixStore, PrefixStoreTwin)):
            raise TypeError("store must be a PrefixStore or PrefixStoreTwin, got "
                            f"{type(store).__name__}")
        if self._waiting or self._active or self._live_plans:
            raise ValueError("a prefix store can only be attached or detached while the "
                             "scheduler holds no sequence and no live plan")
        self._link.attach(self, store, prefill, restore)

    @property
    def prefix_store(self) -> Optional[object]:
        return self._link.store

    @property
    def mixed_prefill_viable(self) -> bool:
        """Whether observed durations still allow mixing prefill into decode plans (§2.6)."""
        return self._planner.mixed_viable

    @property
    def config(self) -> SchedulerConfig:
        return self._config.replace()

    @property
    def admission(self) -> AdmissionPolicy:
        """The admission policy in use."""
        return self._admission.policy

    @property
    def preemption(self) -> PreemptionPolicy:
        """The preemption policy in use."""
        return self._preemption

    admission_policy = admission  # (the twin's earlier names)
    preemption_policy = preemption

    # -- submit / admission ---------------------------------------------------------------------

    def submit(self, seq: Sequence) -> None:
        self._changing()
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
        if self._link.store is not None:
            if s.prefix_restore is not None or s.cache_affinity.stages or s.prefill_cursor:
                raise ValueError("a prefix store is attached: it decides prefix restores and "
                                 "saved costs, so the descriptor must carry none")
            self._link.read(s)
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
        self._flights[s.id] = Flight(next(self._epochs), self._admission.tenant_of(s),
                                     self._planner.slack.now_us)
        self._dirty = True
        self._refresh_counts()

    def _live_decode(self, s: Sequence) -> bool:
        """Has a pending token to feed, and its in-flight samples leave room under max_tokens."""
        if not s.generated_tokens or s.prefill_cursor < s.recompute_token_count():
            return False
        fl = self._flights[s.id]
        return not (fl.pending and len(s.generated_tokens) >= s.max_tokens)

    def _in_flight(self, s: Sequence) -> bool:
        """§2.11a: a row of this incarnation is in a plan that is still live (void or not)."""
        planned = self._flights[s.id].planned
        return planned is not None and any(p.step == planned for p in self._live_plans)

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

    def __repr__(self) -> str:
        return (f"TwinScheduler(active={len(self._active)}, waiting={len(self._waiting)}, "
                f"live_plans={self.live_plans}, admission={type(self.admission).__name__}, "
                f"preemption={type(self.preemption).__name__})")

    def _changing(self) -> None:
        """Refuse a call that changes the scheduler from inside its own policy callback (it is
        between two states there: such a call would lose or duplicate sequences)."""
        if self._in_policy:
            raise RuntimeError("the scheduler cannot be changed from inside its admission or "
                               "preemption policy (the policy only orders or picks)")

    def _ranked_waiting(self, turn: int) -> list[Sequence]:
        flights = [self._flights[s.id] for s in self._waiting]
        self._in_policy = True
        try:
            return self._admission.rank(self._waiting, turn, [f.tenant for f in flights],
                                        [f.request for f in flights])
        finally:
            self._in_policy = False

    def _admit_waiting(self) -> int:
        """Admit front to back; a request that does not fit is skipped, not waited on (§2.3);
        then, when enabled, preemption for priority (§2.8a)."""
        admitted = 0
        deferred: list[Sequence] = []
        hold = self._hold if self._hold.tokens and self._link.store is not None else None
        self._hold.walks += 1
        for s in self._waiting:
            if len(self._active) >= self._config.max_active_sequences:
                deferred.append(s)
                continue
            reservation = self._memory.reservation(s)
            if not self._memory.fits(reservation) or (
                    hold is not None and hold.holds(s, self._active.values())):
                deferred.append(s)
                continue
            self._admit_one(s)
            admitted += 1
        self._waiting = deferred
        self._priority_victims = []
        if self._config.priority_preemption:
            admitted += preempt_for_priority(self, self._steps)
        self._refresh_counts()
        return admitted

    def _admit_one(self, s: Sequence) -> None:
        """`s` (taken out of the queue by the caller) joins the active set."""
        self._memory.reserve(self._memory.reservation(s))
        if self._link.store is not None:
            m = self._metrics
            if s.prefix_restore is not None:
                m.prefix_hits = sat(m.prefix_hits + 1)
                m.restored_tokens = sat(m.restored_tokens + s.prefix_restore.token_count)
            else:
                m.prefix_misses = sat(m.prefix_misses + 1)
            self._link.pin(s)
        s.status = SequenceStatus.RUNNING
        self._admission_counter = sat(self._admission_counter + 1)
        s.admitted_at = self._admission_counter
        self._active[s.id] = s
        self._fresh.add(s.id)
        fl = self._flights[s.id]
        fl.last_token_us = self._planner.slack.now_us
        fl.lead = 0
        fl.admit_gen = len(s.generated_tokens) - fl.pending
        # held, its restore no better for it, its leader still active: it leads nobody (§2.3a)
        restored = s.prefix_restore.token_count if s.prefix_restore is not None else 0
        fl.no_lead = False
        if fl.held_steps > 0 and fl.held_on is not None:
            leader_id, leader_admitted = fl.held_on
            leader = self._active.get(leader_id)
            fl.no_lead = (leader is not None and leader.admitted_at == leader_admitted
                          and restored <= fl.held_restore)

    # -- planning -------------------------------------------------------------------------------

    def retired(self) -> list[Sequence]:
        """Sequences that left since the last plan (finished, failed, cancelled), as snapshots
        with their generated tokens; the next `plan_iteration` forgets them."""
        return list(self._retired)

    def plan_iteration(self) -> TwinPlan:
        self._changing()
        depth = self._config.max_inflight_plans
        if depth > 1 and len(self._live_plans) >= depth:
            raise PlanInFlight(f"{depth} plans are in flight (max_inflight_plans); complete "
                               "or abort the oldest first")
        self._retired = []
        turn = sat(self._waiting_turn + 1)
        stale = self._link.refresh(self._waiting)
        if stale:
            self._metrics.stale_refreshes = sat(self._metrics.stale_refreshes + stale)
            self._dirty = True
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
        counters = self._planner.counters
        work = self._planner.rows(list(self._active.values()), bool(self._priority_victims))
        step = self._steps
        self._steps += 1
        undo: list[RowUndo] = []
        deferred: list[tuple[int, int, int]] = []
        for r, (w, (s, before)) in enumerate(zip(work, self._planner.cursors_before)):
            fl = self._flights[s.id]
            previous = fl.source
            if self._disjoint:
                fl.planned = step
            if w.phase is IterationPhase.DECODE and fl.pending:
                assert previous is not None
                deferred.append((r, previous[0], previous[1]))  # its input is still in flight
            if w.sample_last:
                s.generated_tokens.append(PLACEHOLDER)
                fl.pending += 1
                fl.source = (step, r)
            undo.append(RowUndo(s, fl.epoch, before, w.sample_last, previous, w.new_row))
        plan = TwinPlan(work, sum(len(w.tokens) for w in work), admitted, step, deferred,
                        ids_kept=depth > 1)
        plan.preempted = len(self._priority_victims)
        plan.priority_victims = tuple(self._priority_victims)
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

    # -- plan feedback --------------------------------------------------------------------------

    def _check_live(self, plan: object) -> TwinPlan:
        """The checks of the native `_own_live`, in its order: a plan, of this scheduler, live."""
        if not isinstance(plan, TwinPlan):
            raise TypeError(f"plan must be a plan made by this scheduler, got {type(plan).__name__}")
        # A plan keeps the live list of the scheduler that made it (never replaced, only edited).
        if plan._live_list is not self._live_plans:
            raise ValueError("the plan belongs to another scheduler")
        if not any(p is plan for p in self._live_plans):
            raise StalePlanError(stale_message(plan))
        return plan

    @property
    def live_plans(self) -> int:
        """Plans made and not yet completed or aborted."""
        return len(self._live_plans)

    def abort_iteration(self, plan: TwinPlan) -> None:
        """Undo `plan` and every later live plan: the runtime could not run them (§2.11)."""
        self._changing()
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
        self._planner.restore(aborted[0]._counters)
        del self._live_plans[first:]
        self._metrics.aborted_plans = sat(self._metrics.aborted_plans + len(aborted))

    def observe_iteration_duration(self, plan: TwinPlan, elapsed_seconds: float) -> None:
        self._changing()
        self._check_live(plan)
        if isinstance(elapsed_seconds, bool) or not isinstance(elapsed_seconds, numbers.Real):
            raise TypeError(f"elapsed_seconds must be a number, got {type(elapsed_seconds).__name__}")
        try:
            seconds = float(elapsed_seconds)
        except OverflowError:  # an int past float's range: infinite, ignored like inf (native)
            seconds = float("inf")
        self._planner.observe(plan._rows, seconds * 1e6)

    def complete_iteration(self, plan: TwinPlan) -> IterationTelemetry:
        self._changing()
        self._check_live(plan)
        if plan is not self._live_plans[0]:
            raise PlanInFlight(f"plan {plan.step} completed before plan "
                               f"{self._live_plans[0].step}: complete plans in the order they "
                               "were made")
        slots = read_outputs(plan)
        if self._admission.fair:
            self._charge(plan)
        counts = {IterationPhase.PREFILL: 0, IterationPhase.RECOMPUTE: 0, IterationPhase.DECODE: 0}
        terminal: list[tuple[str, FinishReason]] = []
        m = self._metrics
        stamp = self._config.planning_rule is PlanningRule.SLACK
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
                s.status = SequenceStatus.FAILED if token is None else SequenceStatus.FINISHED
                terminal.append((s.id, FinishReason.FAILED if token is None else FinishReason.STOP))
            else:
                s.generated_tokens[at] = token
                if stamp:
                    fl.last_token_us = self._planner.slack.now_us
                if at + 1 >= s.max_tokens:
                    s.status = SequenceStatus.FINISHED
                    terminal.append((s.id, FinishReason.LENGTH))
        finished_ids: list[str] = []
        failed_ids: list[str] = []
        for sequence_id, reason in terminal:
            s = self._active.pop(sequence_id)
            self._fresh.discard(sequence_id)
            self._memory.release(s)
            self._link.unpin(s)
            self._retired.append(s._snapshot())
            if reason is FinishReason.FAILED:
                m.failed = sat(m.failed + 1)
                failed_ids.append(sequence_id)
            else:
                m.finished = sat(m.finished + 1)
                finished_ids.append(sequence_id)
        m.iterations = sat(m.iterations + 1)
        m.admitted = sat(m.admitted + plan.admitted)
        m.prefill_tokens = sat(m.prefill_tokens + counts[IterationPhase.PREFILL])
        m.recompute_tokens = sat(m.recompute_tokens + counts[IterationPhase.RECOMPUTE])
        m.decode_tokens = sat(m.decode_tokens + counts[IterationPhase.DECODE])
        self._refresh_counts()
        self._live_plans.pop(0)
        return IterationTelemetry(
            iteration=m.iterations,
            active_sequences=m.active_sequences,
            waiting_sequences=m.waiting_sequences,
            admitted=plan.admitted,
            preempted=plan.preempted,
            prefill_tokens=counts[IterationPhase.PREFILL],
            recompute_tokens=counts[IterationPhase.RECOMPUTE],
            decode_tokens=counts[IterationPhase.DECODE],
            component_used_bytes=self._memory.pairs(),
            component_available_bytes=self._memory.available_pairs(),
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
            prompt_keeps=tuple(self._hold.take(self._active.values())),
        )

    def _planned_for(self, plan: TwinPlan, index: int) -> bool:
        """Row `index`'s sequence is still the one it was planned for: not ended, cancelled or
        preempted since (completion drops the output of a row for which this is false)."""
        u = plan._undo[index]
        fl = self._flights.get(u.seq.id)
        return self._active.get(u.seq.id) is u.seq and fl is not None and fl.epoch == u.epoch

    def _charge(self, plan: TwinPlan) -> None:
        """Fair share: each row of the plan whose sequence is still the one it was planned for
        is charged to its tenant, in row order (behaviour.md §3.6)."""
        for index, row in enumerate(plan._rows):
            if self._planned_for(plan, index):
                self._admission.charge(row, self._flights[row.sequence_id].tenant)

    def set_tenant_weight(self, tenant: Hashable, weight: float) -> None:
        """Give `tenant` the fair-share weight `weight` (a finite number > 0) from now on."""
        self._changing()
        self._admission.set_tenant_weight(tenant, weight)

    def tenant_counters(self) -> dict[Hashable, float]:
        """Fair share: each tenant seen (submitted or weighted) with its service counter; empty
        under any other admission policy."""
        return self._admission.tenant_counters()

    @property
    def fair_share_lifts(self) -> int:
        return self._admission.lifts

    # -- preemption, cancel, views --------------------------------------------------------------

    def preempt_for_component_pressure(self, used_bytes: Iterable[int]) -> list[str]:
        self._changing()
        if isinstance(used_bytes, (str, bytes)) or not hasattr(used_bytes, "__iter__"):
            raise TypeError("used_bytes must be a list of ints")
        measured = [check_uint(f"used_bytes[{i}]", v) for i, v in enumerate(used_bytes)]
        used = list(self._memory.used)
        used[: len(measured)] = measured[: len(used)]
        # Choose every victim before touching state, so a failing policy changes nothing.
        remaining = list(self._active.values())
        victims: list[Sequence] = []
        while self._memory.over_budget(used) and remaining:
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
            self._in_policy = True
            try:
                choice = self._preemption.select_victim(candidates)
            finally:
                self._in_policy = False
            if choice is None:
                break
            if isinstance(choice, bool) or not isinstance(choice, int) or not 0 <= choice < len(remaining):
                raise ValueError(f"preemption policy returned {choice!r}, not a candidate position")
            victim = remaining.pop(choice)
            used = self._memory.without(used, victim)
            victims.append(victim)
        self._memory.used = used
        for s in victims:
            self._requeue_victim(s)
            self._waiting.insert(0, s)
        self._refresh_counts()
        return [s.id for s in victims]

    def _requeue_victim(self, s: Sequence) -> None:
        """`s` leaves the active set as a preempted sequence; the caller queues it."""
        del self._active[s.id]
        self._fresh.discard(s.id)
        self._drop_placeholders(s)  # its in-flight rows are void: the KV they build is gone
        self._flights[s.id].epoch = next(self._epochs)
        self._flights[s.id].held_steps = 0
        self._link.unpin(s)
        self._reset_for_recompute(s)
        if self._link.store is not None:
            self._link.read(s)
        s.enqueue_order = self._next_order
        self._next_order = sat(self._next_order + 1)
        self._dirty = True
        self._metrics.preempted = sat(self._metrics.preempted + 1)

    @staticmethod
    def _reset_for_recompute(s: Sequence) -> None:
        s.status = SequenceStatus.PREEMPTED
        s.admitted_at = None
        replay_len = s.recompute_token_count()
        restored = s.prefix_restore.token_count if s.prefix_restore is not None else 0
        cursor = min(restored, replay_len)
        if not s.generated_tokens:
            # Without a pending token the last replay token must run to produce logits (§0.4b).
            cursor = min(cursor, sat_sub(replay_len, 1))
        s.prefill_cursor = cursor

    def cancel(self, sequence_id: str) -> bool:
        self._changing()
        check_id("sequence_id", sequence_id)
        s = self._active.pop(sequence_id, None)
        if s is not None:
            self._fresh.discard(sequence_id)
            self._memory.release(s)
            self._link.unpin(s)
        else:
            for i, w in enumerate(self._waiting):
                if w.id == sequence_id:
                    s = self._waiting.pop(i)
                    self._link.forget(s.id)
                    self._dirty = True
                    break
            else:
                return False
        self._drop_placeholders(s)
        self._retired.append(s._snapshot(SequenceStatus.CANCELLED))
        self._metrics.cancelled = sat(self._metrics.cancelled + 1)
        self._refresh_counts()
        return True

    def snapshot(self) -> SchedulerSnapshot:
        return SchedulerSnapshot(
            active_ids=list(self._active),
            waiting_ids=[s.id for s in self._waiting],
            component_used_bytes=self._memory.pairs(),
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
