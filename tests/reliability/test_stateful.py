"""Stateful property test of the native scheduler's public API (behaviour.md §0.5, §0.7, §2).

A hypothesis state machine applies random valid and invalid operations and, after every step,
checks the invariants against a small model kept here (not a second scheduler):

* every submitted id is in exactly one of waiting, active, finished, failed, cancelled;
* component used bytes follow §2.8's bookkeeping (admissions add, releases subtract, a
  pressure call overwrites with the measured value) and equal the sum of the active
  reservations until a measured value was given; after an admission no component is over
  its budget;
* every plan row: one row per sequence, at least one token, the sequence's own tokens at those
  positions, contiguous from its cursor (decode rows at R(S)), budgets and caps respected,
  phases and sample flags as §2.4/§2.5 say;
* completion retires exactly the sequences §2.7 says, preemption picks §2.8's victims;
* metrics equal the counts derived from the operations;
* invalid operations raise their specific exception and leave snapshot, sequences and metrics
  unchanged.

CI runs 2 000 examples; `pytest --hypothesis-profile=long` runs the long profile.
"""
import math
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from skippy_scheduler import (
    CacheAffinity,
    DuplicateSequence,
    EmptyPrompt,
    FewestComputedTokens,
    IterationPhase,
    IterationPrediction,
    LowestPriorityNewest,
    MalformedOutputs,
    MemoryComponent,
    PrefixRestore,
    QueueFull,
    Scheduler,
    SchedulerConfig,
    Sequence,
    SequenceStatus,
    StageCacheAffinity,
    StalePlanError,
)
from sched_helpers import complete

U64_MAX = (1 << 64) - 1
IDS = ["s0", "s1", "s2", "s3", "s4", "s5", "s6"]
CI_EXAMPLES = 2000
CI_STEPS = 20


def _settings():
    profile = settings.get_current_profile_name()
    if profile != "default":
        return settings(settings.get_profile(profile))
    return settings(
        max_examples=CI_EXAMPLES, stateful_step_count=CI_STEPS, deadline=None,
        suppress_health_check=list(HealthCheck),
    )


def sat_add(a, b):
    return min(a + b, U64_MAX)


@dataclass
class Model:
    """What the test knows about one live sequence."""

    history: list  # prompt + generated tokens
    prompt_len: int
    max_tokens: int
    reservation: list


def with_cursor(snapshot, cursor):
    """A copy of a sequence snapshot with another prefill cursor."""
    values = {name: getattr(snapshot, name) for name in Sequence.__slots__}
    values["prefill_cursor"] = cursor
    return Sequence._frozen_snapshot(**values)


@dataclass
class Counters:
    iterations: int = 0
    admitted: int = 0
    preempted: int = 0
    finished: int = 0
    failed: int = 0
    cancelled: int = 0
    rejected_overload: int = 0
    discarded_rows: int = 0
    aborted_plans: int = 0
    prefill_tokens: int = 0
    recompute_tokens: int = 0
    decode_tokens: int = 0
    prefix_hits: int = 0
    prefix_misses: int = 0
    terminal: dict = field(default_factory=dict)  # id -> last terminal state


SUBMIT_ARGS = dict(
    idx=st.integers(0, len(IDS) - 1),
    prompt=st.lists(st.integers(0, 5), min_size=1, max_size=9) | st.just([]),
    max_tokens=st.integers(0, 4),
    priority=st.integers(0, 3),
    admission=st.none() | st.integers(0, 30),
    restore=st.none() | st.integers(0, 12),
    generated=st.none() | st.lists(st.integers(0, 9), min_size=1, max_size=3),
    affinity=st.none() | st.tuples(st.integers(0, 8), st.integers(0, 40), st.integers(0, 100)),
)

