"""Differential test: the native scheduler and the pure-Python twin, driven by the same random
operation sequences, must agree on every plan, telemetry record, exception type, snapshot,
sequence view and metrics value after every step (behaviour.md §0, §1, §2).

The CI budget is set below; `pytest --hypothesis-profile=long` runs the long profile from
tests/conftest.py instead.
"""
import math

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from skippy_scheduler import (
    AdmissionError,
    CacheAffinity,
    CacheAwareAdmission,
    FcfsAdmission,
    FewestComputedTokens,
    IterationPrediction,
    LowestPriorityNewest,
    MemoryComponent,
    PrefixRestore,
    PriorityAdmission,
    Scheduler,
    SchedulerConfig,
    Sequence,
    StageCacheAffinity,
    TwinScheduler,
)
from skippy_scheduler.sampling import SamplingParams
from sched_helpers import complete as complete_plan

GREEDY = SamplingParams(temperature=0.0, seed=0)

CI_EXAMPLES = 300


def _settings():
    profile = settings.get_current_profile_name()
    if profile != "default":
        return settings(settings.get_profile(profile), suppress_health_check=list(HealthCheck))
    return settings(max_examples=CI_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))


class PythonFcfs(FcfsAdmission):
    """Same order as the built-in FCFS, but run as a Python policy (callback path)."""


class PythonFewest(FewestComputedTokens):
    """Same victim as the built-in, but run as a Python policy (callback path)."""


ADMISSIONS = [
    lambda: None,
    lambda: CacheAwareAdmission(0, False),
    lambda: CacheAwareAdmission(3, True),
    FcfsAdmission,
    PriorityAdmission,
    PythonFcfs,
]
PREEMPTIONS = [lambda: None, LowestPriorityNewest, FewestComputedTokens, PythonFewest]
IDS = ["a", "b", "c", "d", "e", "f", "g"]
UNKNOWN_ID = "nobody"
DURATIONS = [0.001, 0.002, 0.003, 0.004, 0.010, 0.030, 0.0, -1.0, math.nan, math.inf]

components = st.lists(
    st.builds(
        MemoryComponent,
        name=st.sampled_from(["kv", "rec", "kv"]),
        capacity_bytes=st.integers(0, 400) | st.integers(400, 3000),
        resident_bytes=st.integers(0, 60),
        bytes_per_token=st.integers(0, 12),
        bytes_per_sequence=st.integers(0, 60),
    ),
    max_size=2,
)

configs = st.builds(
    SchedulerConfig,
    max_active_sequences=st.integers(0, 5),
    max_waiting_sequences=st.integers(0, 6),
    max_tokens_per_iteration=st.integers(0, 12),
    prefill_chunk_tokens=st.integers(0, 8),
    max_prefill_sequences_per_iteration=st.none() | st.integers(0, 3),
    max_consecutive_prefill_iterations=st.none() | st.integers(0, 3),
    mixed_prefill_decode=st.booleans(),
    cache_aging_cost_per_iteration=st.integers(0, 5000),
    group_waiting_prefixes=st.booleans(),
    memory_components=components,
    priority_preemption=st.booleans(),
    priority_preemption_guard_steps=st.integers(0, 4),
    max_priority_preemptions_per_step=st.integers(0, 3),
)

submit_op = st.tuples(
    st.just("submit"),
    st.integers(0, len(IDS) - 1),
    # small alphabet for shared prefixes; now and then an empty prompt
    st.lists(st.integers(0, 4), min_size=1, max_size=8) | st.lists(st.integers(0, 4), max_size=2),
    st.integers(0, 5),  # max_tokens
    st.integers(0, 3),  # priority
    st.none() | st.integers(0, 20),  # admission tokens
    st.none() | st.integers(0, 10),  # prefix restore token count
    st.none() | st.tuples(st.integers(0, 8), st.integers(0, 50), st.integers(0, 100)),  # affinity
    st.none() | st.lists(st.integers(0, 9), min_size=1, max_size=3),  # prefilled generation
    st.sampled_from([None, GREEDY]),  # sampling (carried only)
    # TTFT deadline (seconds): ties and none now and then, so §3.3a's key decides often
    st.none() | st.sampled_from([0.5, 1.0, 1.0, 2.0, 1e-3, 1e9]),
)
complete_op = st.tuples(
    st.just("complete"),
    st.booleans(),  # through the outputs block instead of IterationPrediction values
    st.lists(st.integers(0, 9), min_size=1, max_size=6),  # per sampling row: token / eos / missing / dup
    st.sampled_from(["none", "none", "none", "out-of-range", "non-sampling", "duplicate"]),
    st.integers(0, 5),  # rotation of the prediction order
)
# plan, observe, complete: the step that moves sequences forward (and calibrates mixed mode)
cycle_op = st.tuples(st.just("cycle"), st.sampled_from(DURATIONS[:6]), complete_op)
ops = st.lists(
    st.one_of(
        submit_op,
        submit_op,
        cycle_op,
        cycle_op,
        cycle_op,
        st.just(("plan",)),
        st.just(("plan",)),
        complete_op,
        complete_op,
        st.tuples(st.just("observe"), st.sampled_from(DURATIONS)),
        st.tuples(st.just("stale"), st.booleans()),
        st.tuples(st.just("preempt"), st.lists(st.integers(0, 10), max_size=3), st.booleans()),
        st.tuples(st.just("cancel"), st.integers(0, len(IDS))),
    ),
    min_size=4,
    max_size=50,
)


