"""Disjoint plans in flight (docs/behaviour.md §2.11a, `disjoint_inflight_plans`): the native
core and the twin make the same plans on random operation scripts at depth 2 and 3, and every
plan they make keeps the rule: no row is deferred, no sequence has rows in two live plans, a
plan keeps to the step budget and to its share of decode rows (ceil(active / depth)). With a
deterministic model every sequence gets its alone tokens under cancellation, preemption and
aborts, and the decoding sequences settle into groups that take turns.
"""
from __future__ import annotations

import random

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from token_model import VOCAB, alone_tokens, run_rows

from skippy_scheduler import (MemoryComponent, PlanInFlight, Scheduler, SchedulerConfig,
                              Sequence, StalePlanError, TwinScheduler)


def _config(depth: int, mixed: bool, budget: int = 12, **kw) -> SchedulerConfig:
    return SchedulerConfig(max_active_sequences=5, max_tokens_per_iteration=budget,
                           prefill_chunk_tokens=4, max_inflight_plans=depth,
                           mixed_prefill_decode=mixed, disjoint_inflight_plans=True, **kw)


class Driver:
    """One scheduler and its plans in flight (oldest first), run on the token model at once."""

    def __init__(self, impl, config: SchedulerConfig) -> None:
        self.s = impl(config)
        self.depth = config.max_inflight_plans
        self.budget = config.max_tokens_per_iteration
        self.kv: dict[str, list[int]] = {}
        self.plans: list = []
        self.tokens: dict[str, list[int]] = {}
        self.ended: dict[str, str] = {}

    def plan(self):
        active = len(self.s.snapshot().active_ids)  # before: admission may add some
        p = self.s.plan_iteration()
        check_rule(p, self.plans, self.budget, self.depth,
                   max(active, len(self.s.snapshot().active_ids)))
        run_rows(self.kv, p)
        self.plans.append(p)
        return p

    def complete(self):
        p = self.plans.pop(0)
        t = self.s.complete_iteration(p)
        done = set(t.finished_ids) | set(t.failed_ids)
        for q in self.s.retired():
            if q.id in done:
                self.tokens[q.id] = list(q.generated_tokens)
                self.ended[q.id] = q.status.name
                self.kv.pop(q.id, None)
        return sorted(done)

    def abort(self, nth: int) -> None:
        self.s.abort_iteration(self.plans[nth])
        del self.plans[nth:]

    def cancel(self, sid: str) -> bool:
        ok = self.s.cancel(sid)
        if ok:
            self.kv.pop(sid, None)
            self.ended[sid] = "CANCELLED"
        return ok

    def preempt(self, used: int) -> list[str]:
        victims = self.s.preempt_for_component_pressure([used])
        for v in victims:
            self.kv.pop(v, None)
        return victims


def check_rule(plan, live: list, budget: int, depth: int, active: int) -> None:
    """§2.11a on one plan made while `live` plans were in flight."""
    assert len(plan.deferred_rows) == 0
    assert plan.token_count <= budget
    ids = list(plan.sequence_ids)
    assert len(set(ids)) == len(ids)
    decode = int(np.count_nonzero(np.asarray(plan.phases)[:len(plan)] == 2))
    assert decode <= -(-active // depth), (decode, active, depth)
    for other in live:
        assert not set(ids) & set(other.sequence_ids), (ids, list(other.sequence_ids))


def _plan_view(p):
    return (p.step, list(p.sequence_ids), np.asarray(p.tokens).tolist(),
            np.asarray(p.positions).tolist(), np.asarray(p.row_offsets).tolist(),
            np.asarray(p.phases).tolist(), np.asarray(p.sample_rows).tolist(),
            np.asarray(p.new_rows).tolist())


def _state(s):
    snap = s.snapshot()
    seqs = {}
    for i in snap.active_ids + snap.waiting_ids:
        q = s.sequence(i)
        seqs[i] = (list(q.generated_tokens), q.prefill_cursor, q.status.name)
    return snap.active_ids, snap.waiting_ids, seqs, s.metrics()


def _outcome(fn):
    try:
        return ("ok", fn())
    except (PlanInFlight, StalePlanError, ValueError) as exc:
        return ("raised", type(exc).__name__)


OPS = st.lists(st.tuples(st.sampled_from(["submit", "submit", "plan", "plan", "plan",
                                          "complete", "complete", "abort", "cancel",
                                          "preempt"]),
                         st.integers(0, 1000)), min_size=1, max_size=80)


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(ops=OPS, depth=st.sampled_from([2, 3]), mixed=st.booleans(),
       budget=st.sampled_from([3, 6, 12, 40]))
def test_native_and_twin_make_the_same_disjoint_plans(ops, depth, mixed, budget):
    config = _config(depth, mixed, budget, memory_components=[MemoryComponent("kv", 90, 0, 1, 0)])
    drivers = [Driver(Scheduler, config), Driver(TwinScheduler, config)]
    n = 0
    for step, (kind, x) in enumerate(ops):
        results = []
        for d in drivers:
            if kind == "submit":
                prompt = [(x * 7 + i) % VOCAB for i in range(1 + x % 9)]
                results.append(_outcome(lambda: d.s.submit(Sequence(f"s{n}", prompt,
                                                                    1 + x % 6))))
            elif kind == "plan":
                res = _outcome(d.plan)
                results.append((res[0], _plan_view(res[1])) if res[0] == "ok" else res)
            elif kind in ("complete", "abort") and not d.plans:
                results.append("nothing")
            elif kind == "complete":
                results.append(_outcome(d.complete))
            elif kind == "abort":
                results.append(_outcome(lambda: d.abort(x % len(d.plans))))
            elif kind == "cancel":
                results.append(_outcome(lambda: d.cancel(f"s{x % (n + 1)}")))
            else:
                results.append(_outcome(lambda: d.preempt(40 + x % 50)))
        if kind == "submit":
            n += 1
        assert results[0] == results[1], (step, kind, results)
        assert _state(drivers[0].s) == _state(drivers[1].s), (step, kind)


def _drain(d: Driver, rng: random.Random, cancel_p: float, preempt_p: float,
           abort_p: float) -> None:
    for _ in range(3000):
        snap = d.s.snapshot()
        if not snap.active_ids and not snap.waiting_ids and not d.plans:
            return
        r = rng.random()
        if r < cancel_p and snap.active_ids + snap.waiting_ids:
            ids = snap.active_ids + snap.waiting_ids
            d.cancel(ids[rng.randrange(len(ids))])
        elif r < cancel_p + preempt_p and snap.active_ids:
            d.preempt(10**6)  # one victim at least
            d.preempt(0)
        elif r < cancel_p + preempt_p + abort_p and d.plans:
            d.abort(rng.randrange(len(d.plans)))
        elif len(d.plans) < d.depth and (snap.active_ids or snap.waiting_ids):
            if len(d.plan()) == 0:
                d.abort(len(d.plans) - 1)  # nothing to run now: complete what is in flight
                if d.plans:
                    d.complete()
        else:
            d.complete()
    raise AssertionError("did not drain")


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 10**6), depth=st.sampled_from([2, 3]), cancel=st.booleans(),
       preempt=st.booleans(), abort=st.booleans(), mixed=st.booleans())
