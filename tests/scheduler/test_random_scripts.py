"""Random operation scripts: engine invariants on every implementation, and twin == native."""
import pytest
from hypothesis import HealthCheck, given, settings
from scripted import build_config, run, scripts

from skippy_scheduler import IterationPhase, TwinScheduler

try:
    from skippy_scheduler import Scheduler as NativeScheduler
except ImportError:
    NativeScheduler = None

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
        if kind == "submit" and result is None:
            self.live.add(op[1])
        elif kind == "cancel" and result:
            self.live.discard(op[1])
            self.cancelled += 1
        elif kind == "complete":
            self.completed(result)
        elif kind == "step":
            self.check_plan(plan)
            self.completed(result[2])
        elif kind == "preempt":
            self.overwritten = True
        elif kind == "plan":
            self.check_plan(plan)
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

    def check_plan(self, plan):
        rows = list(plan.work)
        assert plan.token_count == sum(len(w.tokens) for w in rows)
        assert plan.token_count <= self.config.max_tokens_per_iteration
        assert len({w.sequence_id for w in rows}) == len(rows)
        prefill_rows = 0
        for w in rows:
            assert len(w.tokens) >= 1 and len(w.positions) == len(w.tokens)
            assert list(w.positions) == list(range(w.positions[0], w.positions[0] + len(w.positions)))
            if w.phase is IterationPhase.Decode:
                assert len(w.tokens) == 1 and w.sample_last
            else:
                prefill_rows += 1
                assert len(w.tokens) <= self.config.prefill_chunk_tokens
                if w.phase is IterationPhase.Recompute:
                    assert not w.sample_last
        limit = self.config.max_prefill_sequences_per_iteration
        assert limit is None or prefill_rows <= limit
        if not self.config.mixed_prefill_decode:
            phases = {w.phase is IterationPhase.Decode for w in rows}
            assert len(phases) <= 1


@SETTINGS
@given(script=scripts)
def test_invariants_hold_for_random_scripts_twin(script):
    spec, script_ops = script
    config = build_config(spec)
    run(TwinScheduler(config), script_ops, InvariantChecker(config))


@pytest.mark.skipif(NativeScheduler is None, reason="the native scheduler is not built")
@SETTINGS
@given(script=scripts)
def test_invariants_hold_for_random_scripts_native(script):
    spec, script_ops = script
    config = build_config(spec)
    run(NativeScheduler(config), script_ops, InvariantChecker(config))


@pytest.mark.skipif(NativeScheduler is None, reason="the native scheduler is not built")
@SETTINGS
@given(script=scripts)
def test_native_matches_twin_on_random_scripts(script):
    spec, script_ops = script
    config = build_config(spec)
    twin_trace = run(TwinScheduler(config), script_ops)
    native_trace = run(NativeScheduler(config), script_ops)
    for step, (expected, got) in enumerate(zip(twin_trace, native_trace)):
        assert got == expected, f"step {step}: {expected[0]}"
    assert len(native_trace) == len(twin_trace)