component_strategy = st.builds(
    MemoryComponent,
    name=st.sampled_from(["kv", "recurrent", "vision"]),
    capacity_bytes=st.integers(0, 3000),
    resident_bytes=st.integers(0, 100),
    bytes_per_token=st.integers(0, 16),
    bytes_per_sequence=st.integers(0, 200),
)


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        max_active=st.integers(1, 4),
        max_waiting=st.integers(1, 5),
        max_tokens=st.integers(1, 10),
        chunk=st.integers(1, 6),
        max_prefill=st.none() | st.integers(1, 2),
        max_consecutive=st.none() | st.integers(1, 2),
        mixed=st.booleans(),
        comps=st.lists(component_strategy, max_size=3),
        fewest=st.booleans(),
        first=st.lists(st.fixed_dictionaries(SUBMIT_ARGS), min_size=1, max_size=4),
    )
    def setup(self, max_active, max_waiting, max_tokens, chunk, max_prefill, max_consecutive, mixed, comps,
              fewest, first):
        self.config = SchedulerConfig(
            max_active_sequences=max_active, max_waiting_sequences=max_waiting,
            max_tokens_per_iteration=max_tokens, prefill_chunk_tokens=chunk,
            max_prefill_sequences_per_iteration=max_prefill,
            max_consecutive_prefill_iterations=max_consecutive, mixed_prefill_decode=mixed,
            memory_components=comps,
        ).normalized()
        self.fewest = fewest
        self.s = Scheduler(self.config, preemption=FewestComputedTokens() if fewest else LowestPriorityNewest())
        self.comps = comps
        self.avail = [c.available_bytes() for c in comps]
        self.used = [0] * len(comps)
        self.measured = False  # a pressure call replaced the bookkeeping with measured values
        self.live = {}  # id -> Model
        self.c = Counters()
        self.plan = None
        self.dead_plans = []
        self.touched = set()  # preempted or cancelled since the live plan was made
        for args in first:  # start with some sequences so most runs reach planning quickly
            self.submit(**args)

    # -- helpers ----------------------------------------------------------------------------

    def state(self):
        snap = self.s.snapshot()
        return snap, self.s.metrics(), {i: self.s.sequence(i) for i in IDS}

    def expect_unchanged(self, fn, error):
        before = self.state()
        with pytest.raises(error):
            fn()
        assert self.state() == before

    def release(self, sequence_id, reason=None):
        m = self.live.pop(sequence_id)
        self.used = [max(0, u - r) for u, r in zip(self.used, m.reservation)]

    # -- valid operations ------------------------------------------------------------------

    @rule(**SUBMIT_ARGS)
    def submit(self, idx, prompt, max_tokens, priority, admission, restore, generated, affinity):
        sequence_id = IDS[idx]
        seq = Sequence(sequence_id, prompt, max_tokens, None, priority)
        if admission is not None:
            seq.with_admission_tokens(admission)
        if generated is not None:
            seq.with_prefilled_generation(generated)
        if restore is not None:
            seq.with_prefix_restore(PrefixRestore("p", restore))
        if affinity is not None:
            seq.with_cache_affinity(CacheAffinity.from_stage(StageCacheAffinity(0, *affinity)))
        if not prompt:
            self.expect_unchanged(lambda: self.s.submit(seq), EmptyPrompt)
            return
        if sequence_id in self.live:
            self.expect_unchanged(lambda: self.s.submit(seq), DuplicateSequence)
            return
        if len(self.s.snapshot().waiting_ids) >= self.config.max_waiting_sequences:
            before = self.state()
            with pytest.raises(QueueFull) as info:
                self.s.submit(seq)
            assert info.value.capacity == self.config.max_waiting_sequences
            self.c.rejected_overload += 1
            after = self.state()
            assert (after[0], after[2]) == (before[0], before[2])
            return
        self.s.submit(seq)
        seq.prompt_tokens.append(99)  # the scheduler keeps its own copy
        self.c.terminal.pop(sequence_id, None)
        res = [c.reservation_bytes(seq.admission_tokens) for c in self.comps]
        self.live[sequence_id] = Model(list(prompt) + list(generated or []), len(prompt), max_tokens, res)
        if restore is not None:
            self.c.prefix_hits += 1
        else:
            self.c.prefix_misses += 1

    @rule(**SUBMIT_ARGS)
    def submit_another(self, **args):
        self.submit(**args)  # a second rule for submit doubles its share of the steps

    @rule(choices=st.lists(st.integers(0, 6), min_size=1, max_size=4), via_outputs=st.booleans(),
          elapsed=st.sampled_from([0.001, 0.002, 0.004, 0.03]))
    def cycle(self, choices, via_outputs, elapsed):
        """Plan, observe and complete: the step that moves sequences forward."""
        self.plan_iteration()
        self.observe(elapsed)
        self.complete(choices, via_outputs)

    @rule()
    def plan_iteration(self):
        before = {i: self.s.sequence(i) for i in self.live}
        active_before = set(self.s.snapshot().active_ids)
        if self.plan is not None:
            # §0.4f: the new plan first aborts the live one, whose rows are undone: every
            # sequence it planned (and that was not preempted or cancelled since) gets back the
            # cursor it had before, the first position of its row.
            for w in self.plan.work:
                if w.sequence_id in before and w.sequence_id not in self.touched:
                    before[w.sequence_id] = with_cursor(before[w.sequence_id], w.positions[0])
            self.c.aborted_plans += 1
            self.dead_plans.append(self.plan)
        self.touched = set()
        plan = self.s.plan_iteration()
        self.plan = plan
        snap = self.s.snapshot()
        newly = [i for i in snap.active_ids if i not in active_before]
        assert len(newly) == plan.admitted
        for i in newly:
            self.used = [sat_add(u, r) for u, r in zip(self.used, self.live[i].reservation)]
        if plan.admitted:
            assert all(u <= a for (_, u), a in zip(snap.component_used_bytes, self.avail))
        self.check_plan(plan, before, set(snap.active_ids))
        kinds = sorted({w.phase.name for w in plan.work})
        event("plan " + "+".join(kinds) if kinds else "empty plan")

    def check_plan(self, plan, before, active):
        cfg = self.config
        work = plan.work
        ids = [w.sequence_id for w in work]
        assert len(ids) == len(set(ids)), "one row per sequence"
        total = 0
        prefill_rows = 0
        for w in work:
            assert w.sequence_id in active
            assert len(w.tokens) >= 1 and len(w.tokens) == len(w.positions)
            total += len(w.tokens)
            b = before[w.sequence_id]
            m = self.live[w.sequence_id]
            gen = len(b.generated_tokens)
            replay = b.recompute_token_count()
            after = self.s.sequence(w.sequence_id)
            if w.phase is IterationPhase.DECODE:
                assert gen > 0 and b.prefill_cursor >= replay
                assert list(w.positions) == [replay] and w.sample_last
                assert w.tokens[0] == m.history[replay] == b.generated_tokens[-1]
                assert after.prefill_cursor == replay + 1
            else:
                start = b.prefill_cursor
                end = start + len(w.tokens)
                assert list(w.positions) == list(range(start, end))
                assert end <= replay and len(w.tokens) <= cfg.prefill_chunk_tokens
                assert list(w.tokens) == m.history[start:end]
                assert (w.phase is IterationPhase.PREFILL) == (gen == 0)
                assert w.sample_last == (end == replay and gen == 0)
                assert after.prefill_cursor == end
                prefill_rows += 1
        assert total == plan.token_count <= cfg.max_tokens_per_iteration
        if cfg.max_prefill_sequences_per_iteration is not None:
            assert prefill_rows <= cfg.max_prefill_sequences_per_iteration
        if not cfg.mixed_prefill_decode:
            assert prefill_rows in (0, len(work)), "phase-homogeneous plan"
        # Sequences without a row keep their cursor.
        for i in active - set(ids):
            assert self.s.sequence(i).prefill_cursor == before[i].prefill_cursor

    def predictions(self, choices):
        pairs = []
        for k, r in enumerate(i for i, w in enumerate(self.plan.work) if w.sample_last):
            c = choices[k % len(choices)]
            if c == 0:
                continue  # missing: fails the sequence
            pairs.append((r, -1 if c == 1 else c * 3))
        return pairs

    @precondition(lambda self: self.plan is not None and self.plan.live)
    @rule(choices=st.lists(st.integers(0, 6), min_size=1, max_size=4), via_outputs=st.booleans())
    def complete(self, choices, via_outputs):
        plan = self.plan
        pairs = self.predictions(choices)
        active = set(self.s.snapshot().active_ids)
        tokens = dict(pairs)
        finished, failed = [], []
        for r, w in enumerate(plan.work):
            if w.sample_last and w.sequence_id not in active:
                self.c.discarded_rows += 1  # its sequence was preempted or cancelled meanwhile
            if not w.sample_last or w.sequence_id not in active:
                continue
            m = self.live[w.sequence_id]
            if r not in tokens:
                failed.append(w.sequence_id)
            elif tokens[r] < 0:
                finished.append(w.sequence_id)
            else:
                m.history.append(tokens[r])
                if len(m.history) - m.prompt_len >= m.max_tokens:
                    finished.append(w.sequence_id)
        phase_tokens = {p: sum(len(w.tokens) for w in plan.work if w.phase is p) for p in IterationPhase}
        if via_outputs:
            for k, (r, t) in enumerate(pairs):
                plan.outputs.request_indexes[k] = r
                plan.outputs.predicted_tokens[k] = t
            plan.outputs.count = len(pairs)
            telemetry = self.s.complete_iteration(plan)
        else:
            telemetry = complete(self.s, plan, [IterationPrediction(r, t) for r, t in pairs])
        assert telemetry.finished_ids == finished and telemetry.failed_ids == failed
        if finished or failed:
            event("retired by completion")
        for i in finished:
            self.release(i)
            self.c.terminal[i] = "finished"
        for i in failed:
            self.release(i)
            self.c.terminal[i] = "failed"
        c = self.c
        c.iterations += 1
        c.admitted += plan.admitted
        c.finished += len(finished)
        c.failed += len(failed)
        c.prefill_tokens += phase_tokens[IterationPhase.PREFILL]
        c.recompute_tokens += phase_tokens[IterationPhase.RECOMPUTE]
        c.decode_tokens += phase_tokens[IterationPhase.DECODE]
        assert telemetry.iteration == c.iterations
        assert (telemetry.prefill_tokens, telemetry.recompute_tokens, telemetry.decode_tokens) == (
            phase_tokens[IterationPhase.PREFILL], phase_tokens[IterationPhase.RECOMPUTE],
            phase_tokens[IterationPhase.DECODE])
        assert telemetry.component_used_bytes == self.s.snapshot().component_used_bytes
        self.dead_plans.append(plan)
        self.plan = None

    @precondition(lambda self: self.plan is not None and self.plan.live)
    @rule(elapsed=st.sampled_from([0.001, 0.002, 0.004, 0.03, 0.0, -1.0, math.nan, math.inf]))
    def observe(self, elapsed):
        self.s.observe_iteration_duration(self.plan, elapsed)

    @rule(levels=st.lists(st.integers(0, 12), max_size=4))
    def preempt(self, levels):
        # Measured usage: the current bookkeeping plus up to 1.5 × the budget (often over it).
        measured = [
            (self.used[k] if k < len(self.used) else 0) + (self.avail[k % len(self.avail)] if self.avail else 64) * v // 8
            for k, v in enumerate(levels)
        ]
        snap = self.s.snapshot()
        info = {i: self.s.sequence(i) for i in snap.active_ids}
        victims = self.s.preempt_for_component_pressure(measured)
        self.touched.update(victims)
        n = min(len(measured), len(self.used))
        self.used[:n] = measured[:n]
        if n:
            self.measured = True
        # §2.8: victims in order, chosen from the remaining active set until everything fits.
        remaining = list(snap.active_ids)
        for v in victims:
            assert any(u > a for u, a in zip(self.used, self.avail)), "preempted while within budget"
            if self.fewest:
                key = lambda i: (info[i].prefill_cursor, info[i].priority, -info[i].admitted_at)  # noqa: E731
            else:
                key = lambda i: (info[i].priority, -info[i].admitted_at)  # noqa: E731
            assert v == min(remaining, key=key)
            remaining.remove(v)
            self.used = [max(0, u - r) for u, r in zip(self.used, self.live[v].reservation)]
            seq = self.s.sequence(v)
            assert seq.status is SequenceStatus.PREEMPTED and seq.admitted_at is None
        assert not remaining or all(u <= a for u, a in zip(self.used, self.avail))
        self.c.preempted += len(victims)
        if victims:
            event("preempted")
        assert self.s.snapshot().waiting_ids[: len(victims)] == list(reversed(victims))

    @rule(idx=st.integers(0, len(IDS)))
    def cancel(self, idx):
        sequence_id = IDS[idx] if idx < len(IDS) else "unknown"
        if sequence_id not in self.live:
            before = self.state()
            assert self.s.cancel(sequence_id) is False
            assert self.state() == before
            return
        was_active = sequence_id in self.s.snapshot().active_ids
        assert self.s.cancel(sequence_id) is True
        self.touched.add(sequence_id)
        m = self.live.pop(sequence_id)
        if was_active:
            self.used = [max(0, u - r) for u, r in zip(self.used, m.reservation)]
        self.c.cancelled += 1
        self.c.terminal[sequence_id] = "cancelled"

    # -- invalid operations ----------------------------------------------------------------

    @rule(bad=st.sampled_from(["bool-token", "negative-token", "big-token", "str-token", "not-a-sequence",
                               "int-id", "float-priority", "negative-max-tokens", "status-int"]))
    def submit_bad(self, bad):
        seq = Sequence("bad", [1, 2, 3], 2)
        error = TypeError
        if bad == "bool-token":
            seq.prompt_tokens.append(True)
        elif bad == "negative-token":
            seq.prompt_tokens.append(-1)
            error = ValueError
        elif bad == "big-token":
            seq.generated_tokens = [1 << 31]
            error = ValueError
        elif bad == "str-token":
            seq.prompt_tokens.append("7")
        elif bad == "not-a-sequence":
            seq = ("bad", [1, 2, 3], 2)
        elif bad == "int-id":
            seq.id = 5
        elif bad == "float-priority":
            seq.priority = 1.0
        elif bad == "negative-max-tokens":
            seq.max_tokens = -1
            error = ValueError
        elif bad == "status-int":
            seq.status = 1
        self.expect_unchanged(lambda: self.s.submit(seq), error)

    @precondition(lambda self: self.plan is not None and self.plan.live)
    @rule(kind=st.sampled_from(["out-of-range", "duplicate", "non-sampling", "wrong-type", "count-above-rows"]),
          via_outputs=st.booleans())
    def complete_malformed(self, kind, via_outputs):
        plan = self.plan
        work = plan.work
        sampling = [i for i, w in enumerate(work) if w.sample_last]
        quiet = [i for i, w in enumerate(work) if not w.sample_last]
        if kind == "out-of-range":
            pairs = [(len(work) + 3, 1)]
        elif kind == "duplicate":
            if not sampling:
                return
            pairs = [(sampling[0], 1), (sampling[0], 2)]
        elif kind == "non-sampling":
            if not quiet:
                return
            pairs = [(quiet[0], 1)]
        elif kind == "count-above-rows":
            if not via_outputs:
                return
            before = self.state()
            with pytest.raises(ValueError):
                plan.outputs.count = len(work) + 1
                self.s.complete_iteration(plan)
            assert self.state() == before and plan.live
            return
        else:
            # (no predictions argument: the host writes the outputs block)
            self.expect_unchanged(lambda: self.s.complete_iteration(plan, [(0, 1)]), TypeError)
            return
        if len(pairs) > len(work):
            return  # (more entries than the block holds: the count itself is refused)
        if via_outputs:
            for k, (r, t) in enumerate(pairs):
                plan.outputs.request_indexes[k] = r
                plan.outputs.predicted_tokens[k] = t
            plan.outputs.count = len(pairs)
            self.expect_unchanged(lambda: self.s.complete_iteration(plan), MalformedOutputs)
        else:
            preds = [IterationPrediction(r, t) for r, t in pairs]
            self.expect_unchanged(lambda: complete(self.s, plan, preds), MalformedOutputs)
        assert plan.live  # a malformed completion leaves the plan live (§0.7)

    @precondition(lambda self: bool(self.dead_plans))
    @rule(complete=st.booleans())
    def stale_plan(self, complete):
        old = self.dead_plans[-1]
        if complete:
            self.expect_unchanged(lambda: self.s.complete_iteration(old), StalePlanError)
        else:
            self.expect_unchanged(lambda: self.s.observe_iteration_duration(old, 0.01), StalePlanError)

    @rule(bad=st.sampled_from([[-1], [1 << 64], [1.5], [True], "12", None]))
    def preempt_bad(self, bad):
        error = ValueError if bad in ([-1], [1 << 64]) else TypeError
        self.expect_unchanged(lambda: self.s.preempt_for_component_pressure(bad), error)

    @rule(bad=st.sampled_from([None, 3, b"s0", ["s0"]]))
    def cancel_bad(self, bad):
        self.expect_unchanged(lambda: self.s.cancel(bad), TypeError)

    @precondition(lambda self: self.plan is not None and self.plan.live)
    @rule(bad=st.sampled_from(["0.01", None, True]))
    def observe_bad(self, bad):
        self.expect_unchanged(lambda: self.s.observe_iteration_duration(self.plan, bad), TypeError)

    # -- invariants ------------------------------------------------------------------------

    @invariant()
    def partition(self):
        snap = self.s.snapshot()
        active, waiting = snap.active_ids, snap.waiting_ids
        assert len(active) == len(set(active)) and len(waiting) == len(set(waiting))
        assert not set(active) & set(waiting)
        assert set(active) | set(waiting) == set(self.live)
        assert not set(self.live) & set(self.c.terminal)
        assert len(active) <= self.config.max_active_sequences
        # Only submits are held to the waiting limit; preempted work may go beyond it (§2.8).
        assert len(waiting) <= self.config.max_waiting_sequences + self.config.max_active_sequences

    @invariant()
    def memory(self):
        used = [v for _, v in self.s.snapshot().component_used_bytes]
        assert used == self.used
        if not self.measured:
            active = self.s.snapshot().active_ids
            expected = [0] * len(self.used)
            for i in active:
                expected = [sat_add(e, r) for e, r in zip(expected, self.live[i].reservation)]
            assert used == expected
            assert all(u <= a for u, a in zip(used, self.avail))

    @invariant()
    def metrics(self):
        m = self.s.metrics()
        c = self.c
        snap = self.s.snapshot()
        assert (m.iterations, m.admitted, m.preempted, m.finished, m.failed, m.cancelled, m.rejected_overload) == (
            c.iterations, c.admitted, c.preempted, c.finished, c.failed, c.cancelled, c.rejected_overload)
        assert (m.prefill_tokens, m.recompute_tokens, m.decode_tokens) == (
            c.prefill_tokens, c.recompute_tokens, c.decode_tokens)
        assert (m.prefix_hits, m.prefix_misses) == (c.prefix_hits, c.prefix_misses)
        assert (m.discarded_rows, m.aborted_plans) == (c.discarded_rows, c.aborted_plans)
        assert (m.active_sequences, m.waiting_sequences) == (len(snap.active_ids), len(snap.waiting_ids))

    @invariant()
    def sequences(self):
        for i in IDS:
            view = self.s.sequence(i)
            if i not in self.live:
                assert view is None
                continue
            m = self.live[i]
            assert list(view.prompt_tokens) + list(view.generated_tokens) == m.history
            assert view.prefill_cursor <= view.recompute_token_count() + 1


SchedulerMachine.TestCase.settings = _settings()
test_scheduler_state_machine = SchedulerMachine.TestCase
