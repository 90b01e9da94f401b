"""`LlamaHost` refuses what it could never run before anything is queued: a token outside the
vocabulary or more positions than a lane holds (`prepare_sequence`: the request ends as
rejected), a scheduler with more lanes or larger plans than it has (`check_config`, when the
engine is built). A plan token outside the vocabulary names its cause; the repr says what the
host holds (docs/hosts.md)."""
from __future__ import annotations

import pytest

pytest.importorskip("llama_cpp")

from skippy_scheduler import Scheduler, SchedulerConfig, Sequence  # noqa: E402
from skippy_scheduler.engine import Engine, FinishEvent, Request  # noqa: E402
from skippy_scheduler.hosts.llama import LlamaHost  # noqa: E402
from skippy_scheduler.hosts.tiny_model import write_tiny_llama  # noqa: E402
from skippy_scheduler.sampling import SamplingParams  # noqa: E402

LANES = 2
BATCH = 64


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    path = write_tiny_llama(tmp_path_factory.mktemp("model") / "tiny-f32.gguf", seed=7)
    with LlamaHost(path, n_ctx=LANES * 256, n_seq_max=LANES, n_batch=BATCH, n_threads=1) as h:
        yield h


def _config(**kw) -> SchedulerConfig:
    base = dict(max_active_sequences=LANES, max_tokens_per_iteration=BATCH,
                prefill_chunk_tokens=32)
    base.update(kw)
    return SchedulerConfig(**base)


def test_a_token_outside_the_vocabulary_is_refused_at_submit(host):
    assert host.n_vocab == 384
    engine = Engine(Scheduler(_config()), host, clock=None)
    with pytest.raises(ValueError, match=r"'bad': prompt_tokens\[1\] = 500 is outside "
                                         r"\[0, 384\)"):
        engine.submit(Request("bad", [1, 500, 3], 2))
    assert engine.open_ids() == [] and engine.status("bad") == "rejected"
    report = engine.run([Request("ok", [1, 300, 301], 3)])
    assert [(r.id, r.finish_reason) for r in report.records] == [("bad", "rejected"),
                                                                 ("ok", "length")]
    assert host.active_sequences == []


def test_refused_requests_in_a_run_end_as_rejected_and_the_others_run(host):
    engine = Engine(Scheduler(_config()), host, clock=None)
    ends: dict = {}
    engine.add_listener(lambda e: isinstance(e, FinishEvent) and ends.update({e.request_id: e}))
    lane = host.n_ctx_seq
    report = engine.run([
        Request("vocab", [1, 384], 2),
        Request("bias", [1, 2], 2, sampling=SamplingParams(logit_bias={400: 1.0})),
        Request("long", [1] * (lane - 10), 20),  # 246 + 20 - 1 positions: above the lane
        Request("fits", [1] * (lane - 10), 11),  # 246 + 11 - 1 = 256: exactly the lane
        Request("ok", [1, 300, 301], 3),
    ])
    got = {r.id: r.finish_reason for r in report.records}
    assert got == {"vocab": "rejected", "bias": "rejected", "long": "rejected",
                   "fits": got["fits"], "ok": "length"}
    assert got["fits"] in ("length", "stop")
    assert "outside [0, 384)" in ends["vocab"].error
    assert "logit_bias names token 400" in ends["bias"].error
    assert f"needs {lane + 9} positions" in ends["long"].error and "n_ctx_seq" in ends["long"].error
    assert engine.open_ids() == [] and host.active_sequences == []


def test_the_engine_refuses_a_scheduler_the_host_cannot_run(host):
    with pytest.raises(ValueError, match=r"up to 3 sequences at once .* 2 lanes \(n_seq_max\): "
                                         r"configure max_active_sequences <= 2"):
        Engine(Scheduler(_config(max_active_sequences=3)), host)
    with pytest.raises(ValueError, match=r"plans hold up to 128 tokens .* batch holds 64 "
                                         r"\(n_batch"):
        Engine(Scheduler(_config(max_tokens_per_iteration=512, prefill_chunk_tokens=64)), host)
    # A budget above the batch is fine when no plan can reach it: one row of at most 64.
    engine = Engine(Scheduler(_config(max_active_sequences=1, max_tokens_per_iteration=512,
                                      prefill_chunk_tokens=64)), host, clock=None)
    report = engine.run([Request("a", [1] + [7] * 100, 2)])
    assert report.records[0].finish_reason in ("length", "stop")


def test_a_plan_token_outside_the_vocabulary_names_its_cause(host):
    scheduler = Scheduler(_config())
    scheduler.submit(Sequence("x", [1, 500, 2], 2))  # the scheduler alone: no prepare_sequence
    plan = scheduler.plan_iteration()
    with pytest.raises(ValueError, match=r"\[0, 384\) for this model: row 0 \('x'\) has token "
                                         r"500 at position 1, outside the model's "
                                         r"vocabulary") as caught:
        host.execute(plan)
    assert "deferred" not in str(caught.value)
    scheduler.abort_iteration(plan)
    assert host.active_sequences == []


def test_an_unfilled_deferred_input_is_named_as_such(host):
    scheduler = Scheduler(_config(max_inflight_plans=2))
    scheduler.submit(Sequence("y", [1, 300, 301], 4))
    first = scheduler.plan_iteration()
    host.execute(first)
    second = scheduler.plan_iteration()  # its decode row's input is what `first` sampled
    assert second.deferred_rows.size == 1
    with pytest.raises(ValueError, match=r"\('y'\) has token -1 at position 3, a deferred "
                                         r"input left unfilled"):
        host.execute(second)
    scheduler.abort_iteration(first)  # and the plan after it
    host.release_all()
    assert host.active_sequences == []


def test_the_repr_says_what_the_host_holds(tmp_path):
    path = write_tiny_llama(tmp_path / "tiny.gguf", seed=7)
    h = LlamaHost(path, n_ctx=LANES * 256, n_seq_max=LANES, n_batch=BATCH, n_threads=1)
    try:
        h.run_rows([("busy", [1, 300], 0, True)])
        text = repr(h)
        assert text.startswith(f"<LlamaHost {str(path)!r}: 1/2 lanes busy")
        assert "n_ctx_seq=256" in text and "n_batch=64" in text
    finally:
        h.close()
    assert repr(h) == f"<LlamaHost {str(path)!r}: closed>"
