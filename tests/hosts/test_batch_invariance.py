"""A sequence's logits are the same bits alone and batched on llama.cpp's CPU backend: a step
of one token gets a filler row on another lane (the solo fill), since a one-token step goes
through other kernel arithmetic (docs/hosts.md, "When the tokens are the same")."""
from __future__ import annotations

import random

import numpy as np

import pytest

pytest.importorskip("llama_cpp")

from skippy_scheduler import Scheduler, SchedulerConfig  # noqa: E402
from skippy_scheduler.engine import Engine, Request, TokenEvent  # noqa: E402
from skippy_scheduler.hosts.llama import LlamaHost  # noqa: E402
from skippy_scheduler.hosts.tiny_model import write_tiny_llama  # noqa: E402
from skippy_scheduler.sampling import OutputOptions, SamplingParams  # noqa: E402

LANES = 4
STEPS = 40


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("model") / "tiny-f32.gguf", seed=7)


def _run(host: LlamaHost, requests: list[Request]) -> dict[str, list[tuple[int, float]]]:
    """Each request's (token, raw log-probability) pairs, the requests run together."""
    engine = Engine(Scheduler(SchedulerConfig(max_active_sequences=host.n_seq_max,
                                              max_tokens_per_iteration=256)), host)
    got: dict[str, list[tuple[int, float]]] = {r.id: [] for r in requests}
    engine.add_listener(lambda e: got[e.request_id].append((e.token, e.detail.logprob.logprob))
                        if isinstance(e, TokenEvent) and e.token >= 0 else None)
    for r in requests:
        engine.submit(r)
    engine.run()
    assert host.active_sequences == []
    return got


def _request(rid: str, prompt: list[int], seed: int) -> Request:
    sampling = SamplingParams(temperature=0.9, seed=seed, ignore_eos=True,
                              output=OutputOptions(logprobs=0, prompt_length=len(prompt)))
    return Request(rid, prompt, STEPS, sampling=sampling)


@pytest.mark.parametrize("kv_type", ["f32", "f16"])
def test_a_sequence_alone_gets_the_bits_it_gets_batched(model, kv_type):
    rng = random.Random(3)
    prompt = [1] + [rng.randrange(3, 380) for _ in range(30)]
    other = [1] + [rng.randrange(3, 380) for _ in range(20)]
    with LlamaHost(model, n_ctx=LANES * 256, n_seq_max=LANES, n_threads=1,
                   kv_type=kv_type) as host:
        batched = _run(host, [_request("a", prompt, 11), _request("b", other, 12)])["a"]
        filled = host.solo_fill_rows
        alone = _run(host, [_request("a", prompt, 11)])["a"]
        # Every decode step of the run alone was one token, each with its filler.
        assert host.solo_fill_rows - filled >= STEPS - 1
        assert alone == batched  # tokens and log-probabilities, to the last bit
        # Without the filler the one-token steps round otherwise (the test's premise).
        host.solo_fill = False
        try:
            bare = _run(host, [_request("a", prompt, 11)])["a"]
        finally:
            host.solo_fill = True
        assert [lp for _, lp in bare] != [lp for _, lp in batched]


def test_the_filler_leaves_no_cell_and_needs_a_second_lane(model):
    with LlamaHost(model, n_ctx=256, n_seq_max=1, n_threads=1) as host:
        _run(host, [_request("a", [1, 5, 6, 7], 3)])
        assert host.solo_fill_rows == 0  # a single lane: nothing to fill with
    with LlamaHost(model, n_ctx=LANES * 256, n_seq_max=LANES, n_threads=1) as host:
        _run(host, [_request("a", [1, 5, 6, 7], 3)])
        assert host.solo_fill_rows >= STEPS - 1
        assert host.host_state(detail=True).lane_positions == {}  # every filler's cell gone


def test_a_decode_row_beside_a_prompt_chunk_gets_the_bits_it_gets_beside_a_decode_row(model):
    """llama.cpp's first pass of a batch takes one token of each sequence: a lone decode row
    meets the chunk's first token there, one output among two tokens, which rounds otherwise;
    the chunk's first token has logits too, read by nobody."""
    rng = random.Random(5)
    a = [1] + [rng.randrange(3, 380) for _ in range(12)]
    b = [1] + [rng.randrange(3, 380) for _ in range(30)]

    def a_logits(beside: str, fill: bool) -> np.ndarray:
        with LlamaHost(model, n_ctx=LANES * 256, n_seq_max=LANES, n_threads=1,
                       solo_fill=fill) as host:
            host.run_rows([("a", a, 0, True), ("b", b[:10], 0, False)])  # lanes 0 and 1
            rows = [("a", [7], len(a), True)]
            rows.append(("b", b[10:20], 10, False) if beside == "chunk"
                        else ("b", [9], 10, True))
            host.run_rows(rows)
            return host.logits_of_batch_row(0)  # a's entry: the batch is in lane order

    decode_beside = a_logits("decode", True)
    assert np.array_equal(a_logits("chunk", True), decode_beside)
    assert not np.array_equal(a_logits("chunk", False), decode_beside)  # the premise


@pytest.mark.parametrize("unified", [False, True])
def test_no_filler_goes_on_a_lane_with_a_row_in_the_plan(model, unified):
    """Two greedy requests with one prompt are a fork; when the second is prefilled first (its
    first-token deadline) it leads, and the plan lists its follower first. The filler went on
    the leader's own lane and cut the cell it had just written: the next step failed."""
    from skippy_scheduler import PlanningRule

    prompt = [1, 17, 33, 90, 120]
    greedy = SamplingParams(temperature=0.0)
    with LlamaHost(model, n_ctx=2 * 256, n_seq_max=2, n_threads=1, kv_unified=unified) as host:
        engine = Engine(Scheduler(SchedulerConfig(max_active_sequences=2,
                                                  max_tokens_per_iteration=256,
                                                  planning_rule=PlanningRule.SLACK)), host)
        got: dict[str, list[int]] = {}
        engine.add_listener(lambda e: got.setdefault(e.request_id, []).append(e.token)
                            if isinstance(e, TokenEvent) and e.token >= 0 else None)
        engine.submit(Request("A", prompt, 6, sampling=greedy, priority=1))
        engine.submit(Request("B", prompt, 6, sampling=greedy, ttft_ms=5000.0))
        engine.run()
        assert got["A"] == got["B"] == host.generate_alone(prompt, 6)[:6]
        assert host.host_state(detail=True).lane_positions == {}
