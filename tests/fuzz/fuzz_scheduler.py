"""Fuzz the scheduler's submit/plan/complete/preempt/cancel path with arbitrary bytes.

Each input decodes into a configuration and a sequence of operations applied to the native
scheduler and to the pure-Python twin side by side. After every operation both must agree
(plans, telemetry, errors, snapshots, metrics), and the native state must satisfy §0.5:
every live id in exactly one of waiting/active, used bytes never above what admission allows,
plan rows within budget. Coverage guidance comes from the (instrumented) twin, whose branches
mirror the native core's.

    python tests/fuzz/fuzz_scheduler.py tests/fuzz/corpus/fuzz_scheduler -max_total_time=60
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))

from _bytes import ByteReader  # noqa: E402

IDS = ["a", "b", "c", "d", "e", "f"]


def _imports():
    import skippy_scheduler as sk

    return sk


sk = None


def build(r: ByteReader, depth: int = 1):
    comps = [
        sk.MemoryComponent(f"m{i}", r.below(2000), r.below(50), r.below(12), r.below(80))
        for i in range(r.below(3))
    ]
    config = sk.SchedulerConfig(
        max_active_sequences=r.below(5),
        max_waiting_sequences=r.below(6),
        max_tokens_per_iteration=r.below(14),
        prefill_chunk_tokens=r.below(8),
        max_prefill_sequences_per_iteration=None if r.flag() else r.below(3),
        max_consecutive_prefill_iterations=None if r.flag() else r.below(3),
        mixed_prefill_decode=r.flag(),
        cache_aging_cost_per_iteration=r.below(5000),
        group_waiting_prefixes=r.flag(),
        memory_components=comps,
        max_inflight_plans=depth,
    )
    admission = [None, sk.FcfsAdmission, sk.PriorityAdmission][r.below(3)]
    preemption = [None, sk.FewestComputedTokens][r.below(2)]
    make = lambda impl: impl(  # noqa: E731
        config, admission() if admission else None, preemption() if preemption else None
    )
    return config, make(sk.Scheduler), make(sk.TwinScheduler)


def call(fn):
    try:
        return True, fn()
    except Exception as exc:  # noqa: BLE001 - compared by type
        return False, type(exc)


def check(native, twin, config):
    sn, st = native.snapshot(), twin.snapshot()
    assert sn == st, (sn, st)
    assert native.metrics() == twin.metrics()
    for i in IDS:
        assert native.sequence(i) == twin.sequence(i), i
    assert not set(sn.active_ids) & set(sn.waiting_ids)
    assert len(sn.active_ids) <= config.normalized().max_active_sequences
    m = native.metrics()
    assert (m.active_sequences, m.waiting_sequences) == (len(sn.active_ids), len(sn.waiting_ids))


def run(data: bytes) -> None:
    global sk
    if sk is None:
        sk = _imports()
    r = ByteReader(data)
    # NOTE: the depth comes from the input's length, not from its bytes, so the corpus decodes
    # to the same operations as before plans in flight existed (depth 1 for a third of it).
    depth = 1 + len(data) % 3
    config, native, twin = build(r, depth)
    norm = config.normalized()
    live: list = []  # (native, twin) plans in flight, oldest first
    plans = None
    while r.remaining() > 0:
        op = r.below(8)
        if op == 0:  # submit
            prompt = r.tokens(10, 6)
            seq = sk.Sequence(IDS[r.below(len(IDS))], prompt, r.below(5), None, r.below(4))
            if r.flag():
                seq.with_admission_tokens(r.below(40))
            if r.flag():
                seq.with_prefilled_generation([r.below(9) for _ in range(1 + r.below(3))])
            if r.flag():
                seq.with_prefix_restore(sk.PrefixRestore("p", r.below(14)))
            if r.flag():
                seq.with_cache_affinity(sk.CacheAffinity.from_stage(
                    sk.StageCacheAffinity(0, r.below(10), r.below(60), r.below(100), 0)))
            a, b = call(lambda: native.submit(seq)), call(lambda: twin.submit(seq))
            assert a == b, (a, b)
        elif op in (1, 2):  # plan
            a, b = call(native.plan_iteration), call(twin.plan_iteration)
            assert a[0] == b[0], (a, b)
            if not a[0]:
                assert a[1] is b[1] is sk.PlanInFlight and len(live) == depth > 1
                check(native, twin, config)
                continue
            pn, pt = a[1], b[1]
            assert pn.work == pt.work and pn.admitted == pt.admitted and pn.step == pt.step
            assert pn.deferred_rows.tolist() == pt.deferred_rows.tolist()
            assert pn.deferred_source_steps.tolist() == pt.deferred_source_steps.tolist()
            assert pn.deferred_source_indexes.tolist() == pt.deferred_source_indexes.tolist()
            assert pn.token_count <= norm.max_tokens_per_iteration
            assert len({w.sequence_id for w in pn.work}) == len(pn.work)
            assert all(len(w.tokens) >= 1 for w in pn.work)
            if depth == 1:
                live = []  # replaced: aborted by the scheduler
            live.append((pn, pt))
            plans = live[0]
        elif op == 5 and depth > 1 and live and r.flag():  # abort a plan in flight
            k = r.below(len(live))
            a = call(lambda: native.abort_iteration(live[k][0]))
            b = call(lambda: twin.abort_iteration(live[k][1]))
            assert a == b, (a, b)
            del live[k:]
            plans = live[0] if live else None
        elif op in (3, 4) and plans is not None:  # complete (the oldest plan)
            pairs = []
            for i, w in enumerate(plans[1].work):
                if not w.sample_last:
                    continue
                c = r.below(8)
                if c == 0:
                    continue
                pairs.append((i, -1 if c == 1 else c * 5))
            if r.below(6) == 0 and plans[1].work:
                pairs.append((r.below(len(plans[1].work) + 2), 1))  # maybe malformed
            from sched_helpers import complete  # (imports the package: after instrumentation)

            preds = [sk.IterationPrediction(i, t) for i, t in pairs]
            a = call(lambda: complete(native, plans[0], preds))
            b = call(lambda: complete(twin, plans[1], preds))
            assert a == b, (a, b)
            if a[0] and live and live[0] is plans:
                live.pop(0)
                plans = live[0] if live else plans
        elif op == 5 and plans is not None:  # observe
            elapsed = [0.001, 0.002, 0.004, 0.03, 0.0, -1.0][r.below(6)]
            a = call(lambda: native.observe_iteration_duration(plans[0], elapsed))
            b = call(lambda: twin.observe_iteration_duration(plans[1], elapsed))
            assert a == b, (a, b)
        elif op == 6:  # preempt with measured usage
            used = [r.below(2500) for _ in range(r.below(4))]
            a = call(lambda: native.preempt_for_component_pressure(used))
            b = call(lambda: twin.preempt_for_component_pressure(used))
            assert a == b, (a, b)
        elif op == 7:  # cancel (known or unknown id)
            k = r.below(len(IDS) + 1)
            sequence_id = IDS[k] if k < len(IDS) else "?"
            assert native.cancel(sequence_id) == twin.cancel(sequence_id)
        check(native, twin, config)


def TestOneInput(data: bytes) -> None:  # noqa: N802 - the atheris entry point name
    run(data)


if __name__ == "__main__":
    import atheris

    with atheris.instrument_imports():
        sk = _imports()
    atheris.Setup(sys.argv, TestOneInput)
    atheris.Fuzz()
