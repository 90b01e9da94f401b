"""Random operation scripts for schedulers: generation (hypothesis) and a traced runner.

A script is a list of plain tuples, so the same script can drive the twin and the native
scheduler and their traces can be compared entry by entry.
"""
import random

import numpy as np
from hypothesis import strategies as st

from skippy_scheduler import (
    AdmissionError,
    AdmissionPolicy,
    CacheAffinity,
    CacheAwareAdmission,
    FcfsAdmission,
    FewestComputedTokens,
    IterationPrediction,
    MemoryComponent,
    PreemptionPolicy,
    PrefixRestore,
    PriorityAdmission,
    SchedulerConfig,
    Sequence,
    SequenceStatus,
    StageCacheAffinity,
)
from sched_helpers import complete as complete_plan

IDS = [f"s{i}" for i in range(8)] + ["B", "aa", "zz", "", "a\x00b", "ñé"]

configs = st.builds(
    dict,
    max_active_sequences=st.integers(1, 5),
    max_waiting_sequences=st.integers(1, 8),
    max_tokens_per_iteration=st.integers(1, 24),
    prefill_chunk_tokens=st.integers(1, 16),
    max_prefill_sequences_per_iteration=st.one_of(st.none(), st.integers(1, 3)),
    max_consecutive_prefill_iterations=st.one_of(st.none(), st.integers(1, 3)),
    mixed_prefill_decode=st.booleans(),
    cache_aging_cost_per_iteration=st.sampled_from([0, 1, 10, 4096]),
    group_waiting_prefixes=st.booleans(),
    with_memory=st.booleans(),
    admission=st.sampled_from(["default", "default", "cache-aware-0", "fcfs", "priority", "user-lifo"]),
    preemption=st.sampled_from(["default", "default", "fewest-computed", "user-largest"]),
)

submit_ops = st.tuples(
    st.just("submit"),
    st.sampled_from(IDS),
    st.lists(st.integers(0, 3), min_size=1, max_size=12),  # small alphabet: shared prefixes
    st.integers(0, 6),  # max_tokens
    st.integers(0, 2),  # priority
    st.one_of(st.none(), st.integers(0, 14)),  # prefix restore token count
    st.one_of(st.none(), st.lists(st.integers(0, 9), min_size=1, max_size=3)),  # prefilled generation
    st.one_of(st.none(), st.integers(0, 30)),  # admission tokens
    st.sampled_from([0, 0, 5, 200]),  # saved cost per matched token
)
durations = st.sampled_from([None, 0.0005, 0.001, 0.01, 0.012, 0.03, 0.2, -1.0])
# A "step" is plan + observe + complete, the normal loop; lone plans and completes also occur
# (a plan that is never completed leaves its sampled sequences without work, docs/behaviour.md §0.4f).
steps = st.tuples(st.just("step"), st.integers(0, 2**32), st.booleans(), durations)
OP_STRATEGIES = {
    "submit": submit_ops,
    "step": steps,
    "plan": st.tuples(st.just("plan")),
    "complete": st.tuples(st.just("complete"), st.integers(0, 2**32), st.booleans()),
    "observe": st.tuples(st.just("observe"), durations.filter(lambda d: d is not None)),
    "preempt": st.tuples(st.just("preempt"), st.lists(st.integers(0, 200), min_size=0, max_size=3)),
    "cancel": st.tuples(st.just("cancel"), st.sampled_from(IDS)),
    "submit-empty": st.tuples(st.just("submit-empty"), st.sampled_from(IDS)),
    # Caller-set progress fields (cursor, generated tokens, status), as a resumed request has.
    "submit-raw": st.tuples(
        st.just("submit-raw"),
        st.sampled_from(IDS),
        st.lists(st.integers(0, 3), min_size=1, max_size=8),
        st.lists(st.integers(0, 9), max_size=3),
        st.integers(0, 14),
        st.integers(0, 4),
    ),
}
# Weights by repetition: mostly submits and full steps, so sequences get far.
OP_MIX = ["submit"] * 6 + ["step"] * 9 + ["preempt"] * 2 + ["plan", "complete", "observe", "cancel", "submit-empty", "submit-raw"]
ops = st.sampled_from(OP_MIX).flatmap(OP_STRATEGIES.__getitem__)
scripts = st.tuples(configs, st.lists(ops, min_size=10, max_size=80))


class NewestFirst(AdmissionPolicy):
    """A user admission policy (runs in Python): newest enqueue order first."""

    def order(self, candidates, current_turn):
        return [c.index for c in sorted(candidates, key=lambda c: -c.order)]


class MostComputed(PreemptionPolicy):
    """A user preemption policy: the sequence with the most computed tokens."""

    def select_victim(self, candidates):
        best = max(c.computed_tokens for c in candidates)
        return [c.computed_tokens for c in candidates].index(best)


ADMISSIONS = {
    "default": lambda: None,
    "cache-aware-0": lambda: CacheAwareAdmission(0, True),
    "fcfs": FcfsAdmission,
    "priority": PriorityAdmission,
    "user-lifo": NewestFirst,
}
PREEMPTIONS = {"default": lambda: None, "fewest-computed": FewestComputedTokens, "user-largest": MostComputed}


