"""The SLO the server is told (serve/slo.py, docs/serving.md "An SLO: goodput and shedding"),
through a real server on loopback and the `openai` client: the flags are taken or refused, each
request gets the server's budgets unless it gives its own, finished requests are counted in
`skippy:slo_met_total` / `skippy:slo_missed_total`, and `--slo-shed` answers 503 with
Retry-After to a request the cost model cannot serve, before the scheduler sees it. Budgets are
chosen far from any timing (a minute, or a microsecond), so no assertion depends on speed."""
from __future__ import annotations

import json
import math
import re
import threading
import time

import httpx
import openai
import pytest
from serve_support import Spawned, is_idle, metrics, start_server, wait_idle

from skippy_scheduler import cli
from skippy_scheduler.serve import Server, ServeSettings
from skippy_scheduler.slack import StepCost
from skippy_scheduler.serve.slo import GAP_PLAN_SHARE

LONG_MS = 600_000.0  # a budget nothing misses
TINY_MS = 0.001  # a budget nothing meets (1 µs)
PARTS = ("ttft", "itl", "both")


def _counts(url: str) -> dict[str, float]:
    m = metrics(url)
    out = {f"{kind}.{part}": m[f'skippy:slo_{kind}_total{{part="{part}"}}']
           for kind in ("met", "missed") for part in PARTS}
    out["shed"] = m["skippy:slo_shed_total"]
    return out


def _ask(client, extra=None, max_tokens=4, prompt=(1, 17, 33, 90, 5)):
    return client.completions.create(model="tiny-f32", prompt=list(prompt),
                                     max_tokens=max_tokens, temperature=0,
                                     extra_body={"ignore_eos": True, **(extra or {})})


def _capture_requests(server: Server) -> list:
    """The engine requests the app opens from now on."""
    seen: list = []
    runner = server.runner
    original = runner.open

    def open_(request, loop, inbox=None):
        seen.append(request)
        return original(request, loop, inbox)

    runner.open = open_  # type: ignore[method-assign]
    return seen


def _client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=60)


# -- flags ------------------------------------------------------------------------------------


@pytest.mark.parametrize("argv,message", [
    (["--slo-ttft-ms", "0"], "--slo-ttft-ms"),
    (["--slo-ttft-ms", "-5"], "expected a finite number of ms > 0"),
    (["--slo-itl-ms", "nan"], "--slo-itl-ms"),
    (["--slo-itl-ms", "inf"], "expected a finite number of ms > 0"),
    (["--slo-itl-ms", "fast"], "--slo-itl-ms"),
    (["--slo-shed", "--planning-rule", "reference"], "--slo-shed needs --planning-rule slack"),
])
def test_bad_slo_flags_are_one_line_errors(argv, message, capsys):
    assert cli.main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize("field,value", [
    ("slo_ttft_ms", 0), ("slo_itl_ms", -1.0), ("slo_ttft_ms", math.inf),
    ("slo_itl_ms", True), ("slo_ttft_ms", "5"),
])
def test_bad_slo_settings_are_refused_before_the_model_loads(field, value):
    with pytest.raises(ValueError, match=field):
        Server(ServeSettings(model="/nonexistent.gguf", **{field: value}))


def test_shedding_needs_the_slack_rule():
    with pytest.raises(ValueError, match="slo_shed needs the slack planning rule"):
        Server(ServeSettings(model="/nonexistent.gguf", slo_shed=True,
                             planning_rule="reference"))


def test_serve_takes_the_slo_flags_and_counts_a_request(tmp_path):
    served = Spawned(tmp_path, "--slo-ttft-ms", str(LONG_MS), "--slo-itl-ms", str(LONG_MS),
                     "--slo-shed")
    try:
        # The slack rule plans to 3/4 of the gap budget, and the line says so.
        assert ("slack rule at 450000 ms, SLO TTFT 600000 ms and gaps 600000 ms, shedding"
                in served.log())
        with openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0,
                           timeout=60) as c:
            out = c.chat.completions.create(model="tiny-random-llama", max_tokens=4,
                                            messages=[{"role": "user", "content": "Hi"}])
        assert out.choices[0].finish_reason in ("length", "stop")
        counts = _counts(served.url)
        assert counts["met.both"] == counts["met.ttft"] == counts["met.itl"] == 1
        assert counts["missed.both"] == counts["shed"] == 0
    finally:
        assert served.stop() == 0


