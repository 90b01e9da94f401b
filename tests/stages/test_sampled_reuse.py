"""Seeded, penalized sampling on stages with prefix reuse: a request whose prompt is partly
restored from a prefix holder samples the unsplit model's alone tokens with the same
sampling. The last stage's penalty window must hold the restored prefix's tokens too, which
the stages never decode for that request (docs/stages.md "Sampling")."""
from __future__ import annotations

import random

import pytest

pytest.importorskip("llama_cpp")
pytest.importorskip("zmq")

from skippy_scheduler import MemoryComponent, SchedulerConfig, Scheduler  # noqa: E402
from skippy_scheduler.cost_model import LAB_COST  # noqa: E402
from skippy_scheduler.engine import Engine, Request, VirtualClock  # noqa: E402
from skippy_scheduler.sampling import SamplingParams  # noqa: E402
from skippy_scheduler.hosts.stages.local import LocalStages  # noqa: E402

from stages_common import N_SEQ  # noqa: E402

PENALIZED = [
    SamplingParams(temperature=0.7, seed=5, top_k=20, frequency_penalty=0.5),
    SamplingParams(temperature=0.9, seed=17, presence_penalty=0.8),
    SamplingParams(temperature=0.0, repetition_penalty=1.3, penalty_last_n=16),
]


@pytest.fixture(scope="module")
def reuse2(splits, model4):
    with LocalStages(splits[2], source_model=model4) as local:
        with local.host(n_ctx=(N_SEQ + 4) * 512, n_seq_max=N_SEQ, n_batch=512, n_threads=1,
                        prefix_cache_tokens=400, prefix_holders=4) as host:
            yield host


def _run(host, requests, preempt_rng=None):
    config = SchedulerConfig(max_active_sequences=2, max_tokens_per_iteration=64,
                             prefill_chunk_tokens=16, mixed_prefill_decode=True,
                             memory_components=[MemoryComponent("kv", 10**9, 0, 1, 0)],
                             **host.sequence_id_settings)
    scheduler = Scheduler(config)
    preempted = 0

    def pressure(engine):
        nonlocal preempted
        if preempt_rng is not None and preempt_rng.random() < 0.15:
            preempted += len(engine.preempt([10**9 + 1]))
            engine.preempt([0])

    engine = Engine(scheduler, host, clock=VirtualClock(LAB_COST), before_step=pressure,
                    max_iterations=3000)
    engine.add_requests(requests)
    report = engine.run()
    restored = scheduler.metrics().restored_tokens
    scheduler.attach_prefix_store(None)  # the store serves the next run's scheduler
    return report, restored, preempted


def _check(unsplit, requests, report) -> None:
    by_id = {r.id: r for r in report.records}
    for req in requests:
        rec = by_id[req.id]
        want = unsplit.generate_alone(list(req.prompt_tokens), req.max_tokens, req.sampling)
        if rec.finish_reason == "stop":
            assert unsplit.is_eog(want[-1]), (req.id, want)
            want = want[:-1]
        else:
            assert rec.finish_reason == "length", (req.id, rec.finish_reason)
        assert rec.tokens == want, (req.id, req.sampling)


def test_a_penalized_request_restored_from_a_holder_samples_its_alone_tokens(reuse2, unsplit):
    """A greedy request leaves its prompt in a holder; later requests extending that prompt,
    seeded and with a frequency, presence or repetition penalty, restore it and prefill only
    the rest: their tokens equal the unsplit model's alone runs with the same sampling."""
    host = reuse2
    rng = random.Random(21)
    stem = [1] + [rng.randrange(3, 384) for _ in range(40)]
    requests = [Request("stem", stem, 4, arrival_us=0.0)]
    for i, params in enumerate(PENALIZED):
        prompt = stem + [rng.randrange(3, 384) for _ in range(rng.randrange(1, 12))]
        requests.append(Request(f"pen{i}", prompt, 20, sampling=params,
                                arrival_us=50_000.0 * (i + 1)))
    report, restored, _ = _run(host, requests)
    assert restored >= len(PENALIZED) * 32  # each penalized request restored the stem
    _check(unsplit, requests, report)
    host.sync()
    assert host.held() == [{}, {}]
    assert host.host_state(detail=True).samplers == 0  # every chain went with its request


def test_penalized_restored_requests_under_preemption(reuse2, unsplit):
    """The same with requests in flight together and preemption: a preempted penalized
    sequence restores its own prefix (or recomputes it) and still samples its alone tokens."""
    host = reuse2
    rng = random.Random(5)
    preempted = restored = 0
    for trial in range(3):
        stems = [[1] + [rng.randrange(3, 384) for _ in range(rng.randrange(16, 50))]
                 for _ in range(2)]
        requests = []
        for i in range(6):
            prompt = list(rng.choice(stems)) + [rng.randrange(3, 384)
                                                for _ in range(rng.randrange(0, 10))]
            params = rng.choice(PENALIZED + [None])
            requests.append(Request(f"t{trial}-{i}", prompt, rng.randrange(4, 16),
                                    sampling=params, arrival_us=i * 2000.0))
        report, got, n = _run(host, requests, preempt_rng=rng)
        restored += got
        preempted += n
        _check(unsplit, requests, report)
        host.sync()
        assert host.held() == [{}, {}]
    assert restored > 100 and preempted > 0