def build_sequence(op):
    _, idx, prompt, max_tokens, priority, admission, restore, affinity, generated, sampling, \
        deadline = op
    s = Sequence(IDS[idx], prompt, max_tokens, sampling, priority)
    if deadline is not None:
        s.with_deadlines(ttft_deadline=deadline)
    if admission is not None:
        s.with_admission_tokens(admission)
    if generated is not None:
        s.with_prefilled_generation(generated)
    if restore is not None:
        s.with_prefix_restore(PrefixRestore("page", restore))
    if affinity is not None:
        matched, cost, restore_cost = affinity
        s.with_cache_affinity(
            CacheAffinity.from_stage(
                StageCacheAffinity(0, matched, cost, restore_cost, 1)
            )
        )
    return s


def predictions_for(plan_work, choices, malform, rotate):
    """(work_index, token) pairs chosen from `choices`, interpreted against the plan's rows."""
    pairs = []
    sampling = [i for i, w in enumerate(plan_work) if w.sample_last]
    for k, row in enumerate(sampling):
        c = choices[k % len(choices)]
        if c <= 5:
            pairs.append((row, 11 * c + k))
        elif c == 6:
            pairs.append((row, -1 if k % 2 else -(1 << 31)))
        elif c == 7:
            continue  # missing: the sequence fails (§2.7)
        else:
            pairs.append((row, (1 << 31) - 1 - k))
    if malform == "out-of-range":
        pairs.append((len(plan_work) + choices[0], 1))
    elif malform == "non-sampling":
        quiet = [i for i, w in enumerate(plan_work) if not w.sample_last]
        if quiet:
            pairs.append((quiet[choices[0] % len(quiet)], 1))
    elif malform == "duplicate" and pairs:
        pairs.append(pairs[choices[0] % len(pairs)])
    if pairs:
        r = rotate % len(pairs)
        pairs = pairs[r:] + pairs[:r]
    return pairs


def outcome(fn):
    try:
        return ("ok", fn())
    except Exception as exc:  # noqa: BLE001 - the exception type is what is compared
        return ("raised", type(exc), exc if isinstance(exc, AdmissionError) else None)


class Pair:
    """One native and one twin scheduler plus their current and previous plans."""

    def __init__(self, config, admission, preemption):
        self.native = Scheduler(config, admission(), preemption())
        self.twin = TwinScheduler(config, admission(), preemption())
        self.plans = (None, None)  # the most recent plans (possibly dead)
        self.old = (None, None)  # the plans before those (always dead once a newer exists)

    def both(self, fn):
        a = outcome(lambda: fn(self.native, 0))
        b = outcome(lambda: fn(self.twin, 1))
        assert a[0] == b[0], (a, b)
        if a[0] == "raised":
            assert a[1:] == b[1:], (a, b)
            event(f"raised {a[1].__name__}")
        return a, b

    def check_state(self):
        n, t = self.native, self.twin
        assert n.snapshot() == t.snapshot()
        assert n.metrics() == t.metrics()
        for sequence_id in IDS:
            assert n.sequence(sequence_id) == t.sequence(sequence_id), sequence_id
        assert n.mixed_prefill_viable == t.mixed_prefill_viable


