"""Random operation scripts: engine invariants on every implementation, and twin == native."""
import itertools

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scripted import build_config, build_scheduler, run, scripts

from skippy_scheduler import (
    CacheAwareAdmission,
    FcfsAdmission,
    FewestComputedTokens,
    IterationPhase,
    LowestPriorityNewest,
    PriorityAdmission,
    TwinScheduler,
)
from skippy_scheduler import Scheduler as NativeScheduler

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


class InvariantChecker:
    """Tracks every submitted id and checks §0.5 and the plan-shape rules after each step."""

    def __init__(self, config):
        self.config = config.normalized()
        self.live = set()
        self.finished = self.failed = self.cancelled = 0
        self.overwritten = False
        self.reservations = {}

    def __call__(self, s, op, result, plan):
        kind = op[0]
        if kind.startswith("submit") and result is None:
            self.live.add(op[1])
        elif kind == "cancel" and result:
            self.live.discard(op[1])
            self.cancelled += 1
        elif kind == "complete":
            self.completed(result)
        elif kind == "step":
            self.check_plan(result[0])
            self.completed(result[2])
        elif kind == "preempt":
            self.overwritten = True
        elif kind == "plan":
            self.check_plan(result)
        snap = s.snapshot()
        active, waiting = list(snap.active_ids), list(snap.waiting_ids)
        assert len(set(active)) == len(active) and len(set(waiting)) == len(waiting)
        assert not set(active) & set(waiting)
        assert set(active) | set(waiting) == self.live
        assert len(active) <= self.config.max_active_sequences
        # (The waiting queue may exceed max_waiting_sequences: preempted work always goes back.)
        m = s.metrics()
        assert (m.finished, m.failed, m.cancelled) == (self.finished, self.failed, self.cancelled)
        assert (m.active_sequences, m.waiting_sequences) == (len(active), len(waiting))
        if not self.overwritten:
            expected = [0] * len(self.config.memory_components)
            for sid in active:
                seq = s.sequence(sid)
                for i, c in enumerate(self.config.memory_components):
                    expected[i] += c.reservation_bytes(seq.admission_tokens)
            assert [u for _, u in snap.component_used_bytes] == expected
        for sid in active:
            assert s.sequence(sid).admitted_at is not None

    def completed(self, telemetry):
        if not isinstance(telemetry, dict):
            return  # a rejected completion (stale plan)
        for sid in telemetry["finished_ids"] + telemetry["failed_ids"]:
            self.live.discard(sid)
        self.finished += len(telemetry["finished_ids"])
        self.failed += len(telemetry["failed_ids"])

    def check_plan(self, description):
        """Checks a plan as `describe_plan` recorded it (native plan views die with the plan)."""
        rows, token_count, _admitted, preempted, length, arrays = description
        tokens, positions, offsets, sample_last, phases, sample_rows = arrays
        decode = IterationPhase.DECODE.value
        assert length == len(rows) and preempted == 0
        assert offsets == [0] + list(itertools.accumulate(len(r[1]) for r in rows))
        assert tokens == [t for r in rows for t in r[1]]
        assert positions == [p for r in rows for p in r[2]]
        assert phases == [r[3] for r in rows]
        assert sample_last == [int(r[4]) for r in rows]
        assert sample_rows == [i for i, r in enumerate(rows) if r[4]]
        assert token_count == len(tokens) <= self.config.max_tokens_per_iteration
        assert len({r[0] for r in rows}) == len(rows)
        prefill_rows = 0
        for _sid, row_tokens, row_positions, phase, samples in rows:
            assert len(row_tokens) >= 1 and len(row_positions) == len(row_tokens)
            assert list(row_positions) == list(range(row_positions[0], row_positions[0] + len(row_positions)))
            if phase == decode:
                assert len(row_tokens) == 1 and samples
            else:
                prefill_rows += 1
                assert len(row_tokens) <= self.config.prefill_chunk_tokens
                if phase == IterationPhase.RECOMPUTE.value:
                    assert not samples
        limit = self.config.max_prefill_sequences_per_iteration
        assert limit is None or prefill_rows <= limit
        if not self.config.mixed_prefill_decode:
            assert len({r[3] == decode for r in rows}) <= 1


@SETTINGS
@given(script=scripts)
def test_invariants_hold_for_random_scripts_twin(script):
    spec, script_ops = script
    config = build_config(spec)
    run(build_scheduler(TwinScheduler, spec), script_ops, InvariantChecker(config))


@SETTINGS
@given(script=scripts)
def test_invariants_hold_for_random_scripts_native(script):
    spec, script_ops = script
    config = build_config(spec)
    run(build_scheduler(NativeScheduler, spec), script_ops, InvariantChecker(config))


@SETTINGS
@given(script=scripts)
def test_native_matches_twin_on_random_scripts(script):
    spec, script_ops = script
    twin_trace = run(build_scheduler(TwinScheduler, spec), script_ops)
    native_trace = run(build_scheduler(NativeScheduler, spec), script_ops)
    for step, (expected, got) in enumerate(zip(twin_trace, native_trace)):
        assert got == expected, f"step {step}: {expected[0]}"
    assert len(native_trace) == len(twin_trace)


# Python subclasses of the built-ins: same decisions, but called back from the scheduler
# (native_kind None), so they check the native kernels against their Python reference (§0.3).
class PyCacheAware(CacheAwareAdmission):
    native_kind = None


class PyFcfs(FcfsAdmission):
    native_kind = None


class PyPriority(PriorityAdmission):
    native_kind = None


class PyLowestPriorityNewest(LowestPriorityNewest):
    native_kind = None


class PyFewestComputed(FewestComputedTokens):
    native_kind = None


POLICY_PAIRS = {
    "default": ((None, None), (PyCacheAware, PyLowestPriorityNewest)),
    "fcfs": ((FcfsAdmission, FewestComputedTokens), (PyFcfs, PyFewestComputed)),
    "priority": ((PriorityAdmission, None), (PyPriority, None)),
}
IMPLEMENTATIONS = [TwinScheduler, NativeScheduler]


def with_policies(impl, config, admission, preemption):
    kwargs = {}
    if admission is not None:
        kwargs["admission"] = admission
    if preemption is not None:
        kwargs["preemption"] = preemption
    return impl(config, **kwargs)


@SETTINGS
@given(script=scripts, pair=st.sampled_from(sorted(POLICY_PAIRS)))
def test_python_policies_give_the_same_plans_as_the_builtins(script, pair):
    spec, script_ops = script
    config = build_config(spec)
    normalized = config.normalized()
    builtin, python = POLICY_PAIRS[pair]
    for impl in IMPLEMENTATIONS:
        def make(classes):
            admission_cls, preemption_cls = classes
            if admission_cls is PyCacheAware:
                # Concrete settings: a callback policy is used as given.
                admission = PyCacheAware(normalized.cache_aging_cost_per_iteration, normalized.group_waiting_prefixes)
            else:
                admission = None if admission_cls is None else admission_cls()
            preemption = None if preemption_cls is None else preemption_cls()
            return with_policies(impl, config, admission, preemption)

        expected = run(make(builtin), script_ops)
        got = run(make(python), script_ops)
        for step, (a, b) in enumerate(zip(expected, got)):
            assert b == a, f"{impl.__name__} step {step}: {a[0]}"
