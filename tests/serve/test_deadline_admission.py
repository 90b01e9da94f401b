"""A first-token deadline moves a request ahead in admission (docs/behaviour.md §3.3a), through
the real server and `openai` client: with one lane, three equal requests reach the scheduler in
one step (the engine thread is held between two steps while they arrive); the last one, which
carries `"skippy": {"ttft_ms": 50}`, is admitted and answered first, the others in arrival
order, and every answer is the prompt's alone run."""
from __future__ import annotations

import threading
import time

import openai
from serve_support import alone, is_idle, start_server, wait_idle

PROMPTS = {"a": [1, 70, 71, 72], "b": [1, 80, 81, 82], "c": [1, 90, 91, 92]}
TOKENS = 4


def _ask(url: str, name: str, extra: dict, done: list, answers: dict, lock) -> None:
    with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        out = c.completions.create(model="tiny-f32", prompt=PROMPTS[name], max_tokens=TOKENS,
                                   temperature=0,
                                   extra_body={"return_token_ids": True, **extra})
    with lock:
        done.append(name)
        answers[name] = list(out.choices[0].model_extra["token_ids"])


def _wait_for(predicate, timeout_s: float = 30.0) -> None:
    end = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < end, "the server did not take the request"
        time.sleep(0.01)


def _run(model_path, deadline_on: str | None) -> tuple[list[str], dict]:
    server = start_server(model_path, max_active=1, ctx_size=512)
    gate, held = threading.Event(), threading.Event()
    done: list[str] = []
    answers: dict = {}
    lock = threading.Lock()

    def hold() -> None:
        held.set()
        gate.wait(60)

    try:
        holder = threading.Thread(target=lambda: server.runner.call(hold, timeout_s=90))
        holder.start()
        assert held.wait(30)
        threads = []
        for k, name in enumerate(PROMPTS):
            extra = {"skippy": {"ttft_ms": 50}} if name == deadline_on else {}
            t = threading.Thread(target=_ask, args=(server.url, name, extra, done, answers, lock))
            t.start()
            threads.append(t)
            _wait_for(lambda: server.runner.open_subscriptions == k + 1)  # arrival order
        gate.set()
        holder.join(90)
        for t in threads:
            t.join(90)
        assert is_idle(wait_idle(server), 1)
        return done, answers
    finally:
        gate.set()
        server.shutdown()


def test_the_request_with_a_deadline_is_admitted_before_earlier_equal_ones(model_path,
                                                                          reference):
    done, answers = _run(model_path, "c")
    assert done == ["c", "a", "b"]
    for name, prompt in PROMPTS.items():
        assert answers[name] == alone(reference, prompt, TOKENS)


def test_without_a_deadline_they_are_admitted_in_arrival_order(model_path):
    done, _ = _run(model_path, None)
    assert done == ["a", "b", "c"]