def run_op(pair, op):
    kind = op[0]
    if kind == "submit":
        seq = build_sequence(op)
        pair.both(lambda s, _: s.submit(seq))
    elif kind == "plan":
        a, b = pair.both(lambda s, _: s.plan_iteration())
        if a[0] == "ok":
            pn, pt = a[1], b[1]
            assert pn.work == pt.work
            assert (pn.token_count, pn.admitted, pn.preempted, len(pn)) == (
                pt.token_count, pt.admitted, pt.preempted, len(pt))
            assert pn.priority_victims == pt.priority_victims
            assert len(pt.priority_victims) == pt.preempted
            if pn.preempted:
                event("preempted for priority")
            assert pn.tokens.tolist() == pt.tokens.tolist()
            assert pn.positions.tolist() == pt.positions.tolist()
            assert pn.sample_last.astype(bool).tolist() == pt.sample_last.tolist()
            assert pn.new_rows.tolist() == pt.new_rows.tolist()
            assert pn.restored_tokens.tolist() == pt.restored_tokens.tolist()
            if pt.new_rows.any():
                event("plan with a new row")
            pair.old, pair.plans = pair.plans, (pn, pt)
            kinds = {w.phase.name for w in pt.work}
            event("plan " + "+".join(sorted(kinds)) if kinds else "empty plan")
    elif kind == "complete":
        if pair.plans[0] is None:
            return
        _, via_outputs, choices, malform, rotate = op
        pairs = predictions_for(pair.plans[1].work, choices, malform, rotate)
        if via_outputs:
            def complete(s, i):
                plan = pair.plans[i]
                live = plan.live
                if not live:  # the native block refuses access to a dead plan's memory
                    return s.complete_iteration(plan)
                usable = pairs[: len(plan)]
                for k, (index, token) in enumerate(usable):
                    plan.outputs.request_indexes[k] = index
                    plan.outputs.predicted_tokens[k] = token
                plan.outputs.count = len(usable)
                return s.complete_iteration(plan)
        else:
            def complete(s, i):
                return complete_plan(s, pair.plans[i], [IterationPrediction(x, y) for x, y in pairs])
        a, b = pair.both(complete)
        if a[0] == "ok":
            assert a[1] == b[1]
            assert set(a[1].finish_reasons) == set(a[1].finished_ids) | set(a[1].failed_ids)
            if a[1].finished_ids or a[1].failed_ids:
                event("completion retired sequences")
    elif kind == "cycle":
        run_op(pair, ("plan",))
        run_op(pair, ("observe", op[1]))
        run_op(pair, op[2])
    elif kind == "observe":
        if pair.plans[0] is not None:
            pair.both(lambda s, i: s.observe_iteration_duration(pair.plans[i], op[1]))
    elif kind == "stale":
        if pair.old[0] is not None:
            if op[1]:
                pair.both(lambda s, i: complete_plan(s, pair.old[i], []))
            else:
                pair.both(lambda s, i: s.observe_iteration_duration(pair.old[i], 0.002))
    elif kind == "preempt":
        _, levels, huge = op
        avail = [c.available_bytes() for c in pair.twin.config.memory_components] or [100]
        used = [avail[k % len(avail)] * v // 4 for k, v in enumerate(levels)]
        if huge and used:
            used[0] = (1 << 64) - 1
        a, b = pair.both(lambda s, _: s.preempt_for_component_pressure(used))
        if a[0] == "ok":
            assert a[1] == b[1]
            if a[1]:
                event("preempted")
    elif kind == "cancel":
        sequence_id = IDS[op[1]] if op[1] < len(IDS) else UNKNOWN_ID
        a, b = pair.both(lambda s, _: s.cancel(sequence_id))
        assert a == b
    pair.check_state()


@_settings()
@given(
    config=configs,
    admission=st.sampled_from(ADMISSIONS),
    preemption=st.sampled_from(PREEMPTIONS),
    first=st.lists(submit_op, min_size=1, max_size=5),
    operations=ops,
)
def test_native_and_twin_agree(config, admission, preemption, first, operations):
    pair = Pair(config, admission, preemption)
    pair.check_state()
    for op in first + operations:
        run_op(pair, op)


@_settings()
@given(first=st.lists(submit_op, min_size=1, max_size=5), operations=ops, mixed=st.booleans() | st.just(True),
       by_priority=st.booleans())
def test_native_and_twin_agree_on_a_busy_default_config(first, operations, mixed, by_priority):
    """Defaults except small limits, so queues fill and budgets bind often."""
    config = SchedulerConfig(
        max_active_sequences=3,
        max_waiting_sequences=4,
        max_tokens_per_iteration=6,
        prefill_chunk_tokens=3,
        mixed_prefill_decode=mixed,
        memory_components=[MemoryComponent("kv", 120, 0, 4, 8), MemoryComponent("rec", 64, 0, 0, 16)],
        priority_preemption=by_priority,
        priority_preemption_guard_steps=2,
    )
    pair = Pair(config, lambda: None, lambda: None)
    for op in first + operations:
        run_op(pair, op)


# Mixed planning needs a decode-only baseline for the exact live-row count before it engages
# (§2.2, §2.6), so these runs mostly step plan/observe/complete with well-formed samples and
# short durations, with arrivals in between, and a rare slow iteration that may latch it off.
steady_complete = st.tuples(
    st.just("complete"), st.booleans(), st.lists(st.integers(0, 5) | st.just(6), min_size=1, max_size=4),
    st.just("none"), st.integers(0, 3),
)
steady_cycle = st.tuples(st.just("cycle"), st.sampled_from([0.001, 0.002, 0.002, 0.003, 0.03]), steady_complete)
mixed_ops = st.lists(st.one_of(steady_cycle, steady_cycle, steady_cycle, submit_op,
                               st.tuples(st.just("cancel"), st.integers(0, len(IDS)))), min_size=10, max_size=60)


@_settings()
@given(
    first=st.lists(submit_op, min_size=2, max_size=5),
    operations=mixed_ops,
    max_active=st.integers(2, 5),
    max_tokens=st.integers(2, 12),
    chunk=st.integers(1, 6),
    max_prefill=st.none() | st.integers(1, 2),
)
def test_native_and_twin_agree_in_mixed_mode(first, operations, max_active, max_tokens, chunk, max_prefill):
    config = SchedulerConfig(
        max_active_sequences=max_active, max_tokens_per_iteration=max_tokens, prefill_chunk_tokens=chunk,
        max_prefill_sequences_per_iteration=max_prefill, mixed_prefill_decode=True,
    )
    pair = Pair(config, lambda: None, lambda: None)
    for op in first + operations:
        run_op(pair, op)
