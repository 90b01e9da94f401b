"""Fuzz the waiting-queue ranking (behaviour.md §3).

Each input takes one of two paths. Fuzzed candidates go through
`skippy_scheduler.order_cache_aware_candidates` (the native ranking kernel's Python face) and
through the reference `skippy_scheduler.reference.reference_order`; the results
must be the same permutation. Or the kernel is reached through the scheduler's admission:
fuzzed sequences are submitted to a scheduler whose memory admits nothing, so after one plan
its waiting queue is exactly the ranked order, which must equal the reference order. Prompts
share prefixes by construction (small alphabet, optional long common runs) so the
waiting-prefix grouping is exercised.

    python tests/fuzz/fuzz_rank.py tests/fuzz/corpus/fuzz_rank -max_total_time=60
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _bytes import ByteReader  # noqa: E402

sk = None
reference = None


def _imports():
    import skippy_scheduler as sk
    from skippy_scheduler import reference

    return sk, reference


def prompts(r: ByteReader, n: int) -> list:
    shared = [r.below(3)] * (r.below(4) * 500)  # long common prefix now and then
    return [(shared if r.flag() else []) + r.tokens(6, 4) for _ in range(n)]


def affinity(r: ByteReader):
    if r.below(3) == 0:
        return sk.CacheAffinity()
    return sk.CacheAffinity(tuple(
        sk.StageCacheAffinity(i, r.below(20), r.below(300), r.below(500), 0) for i in range(1 + r.below(2))))


def fuzz_kernel(r: ByteReader, order_native) -> None:
    n = r.below(12)
    ps = prompts(r, n)
    candidates = [
        sk.CacheAwareCandidate(index=i, priority=r.below(3), affinity=affinity(r), prompt_tokens=ps[i],
                               enqueued_turn=r.below(20), order=r.below(30))
        for i in range(n)
    ]
    turn, aging, grouping = r.below(25), r.below(5000), r.flag()
    expected = reference.reference_order(candidates, turn, aging, grouping)
    got = list(order_native(candidates, turn, aging, grouping))
    assert sorted(got) == list(range(n))
    assert got == list(expected), (got, expected)


def fuzz_admission(r: ByteReader) -> None:
    aging, grouping = r.below(5000), r.flag()
    block = sk.MemoryComponent("kv", 0, 0, 0, 1)  # every reservation is 1 byte: nothing fits
    config = sk.SchedulerConfig(max_waiting_sequences=64, cache_aging_cost_per_iteration=aging,
                                group_waiting_prefixes=grouping, memory_components=[block])
    s = sk.Scheduler(config)
    candidates = []
    order = 0
    rank_turn = 0
    for batch in range(1 + r.below(3)):  # several turns, so ages differ
        n = r.below(6)
        ps = prompts(r, n)
        for p in ps:
            if not p:
                continue
            a = affinity(r)
            priority = r.below(3)
            sequence_id = f"q{order}"
            s.submit(sk.Sequence(sequence_id, p, 1, None, priority).with_cache_affinity(a))
            candidates.append(sk.CacheAwareCandidate(index=len(candidates), priority=priority, affinity=a,
                                                     prompt_tokens=p, enqueued_turn=batch, order=order))
            order += 1
        submitted = any(ps)  # empty prompts are skipped above
        plan = s.plan_iteration()
        assert plan.admitted == 0 and len(plan) == 0
        if submitted:
            rank_turn = s.waiting_turn  # a submit made the queue dirty: this plan re-ranked it
    if not candidates:
        return
    expected = reference.reference_order(candidates, rank_turn, max(aging, 1), grouping)
    assert s.snapshot().waiting_ids == [f"q{i}" for i in expected]


def run(data: bytes) -> None:
    global sk, reference
    if sk is None:
        sk, reference = _imports()
    r = ByteReader(data)
    if r.flag():
        fuzz_kernel(r, sk.order_cache_aware_candidates)
    else:
        fuzz_admission(r)


def TestOneInput(data: bytes) -> None:  # noqa: N802 - the atheris entry point name
    run(data)


if __name__ == "__main__":
    import atheris

    with atheris.instrument_imports():
        sk, reference = _imports()
    atheris.Setup(sys.argv, TestOneInput)
    atheris.Fuzz()