# -- budgets and verdicts ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def slo_server(model_path):
    srv = start_server(model_path, slo_ttft_ms=LONG_MS, slo_itl_ms=LONG_MS)
    yield srv
    srv.shutdown()


def test_the_server_budgets_apply_unless_a_request_gives_its_own(slo_server):
    seen = _capture_requests(slo_server)
    before = _counts(slo_server.url)
    with _client(slo_server) as c:
        _ask(c)  # the server's budgets: met
        _ask(c, {"skippy": {"ttft_ms": TINY_MS}})  # its own TTFT budget: missed
        _ask(c, {"skippy": {"itl_ms": TINY_MS}})  # its own gap budget: missed
        _ask(c, {"skippy": {"itl_ms": TINY_MS}}, max_tokens=1)  # one token: no gap to miss
    # The engine gets each TTFT budget whole and 3/4 of each gap budget as its target.
    plan = GAP_PLAN_SHARE
    assert [(r.ttft_ms, r.itl_ms) for r in seen] == [
        (LONG_MS, LONG_MS * plan), (TINY_MS, LONG_MS * plan), (LONG_MS, TINY_MS * plan),
        (LONG_MS, TINY_MS * plan)]
    after = _counts(slo_server.url)
    delta = {k: after[k] - before[k] for k in after}
    assert delta == {"met.ttft": 3, "met.itl": 3, "met.both": 2,
                     "missed.ttft": 1, "missed.itl": 1, "missed.both": 2, "shed": 0}
    # The slack rule plans to 3/4 of the SLO's gap: the rest absorbs the cost model's error.
    assert slo_server.scheduler.config.itl_target == LONG_MS * GAP_PLAN_SHARE / 1e3
    assert is_idle(wait_idle(slo_server), slo_server.host.n_seq_max)


def test_each_choice_of_a_request_is_judged(slo_server):
    before = _counts(slo_server.url)
    with _client(slo_server) as c:
        out = c.completions.create(model="tiny-f32", prompt=[1, 5, 9], max_tokens=3, n=2,
                                   extra_body={"ignore_eos": True})
    assert len(out.choices) == 2
    after = _counts(slo_server.url)
    assert after["met.both"] - before["met.both"] == 2


def test_under_best_of_only_the_choices_returned_are_judged(slo_server):
    before = _counts(slo_server.url)
    with _client(slo_server) as c:
        out = c.completions.create(model="tiny-f32", prompt=[1, 6, 9], max_tokens=3, n=1,
                                   extra_body={"ignore_eos": True, "best_of": 3})
    assert len(out.choices) == 1
    after = _counts(slo_server.url)
    assert {k: after[k] - before[k] for k in after} == {
        "met.ttft": 1, "met.itl": 1, "met.both": 1, "missed.ttft": 0, "missed.itl": 0,
        "missed.both": 0, "shed": 0}


def test_streamed_requests_are_judged(slo_server):
    before = _counts(slo_server.url)
    with _client(slo_server) as c:
        chunks = list(c.completions.create(model="tiny-f32", prompt=[1, 8, 9], max_tokens=5,
                                           stream=True, extra_body={
                                               "ignore_eos": True,
                                               "skippy": {"ttft_ms": TINY_MS}}))
    assert chunks[-1].choices[0].finish_reason == "length"
    after = _counts(slo_server.url)
    assert after["missed.ttft"] - before["missed.ttft"] == 1
    assert after["met.itl"] - before["met.itl"] == 1


