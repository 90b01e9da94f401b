"""A first-token deadline moves a request ahead in admission (docs/behaviour.md §3.3a), through
the real server and `openai` client: one lane, busy with a long request; three equal requests
reach the scheduler in one step (the engine thread is held between two steps while they
arrive), so they wait in one score band; the last one, which carries
`"skippy": {"ttft_ms": 50}`, takes the lane first once it frees, the others follow in arrival
order, and every answer is the prompt's alone run. The order is read from the plans the engine
runs (its `on_plan` hook), not from when the clients see their answers."""
from __future__ import annotations

import threading
import time

import openai
from serve_support import alone, is_idle, start_server, wait_idle

from skippy_scheduler.sampling import SamplingParams

PROMPTS = {"busy": [1, 60, 61], "a": [1, 70, 71, 72], "b": [1, 80, 81, 82], "c": [1, 90, 91, 92]}
TOKENS = {"busy": 200, "a": 4, "b": 4, "c": 4}


def _ask(url: str, name: str, extra: dict, answers: dict, lock) -> None:
    with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        out = c.completions.create(model="tiny-f32", prompt=PROMPTS[name],
                                   max_tokens=TOKENS[name], temperature=0,
                                   extra_body={"return_token_ids": True, "ignore_eos": True,
                                               **extra})
    with lock:
        answers[name] = (out.id, list(out.choices[0].model_extra["token_ids"]))


def _wait_for(predicate, timeout_s: float = 30.0) -> None:
    end = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < end, "the server did not take the request"
        time.sleep(0.01)


def _run(model_path, deadline_on: str | None) -> tuple[list[str], dict]:
    """The request names in the order they got the lane, and every answer's tokens."""
    server = start_server(model_path, max_active=1, ctx_size=512)
    gate, held = threading.Event(), threading.Event()
    admitted: list[str] = []  # engine sequence ids, in the order of their first plan row
    answers: dict = {}
    lock = threading.Lock()

    def on_plan(plan, *_times) -> None:
        for row in range(len(plan)):
            if plan.new_rows[row] and plan.sequence_ids[row] not in admitted:
                admitted.append(plan.sequence_ids[row])

    def hold() -> None:
        held.set()
        gate.wait(60)

    def start(name: str) -> threading.Thread:
        extra = {"skippy": {"ttft_ms": 50}} if name == deadline_on else {}
        t = threading.Thread(target=_ask, args=(server.url, name, extra, answers, lock))
        t.start()
        return t

    try:
        server.runner.call(lambda: setattr(server.runner.engine, "on_plan", on_plan))
        threads = [start("busy")]
        _wait_for(lambda: bool(server.runner.state()["scheduler_active"]))
        holder = threading.Thread(target=lambda: server.runner.call(hold, timeout_s=90))
        holder.start()
        assert held.wait(30)
        for name in ("a", "b", "c"):
            threads.append(start(name))
            _wait_for(lambda: server.runner.open_subscriptions == len(threads))  # in order
        gate.set()
        holder.join(90)
        for t in threads:
            t.join(90)
        assert is_idle(wait_idle(server), 1)
    finally:
        gate.set()
        server.shutdown()
    order = [name for sid in admitted for name, (rid, _) in answers.items()
             if sid.startswith(rid)]
    assert len(order) == len(PROMPTS)
    return order, {name: tokens for name, (_, tokens) in answers.items()}


def test_the_request_with_a_deadline_is_admitted_before_earlier_equal_ones(model_path,
                                                                          reference):
    order, answers = _run(model_path, "c")
    assert order == ["busy", "c", "a", "b"]
    for name, prompt in PROMPTS.items():
        assert answers[name] == alone(reference, prompt, TOKENS[name],
                                      SamplingParams(temperature=0.0, ignore_eos=True))


def test_without_a_deadline_they_are_admitted_in_arrival_order(model_path):
    order, _ = _run(model_path, None)
    assert order == ["busy", "a", "b", "c"]
