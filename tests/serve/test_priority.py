"""Priority in the server (docs/behaviour.md §2.8a, README "Serve"): preemption for priority is
on by default, so a high-priority request takes a lane from running low-priority streams and
finishes while they still run; the streams resume (from their kept KV with a prefix store) with
the tokens they get alone; `/metrics` splits preemptions by reason and observes TTFT per
priority. With `priority_preemption=False` the urgent request waits for a lane."""
from __future__ import annotations

import threading
import time

import httpx
import openai
from serve_support import alone, metrics, start_server, wait_idle, is_idle

from skippy_scheduler.cli import build_parser
from skippy_scheduler.sampling import SamplingParams

LOW_TOKENS = 480  # a lane holds 512 positions
LOW_PROMPTS = [[1, 40, 41, 42, 43, 44, 45], [1, 50, 51, 52, 53]]
HIGH_PROMPT = [1, 60, 61, 62]


def _stream_low(url: str, prompt: list[int], first: threading.Event, out: dict) -> None:
    """A low-priority stream: sets `first` at its first token, collects its token ids."""
    ids: list[int] = []
    with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        for chunk in c.completions.create(model="tiny-f32", prompt=prompt, max_tokens=LOW_TOKENS,
                                          temperature=0, stream=True,
                                          extra_body={"ignore_eos": True, "priority": 0,
                                                      "return_token_ids": True}):
            ids.extend(chunk.choices[0].model_extra.get("token_ids") or [])
            first.set()
    out["ids"] = ids
    out["done"] = True


def _scenario(server, reference):
    """Two lanes busy with low streams, then one high request; every output checked against
    its alone run. Returns, per stream, whether it was still running when the high one ended."""
    url = server.url
    # The urgent request's client is made first: making one takes long enough, on a busy
    # machine, for the streams to end meanwhile.
    urgent = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    outs = [{} for _ in LOW_PROMPTS]
    firsts = [threading.Event() for _ in LOW_PROMPTS]
    threads = [threading.Thread(target=_stream_low, args=(url, p, f, o))
               for p, f, o in zip(LOW_PROMPTS, firsts, outs)]
    for t in threads:
        t.start()
    for f in firsts:
        assert f.wait(60), "a low-priority stream produced no token"
    # The engine thread is held while the urgent request arrives, so that the streams cannot
    # end meanwhile on a machine that is slow to send it.
    gate, held = threading.Event(), threading.Event()

    def hold() -> None:
        held.set()
        gate.wait(60)

    holder = threading.Thread(target=lambda: server.runner.call(hold, timeout_s=90))
    holder.start()
    answer: dict = {}

    def ask() -> None:
        with urgent as c:
            answer["r"] = c.completions.create(
                model="tiny-f32", prompt=HIGH_PROMPT, max_tokens=4, temperature=0,
                extra_body={"priority": 7, "return_token_ids": True})

    asker = threading.Thread(target=ask)
    try:
        assert held.wait(30)
        asker.start()
        end = time.monotonic() + 30
        while server.runner.open_subscriptions < 3:
            assert time.monotonic() < end, "the server did not take the urgent request"
            time.sleep(0.01)
    finally:
        gate.set()
        holder.join(90)
    asker.join(120)
    r = answer["r"]
    running = [not o.get("done") for o in outs]
    for t in threads:
        t.join(120)
    greedy = SamplingParams(temperature=0.0, ignore_eos=True)
    for prompt, o in zip(LOW_PROMPTS, outs):
        assert o["ids"] == alone(reference, prompt, LOW_TOKENS, greedy)
    assert list(r.choices[0].model_extra["token_ids"]) == alone(reference, HIGH_PROMPT, 4)
    return running


def test_a_high_priority_request_preempts_running_streams_by_default(model_path, reference):
    server = start_server(model_path, max_active=2, ctx_size=2 * 512,
                          prefix_cache_tokens=2048, prefix_holders=4)
    try:
        assert server.scheduler.config.priority_preemption
        running = _scenario(server, reference)
        assert all(running)  # it did not wait for a lane
        m = metrics(server.url)
        assert m['skippy:num_preemptions_total{reason="priority"}'] >= 1
        assert m['skippy:num_preemptions_total{reason="memory"}'] == 0
        assert m['skippy:time_to_first_token_by_priority_seconds_count{priority="7"}'] == 1
        assert m['skippy:time_to_first_token_by_priority_seconds_count{priority="0"}'] == 2
        assert m["skippy:time_to_first_token_seconds_count"] == 3
        # The victims resumed from their kept KV: restores beyond the prompts' own.
        sm = server.runner.call(server.scheduler.metrics)
        assert sm.preempted_priority >= 1 and sm.restored_tokens > 0 and sm.recompute_tokens == 0
        assert is_idle(wait_idle(server), 2)
        # /metrics says where the work went: the same figures as the scheduler's and host's.
        m = metrics(server.url)  # published by the engine thread at its last step
        sm, hs = server.runner.call(
            lambda: (server.scheduler.metrics(), server.runner.host_state()))
        assert m["skippy:prefix_restored_tokens_total"] == sm.restored_tokens > 0
        assert m["skippy:recomputed_tokens_total"] == 0
        assert m["skippy:prefill_computed_tokens_total"] == sm.prefill_tokens > 0
        # Each victim's KV went into a holder and came back; every finished request's too.
        assert m["skippy:kv_copies_total"] == hs.kv_copies
        assert hs.kv_copies >= 2 * sm.preempted_priority + 3
    finally:
        server.shutdown()


def test_without_priority_preemption_the_request_waits_for_a_lane(model_path, reference):
    server = start_server(model_path, max_active=2, ctx_size=2 * 512, priority_preemption=False)
    try:
        _scenario(server, reference)
        m = metrics(server.url)
        assert m['skippy:num_preemptions_total{reason="priority"}'] == 0
        assert is_idle(wait_idle(server), 2)
    finally:
        server.shutdown()


def test_priority_labels_are_bounded(model_path):
    server = start_server(model_path, max_active=2, ctx_size=2 * 512)
    try:
        for p in range(18):
            body = {"model": "tiny-f32", "prompt": [1, 5], "max_tokens": 1, "priority": p}
            assert httpx.post(server.url + "/v1/completions", json=body,
                              timeout=60).status_code == 200
        m = metrics(server.url)
        labelled = [k for k in m if k.startswith(
            "skippy:time_to_first_token_by_priority_seconds_count")]
        assert len(labelled) == 17  # 16 priorities of their own, then "other"
        assert m['skippy:time_to_first_token_by_priority_seconds_count{priority="other"}'] == 2
    finally:
        server.shutdown()


def test_the_serve_flag_turns_preemption_off():
    parser = build_parser()
    assert parser.parse_args(["serve"]).priority_preemption is True
    assert parser.parse_args(["serve", "--no-priority-preemption"]).priority_preemption is False