def test_the_first_token_budget_counts_from_when_the_server_received_the_request(slo_server):
    """A request whose body takes its time arrives when the server starts reading it: the
    time to read (and tokenize, and check) it is in its TTFT and against its budget, and the
    engine's deadline counts from there too."""
    seen = _capture_requests(slo_server)
    before = _counts(slo_server.url)
    ttft_before = metrics(slo_server.url)["skippy:time_to_first_token_seconds_sum"]
    budget_ms, pause_s = 300.0, 0.6
    body = json.dumps({"model": "tiny-f32", "prompt": [1, 17, 33], "max_tokens": 2,
                       "temperature": 0, "ignore_eos": True,
                       "skippy": {"ttft_ms": budget_ms}}).encode()

    resumed: list[float] = []

    def slowly():  # the body in two parts, the second after a pause
        yield body[:10]
        time.sleep(pause_s)
        resumed.append(slo_server.runner.now_us())
        yield body[10:]

    with httpx.Client(timeout=60) as client:
        t0 = slo_server.runner.now_us()
        r = client.post(slo_server.url + "/v1/completions", content=slowly(),
                        headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text
    (request,) = seen
    # Stamped before the pause: when the server started reading, not when the engine got it.
    assert t0 <= request.arrival_us < resumed[0]
    after = _counts(slo_server.url)
    assert after["missed.ttft"] - before["missed.ttft"] == 1
    ttft = metrics(slo_server.url)["skippy:time_to_first_token_seconds_sum"] - ttft_before
    assert ttft >= pause_s * 0.9
    assert is_idle(wait_idle(slo_server), slo_server.host.n_seq_max)


def test_without_the_flags_nothing_changes_and_only_own_budgets_count(server, client):
    seen = _capture_requests(server)
    before = _counts(server.url)
    _ask(client)  # no SLO: counted nowhere
    _ask(client, {"skippy": {"ttft_ms": LONG_MS}})  # its own TTFT budget only
    assert [(r.ttft_ms, r.itl_ms) for r in seen] == [(None, None), (LONG_MS, None)]
    after = _counts(server.url)
    delta = {k: after[k] - before[k] for k in after}
    assert delta == {"met.ttft": 1, "met.itl": 0, "met.both": 0, "missed.ttft": 0,
                     "missed.itl": 0, "missed.both": 0, "shed": 0}
    assert server.scheduler.config.itl_target == 0.15  # the 150 ms default
    assert not server.context.slo.shedding
    assert metrics(server.url)["skippy:slo_relegated_total"] == 0  # no deadline was missed


# -- shedding ---------------------------------------------------------------------------------


def _shed_server(model_path, **overrides):
    return start_server(model_path, max_active=2, ctx_size=1024, slo_shed=True, **overrides)


def test_a_burst_beyond_the_cost_model_is_shed_before_any_work(model_path):
    """Prefill forced to 10 ms a token and a TTFT budget of 1 s: two 40-token prompts fit
    (0.4 s, then 0.8 s of prefill ahead of a first token), the third would be 1.2 s. The
    engine thread is held while the burst arrives, so none reaches a first token early; the
    shedding clock is held too, as if the burst arrived at once (on a loaded machine the third
    request can be judged long enough after the second for the second's own deadline to be
    missed already, which admits the third in its place)."""
    server = _shed_server(model_path, slo_ttft_ms=1000.0)
    slo = server.context.slo
    slo.cost = lambda: StepCost(base_us=0.0, per_prefill_token_us=10_000.0)
    real_clock = slo.clock
    frozen = real_clock()
    slo.clock = lambda: frozen
    planned: set[str] = set()
    gate, held = threading.Event(), threading.Event()
    answers: dict[str, object] = {}

    def on_plan(plan, *_times) -> None:
        planned.update(plan.sequence_ids[row] for row in range(len(plan)))

    def hold() -> None:
        held.set()
        gate.wait(60)

    def ask(name: str) -> None:
        with _client(server) as c:
            answers[name] = _ask(c, prompt=[1] + [7 + i for i in range(39)], max_tokens=4)

    prompt = [1] + [7 + i for i in range(39)]
    try:
        server.runner.call(lambda: setattr(server.runner.engine, "on_plan", on_plan))
        holder = threading.Thread(target=lambda: server.runner.call(hold, timeout_s=90))
        holder.start()
        assert held.wait(30)
        threads = []
        for name in ("a", "b"):
            threads.append(threading.Thread(target=ask, args=(name,)))
            threads[-1].start()
            end = time.monotonic() + 30
            while server.runner.open_subscriptions < len(threads):
                assert time.monotonic() < end, "the server did not take the request"
                time.sleep(0.01)
        assert slo.waiting_prefill_tokens == 80
        r = httpx.post(server.url + "/v1/completions", timeout=30,
                       json={"prompt": prompt, "max_tokens": 4})
        assert r.status_code == 503, r.text
        assert int(r.headers["retry-after"]) >= 1
        error = r.json()["error"]
        assert error["code"] == "slo_unattainable" and error["type"] == "server_error"
        # Its own first token late: 1200 ms of prefill plus what it spent before it was judged.
        # Or, when it spent more of its budget before being judged than an admitted one did,
        # its deadline comes before that one's, and serving it first would make that one late.
        message = error["message"]
        own = re.search(r"first token in (\d+) ms \(120 prompt tokens", message)
        assert ((own and 1200 <= int(own.group(1)) < 2200)
                or "would make 1 admitted request miss its own" in message), message
        assert "budget of 1000 ms" in message
        with _client(server) as c:  # streamed: refused before any stream starts
            with pytest.raises(openai.InternalServerError) as info:
                c.completions.create(model="tiny-f32", prompt=prompt, max_tokens=4,
                                     stream=True)
        assert info.value.status_code == 503
        # Its own, larger budget is served.
        p = slo.predict(len(prompt), 60_000.0)
        assert p is not None and p.ttft_ms == 1200.0
        assert server.runner.open_subscriptions == 2  # nothing of the shed ones was opened
        assert slo.waiting_prefill_tokens == 80
        slo.clock = real_clock
        gate.set()
        holder.join(90)
        for t in threads:
            t.join(90)
        assert sorted(answers) == ["a", "b"]
        assert len(planned) == 2  # the scheduler only ever saw the two admitted requests
        m = metrics(server.url)
        assert m["skippy:slo_shed_total"] == 2
        assert m['skippy:request_errors_total{status="503"}'] == 2
        assert m['skippy:request_success_total{finished_reason="length"}'] == 2
        assert slo.waiting_prefill_tokens == 0
        assert is_idle(wait_idle(server), server.host.n_seq_max)
        with _client(server) as c:  # with the work gone, the same request is served
            out = _ask(c, prompt=prompt)
        assert out.choices[0].finish_reason == "length"
    finally:
        gate.set()
        server.shutdown()


def test_shedding_reads_a_request_s_own_budget_and_only_a_fitted_model(model_path):
    """Before the engine fits its cost model nothing is shed; then a request whose own budget
    the model predicts it misses is; one without a budget never is."""
    server = _shed_server(model_path)
    slo = server.context.slo
    try:
        assert slo.cost() is None  # the prior, not a fit
        with _client(server) as c:
            tiny = {"skippy": {"ttft_ms": TINY_MS}}
            _ask(c, tiny, max_tokens=24)  # admitted: no fitted model yet
            end = time.monotonic() + 30
            while slo.cost() is None:  # refit every 8 steps
                assert time.monotonic() < end, "the engine did not fit its cost model"
                _ask(c, max_tokens=8)
            prompt = [1] + list(range(20, 120))
            p = slo.predict(len(prompt), TINY_MS)
            assert p is not None
            if p.ttft_ms > TINY_MS:
                with pytest.raises(openai.InternalServerError) as info:
                    _ask(c, tiny, prompt=prompt)
                assert info.value.status_code == 503
            _ask(c, prompt=prompt)  # no budget: never shed
        assert slo.waiting_prefill_tokens == 0
        assert is_idle(wait_idle(server), server.host.n_seq_max)
    finally:
        server.shutdown()


def test_shedding_counts_only_what_is_left_of_a_prompt_being_prefilled(model_path):
    """A 90-token prompt prefilled 32 tokens a step: once its first chunk has run, the engine
    reports it, and a new request's prediction counts the 58 tokens left of it, not 90; at its
    end nothing is left of it in the report.
    (Budgets of 5 and 6 s: the held prompt's deadline, before the new one's, stays one the
    scheduler keeps however slowly the test runs.)"""
    server = _shed_server(model_path, prefill_chunk=32, batch_size=32)
    slo = server.context.slo
    slo.cost = lambda: StepCost(base_us=0.0, per_prefill_token_us=10_000.0)
    progress = server.runner.prefill_progress
    assert progress is not None and slo.prefilled is progress.done
    gate, held = threading.Event(), threading.Event()
    prompt = [1] + [7 + i for i in range(89)]
    seen: list[str] = []

    def on_plan(plan, *_times) -> None:
        starts = [int(plan.positions[int(plan.row_offsets[r])]) for r in range(len(plan))]
        if not held.is_set() and any(s > 0 for s in starts):  # its second chunk: hold
            seen.extend(plan.sequence_ids)
            held.set()
            gate.wait(60)

    answer: dict[str, object] = {}

    def ask() -> None:
        with _client(server) as c:  # 900 ms of prefill at 10 ms a token: within 5 s
            answer["a"] = _ask(c, {"skippy": {"ttft_ms": 5000.0}}, prompt=prompt)

    try:
        server.runner.call(lambda: setattr(server.runner.engine, "on_plan", on_plan))
        thread = threading.Thread(target=ask)
        thread.start()
        assert held.wait(30), "the prompt's second chunk was not planned"
        rid = seen[0]
        done = progress.done.get(rid)  # its first chunk (the hook runs before the report)
        assert done == 32, progress.done
        p = slo.predict(40, 6000.0)  # behind it: what is left of it, then its own 40
        assert p is not None and p.met and p.tokens == 40 + 90 - done
        gate.set()
        thread.join(60)
        assert answer["a"].choices[0].finish_reason == "length"  # type: ignore[attr-defined]
        assert progress.done == {} and slo.waiting_prefill_tokens == 0
        assert is_idle(wait_idle(server), server.host.n_seq_max)
    finally:
        gate.set()
        server.shutdown()


@pytest.mark.parametrize("inflight", [1, 2])
def test_a_prompt_that_ends_before_its_first_token_leaves_no_progress_behind(model_path,
                                                                            inflight):
    """A request cancelled mid-prefill while the engine is held between two of its chunks
    (with two plans in flight the next chunk is already made, and runs after the cancel): its
    entry in the prefill report goes with it, and no later chunk writes it back."""
    server = _shed_server(model_path, prefill_chunk=16, batch_size=16, inflight=inflight)
    progress = server.runner.prefill_progress
    assert progress is not None
    gate, held = threading.Event(), threading.Event()
    seen: list[str] = []

    def on_plan(plan, *_times) -> None:
        starts = [int(plan.positions[int(plan.row_offsets[r])]) for r in range(len(plan))]
        if not held.is_set() and any(s > 0 for s in starts):
            seen.extend(plan.sequence_ids)
            held.set()
            gate.wait(60)

    try:
        server.runner.call(lambda: setattr(server.runner.engine, "on_plan", on_plan))
        with httpx.Client(timeout=30) as c:
            with c.stream("POST", server.url + "/v1/completions",
                          json={"prompt": [1] + list(range(10, 200)), "max_tokens": 8,
                                "stream": True}) as r:
                assert r.status_code == 200
                assert held.wait(30)
                assert list(progress.done) == seen and progress.done[seen[0]] > 0
                server.runner.cancel(seen[0])
                gate.set()
                r.read()  # the answer ends
        assert is_idle(wait_idle(server), server.host.n_seq_max)
        assert progress.done == {}
    finally:
        gate.set()
        server.shutdown()