def build_scheduler(impl, spec):
    """The scheduler class `impl` with the config and policies a script spec names."""
    config = build_config(spec)
    kwargs = {}
    admission = ADMISSIONS[spec["admission"]]()
    preemption = PREEMPTIONS[spec["preemption"]]()
    if admission is not None:
        kwargs["admission"] = admission
    if preemption is not None:
        kwargs["preemption"] = preemption
    return impl(config, **kwargs)


def build_config(spec):
    spec = dict(spec)
    spec.pop("admission", None)
    spec.pop("preemption", None)
    with_memory = spec.pop("with_memory")
    if with_memory:
        spec["memory_components"] = [
            MemoryComponent("kv", 96, 8, 2, 0),
            MemoryComponent("recurrent", 64, 0, 0, 16),
        ]
    return SchedulerConfig(**spec)


def build_sequence(op):
    _, sid, prompt, max_tokens, priority, restore, generated, admission, saved = op
    s = Sequence(sid, prompt, max_tokens, None, priority)
    if generated is not None:
        s.with_prefilled_generation(generated)
    if restore is not None:
        s.with_prefix_restore(PrefixRestore("page", restore))
    if admission is not None:
        s.with_admission_tokens(admission)
    if saved:
        s.with_cache_affinity(CacheAffinity.from_stage(StageCacheAffinity(0, 1, saved, 0)))
    return s


def build_raw_sequence(op):
    _, sid, prompt, generated, cursor, status = op
    s = Sequence(sid, prompt, 4, None, 1)
    s.generated_tokens = list(generated)
    s.prefill_cursor = cursor
    s.status = SequenceStatus(status)
    return s


SUBMITTED = {
    "submit": build_sequence,
    "submit-empty": lambda op: Sequence(op[1], [], 1),
    "submit-raw": build_raw_sequence,
}


def describe_plan(plan):
    rows = [
        (w.sequence_id, tuple(w.tokens), tuple(w.positions), w.phase.value, bool(w.sample_last)) for w in plan.work
    ]
    arrays = tuple(
        np.asarray(getattr(plan, name)).astype(np.int64).tolist()
        for name in ("tokens", "positions", "row_offsets", "sample_last", "phases", "sample_rows")
    )
    return rows, plan.token_count, plan.admitted, plan.preempted, len(plan), arrays


def observe(scheduler, plan, seconds):
    try:
        scheduler.observe_iteration_duration(plan, seconds)
        return None
    except ValueError as exc:
        return type(exc).__name__


def complete(scheduler, plan, seed, use_outputs):
    """Complete with a prediction for ~90% of the sampling rows (tokens from the seed)."""
    rng = random.Random(seed)
    entries = []
    for index, w in enumerate(plan.work):
        if w.sample_last and rng.random() < 0.9:
            entries.append((index, rng.choice([-1, 3, 5, 7, 11, 13, 17, 19])))
    try:
        if use_outputs:
            for k, (index, token) in enumerate(entries):
                plan.outputs.request_indexes[k] = index
                plan.outputs.predicted_tokens[k] = token
            plan.outputs.count = len(entries)
            telemetry = scheduler.complete_iteration(plan)
        else:
            telemetry = complete_plan(scheduler, plan, [IterationPrediction(i, t) for i, t in entries])
        return vars(telemetry).copy()
    except ValueError as exc:
        return type(exc).__name__


SEQUENCE_FIELDS = (
    "id", "prompt_tokens", "generated_tokens", "max_tokens", "sampling", "priority", "admission_tokens",
    "status", "prefix_restore", "cache_affinity", "admitted_at", "prefill_cursor", "enqueued_turn",
    "enqueue_order",
)


def sequence_state(view):
    """Every field of a sequence view, lists as tuples."""
    values = (getattr(view, name) for name in SEQUENCE_FIELDS)
    return tuple(tuple(v) if isinstance(v, (list, tuple)) else v for v in values)


def run(scheduler, script_ops, check=None):
    """Apply a script; return the trace of every observable result.

    `check(scheduler, event)` is called after each operation for invariant checks.
    """
    trace = []
    plan = None
    for op in script_ops:
        kind = op[0]
        if kind in ("submit", "submit-empty", "submit-raw"):
            try:
                scheduler.submit(SUBMITTED[kind](op))
                result = None
            except AdmissionError as exc:
                result = repr(exc)
        elif kind == "plan":
            plan = scheduler.plan_iteration()
            result = describe_plan(plan)
        elif kind == "observe":
            if plan is None:
                continue
            result = observe(scheduler, plan, op[1])
        elif kind == "complete":
            if plan is None:
                continue
            result = complete(scheduler, plan, op[1], op[2])
        elif kind == "step":
            plan = scheduler.plan_iteration()
            observed = None if op[3] is None else observe(scheduler, plan, op[3])
            result = (describe_plan(plan), observed, complete(scheduler, plan, op[1], op[2]))
        elif kind == "preempt":
            result = list(scheduler.preempt_for_component_pressure(op[1]))
        elif kind == "cancel":
            result = scheduler.cancel(op[1])
        else:  # pragma: no cover
            raise AssertionError(op)
        snap = scheduler.snapshot()
        sequences = [sequence_state(scheduler.sequence(i)) for i in list(snap.active_ids) + list(snap.waiting_ids)]
        trace.append((op, result, list(snap.active_ids), list(snap.waiting_ids), list(snap.component_used_bytes),
                      vars(scheduler.metrics()).copy(), sequences))
        if check is not None:
            check(scheduler, op, result, plan)
    return trace
