"""`serve` with prefix reuse turns the cold prefix hold on (behaviour.md §2.3a), and
`--no-cold-prefix-hold` turns it off; with it on, a concurrent burst of requests sharing a cold
prefix gets every request's alone tokens over real HTTP, and leaves nothing pinned or held."""
from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import openai

from serve_support import LANE_CTX, alone, is_idle, start_server, wait_idle
from skippy_scheduler import cli
from skippy_scheduler.serve.server import COLD_PREFIX_HOLD_TOKENS, cold_prefix_hold_plans

GREEDY = {"temperature": 0.0}


def test_the_flag_and_its_default():
    parser = cli.build_parser()
    assert parser.parse_args(["serve"]).cold_prefix_hold is True
    assert parser.parse_args(["serve", "--no-cold-prefix-hold"]).cold_prefix_hold is False


def test_the_hold_lasts_as_long_as_a_lane_takes_in_the_smallest_chunks():
    # a 1 024-token lane in chunks of 32, one every 5 plans (slack_min_chunk_tokens,
    # slack_interleave_max + 1); never under the scheduler's own 64
    assert cold_prefix_hold_plans(1024) == 160
    assert cold_prefix_hold_plans(100) == 64 and cold_prefix_hold_plans(0) == 64


def _stream(client, prompt, max_tokens):
    ids = []
    for chunk in client.completions.create(model="tiny-f32", prompt=prompt, max_tokens=max_tokens,
                                           stream=True, extra_body={"return_token_ids": True},
                                           **GREEDY):
        ids.extend(chunk.choices[0].token_ids or [])
    return ids


def test_a_burst_sharing_a_cold_prefix_gets_its_alone_tokens(model_path, reference):
    rng = random.Random(21)
    head = [1] + [rng.randrange(3, 384) for _ in range(150)]
    prompts = [head + [rng.randrange(3, 384) for _ in range(rng.randrange(0, 6))]
               for _ in range(6)]
    srv = start_server(model_path, prefix_cache_tokens=1024, prefix_holders=4, prefill_chunk=16)
    off = start_server(model_path, prefix_cache_tokens=1024, prefix_holders=4,
                       cold_prefix_hold=False)
    try:
        assert srv.scheduler.config.cold_prefix_hold_tokens == COLD_PREFIX_HOLD_TOKENS
        assert srv.scheduler.config.cold_prefix_hold_max_steps == cold_prefix_hold_plans(LANE_CTX)
        assert off.scheduler.config.cold_prefix_hold_tokens == 0
        with openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0,
                           timeout=60) as c:
            with ThreadPoolExecutor(6) as pool:
                results = list(pool.map(lambda p: _stream(c, p, 6), prompts))
        for prompt, ids in zip(prompts, results):
            assert ids == alone(reference, prompt, 6)
        assert is_idle(wait_idle(srv), srv.host.n_seq_max)
        assert all(e.pins == 0 for e in srv.host.prefix_store.resident())
        m = srv.scheduler.metrics()
        # Whichever way the burst arrived, the head was prefilled once: a peer that came while
        # its leader computed it was held (the priority pass, on in `serve`, too), a later one
        # restored it.
        assert srv.scheduler.config.priority_preemption
        assert m.prefill_tokens < 2 * len(head)
    finally:
        srv.shutdown()
        off.shutdown()