def test_every_sequence_gets_its_alone_tokens_with_disjoint_plans(seed, depth, cancel, preempt,
                                                                  abort, mixed):
    rng = random.Random(seed)
    prompts = {f"r{i}": [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 14))]
               for i in range(rng.randrange(2, 9))}
    limits = {sid: rng.randrange(1, 12) for sid in prompts}
    for impl in (Scheduler, TwinScheduler):
        d = Driver(impl, _config(depth, mixed,
                                 memory_components=[MemoryComponent("kv", 10**5, 0, 1, 0)]))
        for sid, p in prompts.items():
            d.s.submit(Sequence(sid, p, limits[sid]))
            d.tokens[sid] = []
        _drain(d, random.Random(seed), 0.03 * cancel, 0.05 * preempt, 0.05 * abort)
        for sid, p in prompts.items():
            want = alone_tokens(p, limits[sid])
            got = d.tokens[sid]
            if d.ended.get(sid) == "CANCELLED":
                assert got == want[:len(got)], (sid, got, want)
            else:
                assert d.ended.get(sid) == "FINISHED", (sid, d.ended.get(sid))
                assert got == want, (depth, sid, got, want)
        assert d.s.live_plans == 0


def test_decoding_sequences_take_turns_in_groups():
    for impl in (Scheduler, TwinScheduler):
        s = impl(SchedulerConfig(max_inflight_plans=3, disjoint_inflight_plans=True,
                                 max_tokens_per_iteration=64))
        for i in range(7):
            s.submit(Sequence(f"s{i}", [1, 2, 3, i + 4], 50))
        live = [s.plan_iteration()]  # every prompt in one prefill plan
        groups = []
        for _ in range(12):
            while s.live_plans < 3:
                p = s.plan_iteration()
                if len(p) == 0:
                    s.abort_iteration(p)
                    break
                live.append(p)
                groups.append(tuple(p.sequence_ids))
            done = live.pop(0)
            k = len(done.sample_rows)
            done.outputs.request_indexes[:k] = done.sample_rows
            done.outputs.predicted_tokens[:k] = 9
            done.outputs.count = k
            s.complete_iteration(done)
        # ceil(7 / 3) = 3 decode rows a plan: three groups, each planned every third turn.
        assert groups[:6] == [("s0", "s1", "s2"), ("s3", "s4", "s5"), ("s6",)] * 2, groups
        assert all(len(g) <= 3 for g in groups)


def test_off_by_default_the_next_plan_defers_the_same_rows():
    s = Scheduler(SchedulerConfig(max_inflight_plans=2, max_tokens_per_iteration=64))
    for i in range(2):
        s.submit(Sequence(f"s{i}", [1, 2, 3], 5))
    first = s.plan_iteration()
    second = s.plan_iteration()
    assert list(second.sequence_ids) == list(first.sequence_ids)
    assert len(second.deferred_rows) == 2
    assert SchedulerConfig().disjoint_inflight_plans is False
