"""Plans in flight (docs/behaviour.md §2.11): depth D, deferred inputs, abort, discarded rows.

Three kinds of evidence:
* random scripts run on the native core and the twin at D = 1, 2, 3 and compare every plan
  (rows, tokens, positions, deferred tables), exception, snapshot and metrics after each step;
* the equivalence property: with a deterministic model (next token = a function of the
  sequence's history, a negative one ending it), every sequence gets the same tokens at
  D = 2 and 3 as at D = 1 and as alone, under cancellation, preemption and aborts;
* direct cases: an abort at depth 1 replans the same rows, ordering errors change nothing.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from token_model import VOCAB, alone_tokens, run_rows

from skippy_scheduler import (MemoryComponent, PlanInFlight, Scheduler, SchedulerConfig,
                              Sequence, StalePlanError, TwinScheduler, resolve_deferred)

class Runtime:
    """Runs plans in order like a batched runtime: fills deferred inputs from earlier outputs,
    then runs the rows on its per-sequence histories (token_model.run_rows)."""

    def __init__(self) -> None:
        self.kv: dict[str, list[int]] = {}

    def execute(self, plan, earlier) -> None:
        resolve_deferred(plan, earlier)
        run_rows(self.kv, plan)

    def drop(self, sid: str) -> None:
        self.kv.pop(sid, None)


def _config(depth: int, **kw) -> SchedulerConfig:
    base = dict(max_active_sequences=3, max_tokens_per_iteration=12, prefill_chunk_tokens=4,
                max_inflight_plans=depth)
    base.update(kw)
    return SchedulerConfig(**base)


OPS = st.lists(st.tuples(st.sampled_from(["submit", "plan", "plan", "plan", "complete",
                                          "complete", "abort", "cancel", "preempt"]),
                         st.integers(0, 1000)), min_size=1, max_size=60)


class Driver:
    """One scheduler, its runtime model and the plans in flight, oldest first."""

    def __init__(self, impl, config: SchedulerConfig) -> None:
        self.s = impl(config)
        self.rt = Runtime()
        self.plans: list = []
        self.tokens: dict[str, list[int]] = {}
        self.ended: dict[str, str] = {}
        self.all_plans: dict[int, object] = {}

    def submit(self, sid, prompt, max_tokens) -> None:
        self.s.submit(Sequence(sid, prompt, max_tokens))
        self.tokens[sid] = []

    def plan(self):
        p = self.s.plan_iteration()
        if self.s.config.max_inflight_plans == 1:
            self.plans = []  # replaced: aborted by the scheduler
        self.rt.execute(p, self.plans)
        self.plans.append(p)
        return p

    def complete(self):
        p = self.plans[0]
        sampled = dict(zip(p.outputs.request_indexes[:p.outputs.count].tolist(),
                           p.outputs.predicted_tokens[:p.outputs.count].tolist()))
        ids = p.sequence_ids
        t = self.s.complete_iteration(p)
        self.plans.pop(0)
        done = set(t.finished_ids) | set(t.failed_ids)
        for q in self.s.retired():
            if q.id in done:
                self.tokens[q.id] = list(q.generated_tokens)
                self.ended[q.id] = q.status.name
                self.rt.drop(q.id)
        for sid in set(ids) - done:
            seq = self.s.sequence(sid)
            if seq is not None:
                self.tokens[sid] = list(seq.generated_tokens)
        return t, sampled

    def abort(self, nth):
        self.s.abort_iteration(self.plans[nth])
        del self.plans[nth:]

    def cancel(self, sid):
        ok = self.s.cancel(sid)
        if ok:
            self.rt.drop(sid)
            self.ended[sid] = "CANCELLED"
        return ok

    def preempt(self, used):
        victims = self.s.preempt_for_component_pressure(used)
        for v in victims:
            self.rt.drop(v)
        return victims


def plan_view(p):
    return (p.step, len(p), p.token_count, p.admitted, list(p.sequence_ids),
            np.asarray(p.tokens).tolist(), np.asarray(p.positions).tolist(),
            np.asarray(p.row_offsets).tolist(), np.asarray(p.phases).tolist(),
            np.asarray(p.sample_rows).tolist(), np.asarray(p.deferred_rows).tolist(),
            np.asarray(p.deferred_source_steps).tolist(),
            np.asarray(p.deferred_source_indexes).tolist())


def state_view(s):
    snap = s.snapshot()
    seqs = {}
    for i in snap.active_ids + snap.waiting_ids:
        q = s.sequence(i)
        seqs[i] = (list(q.generated_tokens), q.prefill_cursor, q.status.name)
    return (snap.active_ids, snap.waiting_ids, snap.component_used_bytes, seqs, s.metrics(),
            s.live_plans if hasattr(s, "live_plans") else None)


def outcome(fn):
    try:
        return ("ok", fn())
    except (PlanInFlight, StalePlanError, ValueError) as exc:
        return ("raised", type(exc).__name__)


def run_script(depth, ops, mixed):
    config = _config(depth, mixed_prefill_decode=mixed,
                     memory_components=[MemoryComponent("kv", 60, 0, 1, 0)])
    drivers = [Driver(Scheduler, config), Driver(TwinScheduler, config)]
    n = 0
    for step, (kind, x) in enumerate(ops):
        results = []
        for d in drivers:
            if kind == "submit":
                sid = f"s{n}"
                prompt = [(x * 7 + i) % VOCAB for i in range(1 + x % 9)]
                results.append(outcome(lambda: d.submit(sid, prompt, 1 + x % 6)))
            elif kind == "plan":
                res = outcome(d.plan)
                results.append((res[0], plan_view(res[1])) if res[0] == "ok" else res)
            elif kind == "complete":
                if not d.plans:
                    results.append("nothing")
                    continue
                res = outcome(d.complete)
                results.append(res)
            elif kind == "abort":
                if not d.plans:
                    results.append("nothing")
                    continue
                results.append(outcome(lambda: d.abort(x % len(d.plans))))
            elif kind == "cancel":
                results.append(outcome(lambda: d.cancel(f"s{x % (n + 1)}")))
            else:
                results.append(outcome(lambda: d.preempt([40 + x % 40])))
        if kind == "submit":
            n += 1
        assert results[0] == results[1], (step, kind, results)
        assert state_view(drivers[0].s) == state_view(drivers[1].s), (step, kind)
    return drivers


@pytest.mark.parametrize("depth", [1, 2, 3])
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(ops=OPS, mixed=st.booleans())
def test_native_and_twin_agree_at_depth(depth, ops, mixed):
    run_script(depth, ops, mixed)


def drain(d: Driver, rng, depth, cancel_p=0.0, preempt_p=0.0, abort_p=0.0, limit=2000):
    """Run until every sequence ended: keep up to `depth` plans in flight, complete in order,
    with random cancels, preemptions and aborts."""
    for _ in range(limit):
        snap = d.s.snapshot()
        if not snap.active_ids and not snap.waiting_ids and not d.plans:
            return
        r = rng.random()
        if r < cancel_p and snap.active_ids + snap.waiting_ids:
            ids = snap.active_ids + snap.waiting_ids
            d.cancel(ids[rng.randrange(len(ids))])
            continue
        if r < cancel_p + preempt_p and snap.active_ids:
            d.preempt([10**6])  # one victim at least
            d.preempt([0])
            continue
        if r < cancel_p + preempt_p + abort_p and d.plans:
            d.abort(rng.randrange(len(d.plans)))
            continue
        if len(d.plans) < depth and (snap.active_ids or snap.waiting_ids):
            p = d.plan()
            if len(p) == 0:
                d.abort(len(d.plans) - 1)  # nothing to run now: complete what is in flight
                if d.plans:
                    d.complete()
            continue
        d.complete()
    raise AssertionError("did not drain")


@pytest.mark.parametrize("impl", [Scheduler, TwinScheduler], ids=["native", "twin"])
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 10**6), depth=st.sampled_from([2, 3]),
       cancel=st.booleans(), preempt=st.booleans(), abort=st.booleans(), mixed=st.booleans())
def test_every_sequence_gets_its_alone_tokens_at_any_depth(impl, seed, depth, cancel, preempt,
                                                           abort, mixed):
    import random

    rng = random.Random(seed)
    prompts = {f"r{i}": [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 14))]
               for i in range(rng.randrange(2, 8))}
    limits = {sid: rng.randrange(1, 9) for sid in prompts}
    results = {}
    for d_depth in (1, depth):
        d = Driver(impl, _config(d_depth, mixed_prefill_decode=mixed,
                                 memory_components=[MemoryComponent("kv", 10**5, 0, 1, 0)]))
        for sid, p in prompts.items():
            d.submit(sid, p, limits[sid])
        drain(d, random.Random(seed + d_depth), d_depth, 0.03 * cancel, 0.05 * preempt,
              0.05 * abort)
        results[d_depth] = d
        assert d.s.metrics().aborted_plans >= 0
        for sid, p in prompts.items():
            want = alone_tokens(p, limits[sid])
            got = d.tokens[sid]
            if d.ended.get(sid) == "CANCELLED":
                assert got == want[:len(got)], (sid, got, want)
            else:
                assert d.ended.get(sid) == "FINISHED", (sid, d.ended.get(sid))
                assert got == want, (d_depth, sid, got, want)
        assert d.s.live_plans == 0


@pytest.mark.parametrize("impl", [Scheduler, TwinScheduler], ids=["native", "twin"])
@pytest.mark.parametrize("mixed", [False, True])
def test_after_an_abort_the_next_plan_repeats_the_aborted_one(impl, mixed):
    for depth in (1, 2):
        s = impl(_config(depth, mixed_prefill_decode=mixed))
        for i in range(3):
            s.submit(Sequence(f"x{i}", list(range(i, i + 6)), 5))
        p = s.plan_iteration()
        first = plan_view(p)
        s.abort_iteration(p)
        again = s.plan_iteration()
        # Same rows, tokens and positions; a new step, and the admissions stayed done.
        view = plan_view(again)
        assert view[1:3] + view[4:] == first[1:3] + first[4:]
        assert again.step == first[0] + 1 and (first[3], view[3]) == (3, 0)
        assert s.metrics().aborted_plans == 1
        with pytest.raises(StalePlanError):
            s.complete_iteration(p)


@pytest.mark.parametrize("impl", [Scheduler, TwinScheduler], ids=["native", "twin"])
def test_depth_two_defers_inputs_and_refuses_a_third_plan(impl):
    s = impl(_config(2))
    s.submit(Sequence("a", [1, 2, 3], 4))
    p0 = s.plan_iteration()
    p1 = s.plan_iteration()  # a's first token is still in flight: its decode row is deferred
    assert (p0.step, p1.step) == (0, 1)
    assert np.asarray(p1.deferred_rows).tolist() == [0]
    assert np.asarray(p1.deferred_source_steps).tolist() == [0]
    assert np.asarray(p1.deferred_source_indexes).tolist() == [0]
    assert np.asarray(p1.tokens).tolist() == [-1] and np.asarray(p1.positions).tolist() == [3]
    before = state_view(s)
    with pytest.raises(PlanInFlight):
        s.plan_iteration()
    with pytest.raises(PlanInFlight):
        s.complete_iteration(p1)  # out of order
    assert state_view(s) == before
    p0.outputs.request_indexes[0] = 0
    p0.outputs.predicted_tokens[0] = 9
    p0.outputs.count = 1
    assert resolve_deferred(p1, [p0]) == 1
    assert np.asarray(p1.tokens).tolist() == [9]
    s.complete_iteration(p0)
    assert list(s.sequence("a").generated_tokens) == [9]
    p1.outputs.request_indexes[0] = 0
    p1.outputs.predicted_tokens[0] = 10
    p1.outputs.count = 1
    s.complete_iteration(p1)
    assert list(s.sequence("a").generated_tokens) == [9, 10]


@pytest.mark.parametrize("impl", [Scheduler, TwinScheduler], ids=["native", "twin"])
def test_a_late_output_for_an_ended_sequence_is_discarded(impl):
    s = impl(_config(2))
    s.submit(Sequence("a", [1, 2], 10))
    p0 = s.plan_iteration()
    p1 = s.plan_iteration()
    p0.outputs.request_indexes[0] = 0
    p0.outputs.predicted_tokens[0] = -1  # a ends in p0
    p0.outputs.count = 1
    t = s.complete_iteration(p0)
    assert t.finished_ids == ["a"]
    p1.outputs.request_indexes[0] = 0
    p1.outputs.predicted_tokens[0] = 5
    p1.outputs.count = 1
    t = s.complete_iteration(p1)
    assert t.finished_ids == [] and s.metrics().discarded_rows == 1
    assert s.sequence("a") is None
    # max_tokens counts the tokens in flight: a 1-token sequence is not planned twice.
    s.submit(Sequence("b", [3], 1))
    q0 = s.plan_iteration()
    q1 = s.plan_iteration()
    assert len(q0) == 1 and len(q1) == 0


@pytest.mark.parametrize("impl", [Scheduler, TwinScheduler], ids=["native", "twin"])
def test_depth_three_schedules_exercise_every_mechanism(impl):
    """Seeded runs at depth 3 with cancels, preemptions and aborts: every sequence gets its
    alone tokens, and deferred inputs, discarded rows and aborts all really happen."""
    import random

    totals = dict(deferred=0, discarded=0, aborted=0, preempted=0)
    for seed in range(25):
        rng = random.Random(seed)
        prompts = {f"r{i}": [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 14))]
                   for i in range(rng.randrange(2, 8))}
        limits = {sid: rng.randrange(1, 9) for sid in prompts}
        d = Driver(impl, _config(3, memory_components=[MemoryComponent("kv", 10**5, 0, 1, 0)]))
        for sid, p in prompts.items():
            d.submit(sid, p, limits[sid])
        make = d.plan

        def counting_plan():
            p = make()
            totals["deferred"] += len(p.deferred_rows)
            return p

        d.plan = counting_plan
        drain(d, random.Random(seed), 3, 0.03, 0.05, 0.05)
        m = d.s.metrics()
        totals["discarded"] += m.discarded_rows
        totals["aborted"] += m.aborted_plans
        totals["preempted"] += m.preempted
        for sid, p in prompts.items():
            want = alone_tokens(p, limits[sid])
            got = d.tokens[sid]
            assert got == (want[:len(got)] if d.ended[sid] == "CANCELLED" else want), sid
    assert all(v > 20 for v in totals.values()), totals


class _Outputs:
    def __init__(self, plan) -> None:
        out = plan.outputs
        self.count = int(out.count)
        self.request_indexes = np.array(out.request_indexes)
        self.predicted_tokens = np.array(out.predicted_tokens)


class _SourceCopy:
    """An earlier plan's step and outputs, as any plan object carries them (not the core's
    type, so `resolve_deferred` takes its numpy path)."""

    def __init__(self, plan) -> None:
        self.step = plan.step
        self.outputs = _Outputs(plan)
        self._rows = len(plan)

    def __len__(self) -> int:
        return self._rows


@pytest.mark.parametrize("seed", range(6))
def test_the_cores_plans_fill_deferred_inputs_as_the_numpy_path_does(seed):
    # Depth 3: a plan's deferred inputs come from the two plans before it; their outputs hold
    # tokens, end signals (negative) and rows left without an output.
    rng = np.random.default_rng(seed)
    s = Scheduler(_config(3, max_active_sequences=5, max_tokens_per_iteration=16))
    for i in range(12):
        s.submit(Sequence(f"s{i}", [1, 2, 3 + i], 20))
    plans = [s.plan_iteration() for _ in range(3)]
    filled_any = 0
    missing = 0
    for _ in range(20):
        p0, p1, p2 = plans
        for p in (p0, p1):
            if p.outputs.count == 0 and len(p.sample_rows):
                rows = np.asarray(p.sample_rows)
                keep = rows[rng.random(len(rows)) < 0.8]
                toks = rng.integers(1, 300, len(keep)).astype(np.int32)
                toks[rng.random(len(keep)) < 0.05] = -1
                p.outputs.request_indexes[:len(keep)] = keep
                p.outputs.predicted_tokens[:len(keep)] = toks
                p.outputs.count = len(keep)
        n = len(p2.deferred_rows)
        targets = np.asarray(p2.row_offsets)[np.asarray(p2.deferred_rows)]
        want = resolve_deferred(p2, [_SourceCopy(p0), _SourceCopy(p1)])
        expected = np.asarray(p2.tokens).copy()
        np.asarray(p2.tokens)[targets] = -1
        assert p2.fill_deferred(p0) + p2.fill_deferred(p1) == want == n  # the C loops
        assert np.asarray(p2.tokens).tolist() == expected.tolist()
        np.asarray(p2.tokens)[targets] = -1
        assert resolve_deferred(p2, [p0, p1]) == n  # through them
        assert np.asarray(p2.tokens).tolist() == expected.tolist()
        np.asarray(p2.tokens)[targets] = -1
        assert resolve_deferred(p2, [p1, p0, p1]) == n  # a plan given twice: the numpy path
        assert np.asarray(p2.tokens).tolist() == expected.tolist()
        filled_any += n
        if int(p0.step) in np.asarray(p2.deferred_source_steps).tolist():
            with pytest.raises(ValueError, match=f"plan step {int(p0.step)}, which is not"):
                resolve_deferred(p2, [p1])  # a source left out
            missing += 1
        s.complete_iteration(p0)
        plans = [p1, p2, s.plan_iteration()]
    assert filled_any > 20 and missing > 0
    with pytest.raises(TypeError):
        plans[2].fill_deferred(None)
