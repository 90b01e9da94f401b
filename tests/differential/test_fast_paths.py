"""The native scheduler's fast paths agree with the pure-Python twin on random workloads.

The core keeps per-class counts of active sequences instead of scanning them, caches each
sequence's pending token, takes a one-comparison path for outputs written in row order and
reuses numpy slices between plans. Random mixes of submits, plans, completions (in order,
shuffled, partial, finishing), cancels and pressure preemptions must give the same plans,
telemetry and sequences on both implementations.
"""
import random

import numpy as np
import pytest

from skippy_scheduler import (
    IterationPrediction,
    MemoryComponent,
    Scheduler,
    SchedulerConfig,
    Sequence,
    TwinScheduler,
)
from sched_helpers import complete


def _config(rng, mixed):
    return SchedulerConfig(
        max_active_sequences=rng.randint(1, 6),
        max_waiting_sequences=64,
        max_tokens_per_iteration=rng.choice([3, 8, 24, 64]),
        prefill_chunk_tokens=rng.choice([2, 5, 16]),
        max_prefill_sequences_per_iteration=rng.choice([None, 1, 2]),
        max_consecutive_prefill_iterations=rng.choice([None, 1, 3]),
        mixed_prefill_decode=mixed,
        memory_components=[MemoryComponent("kv", 4000, 0, 8, 64)],
    )


def _sequence(rng, i):
    s = Sequence(f"s{i}", [rng.randrange(0, 50) for _ in range(rng.randint(1, 12))],
                 rng.randint(1, 6), None, rng.randint(0, 2))
    if rng.random() < 0.3:
        s.with_prefilled_generation([rng.randrange(0, 50) for _ in range(rng.randint(1, 3))])
    return s


def _plan_rows(plan):
    return [(w.sequence_id, w.tokens, w.positions, w.sample_last, w.phase) for w in plan.work]


def _write(plan, rng, mode):
    """Fills plan.outputs like a runtime: in row order, shuffled, with a gap, or finishing."""
    rows = [int(r) for r in plan.sample_rows]
    tokens = [rng.randrange(0, 50) for _ in rows]
    if mode == "finish" and rows:
        tokens[rng.randrange(len(rows))] = -1
    if mode == "gap" and rows:
        k = rng.randrange(len(rows))
        del rows[k], tokens[k]
    pairs = list(zip(rows, tokens))
    if mode == "shuffle":
        rng.shuffle(pairs)
    out = plan.outputs
    for k, (r, t) in enumerate(pairs):
        out.request_indexes[k] = r
        out.predicted_tokens[k] = t
    out.count = len(pairs)
    return pairs


def _state(s):
    snap = s.snapshot()
    seqs = {i: s.sequence(i) for i in list(snap.active_ids) + list(snap.waiting_ids)}
    return snap, s.metrics(), seqs


@pytest.mark.parametrize("seed", range(40))
def test_native_matches_twin_on_random_workloads(seed):
    rng = random.Random(seed)
    cfg = _config(rng, mixed=seed % 3 == 0)
    native, twin = Scheduler(cfg), TwinScheduler(cfg)
    submitted = 0
    for _ in range(60):
        op = rng.random()
        if op < 0.25:
            seq = _sequence(rng, submitted)
            submitted += 1
            native.submit(seq)
            twin.submit(seq)
        elif op < 0.3 and submitted:
            victim = f"s{rng.randrange(submitted)}"
            assert native.cancel(victim) == twin.cancel(victim)
        elif op < 0.35:
            used = [rng.randrange(0, 5000)]
            assert native.preempt_for_component_pressure(used) == twin.preempt_for_component_pressure(used)
        else:
            pn, pt = native.plan_iteration(), twin.plan_iteration()
            assert _plan_rows(pn) == _plan_rows(pt)
            assert pn.token_count == pt.token_count and pn.admitted == pt.admitted
            assert np.asarray(pn.sample_rows).tolist() == np.asarray(pt.sample_rows).tolist()
            if cfg.mixed_prefill_decode and rng.random() < 0.5:
                elapsed = rng.choice([0.001, 0.005, 0.05])
                native.observe_iteration_duration(pn, elapsed)
                twin.observe_iteration_duration(pt, elapsed)
            mode = rng.choice(["order", "order", "shuffle", "gap", "finish", "preds"])
            if mode == "preds":
                preds = [IterationPrediction(int(r), rng.randrange(0, 50)) for r in pn.sample_rows]
                tn, tt = complete(native, pn, preds), complete(twin, pt, preds)
            else:
                state = rng.getstate()
                _write(pn, rng, mode)
                rng.setstate(state)
                _write(pt, rng, mode)
                tn, tt = native.complete_iteration(pn), twin.complete_iteration(pt)
            assert tn == tt
        assert _state(native) == _state(twin)
