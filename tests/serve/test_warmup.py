"""The server warms the slack rule's cost model up before it listens (engine/warmup.py):
nothing of the warm-up is kept (no resident prefix, lane, KV cell or counted request) and the
tokens served after it are each prompt's alone tokens."""
from __future__ import annotations

import httpx
from serve_support import LANES, Spawned, alone, metrics, start_server, wait_idle

from skippy_scheduler.cost_model import StepCost


def test_the_server_starts_from_the_warmed_model_and_keeps_nothing_of_it(model_path, reference):
    server = start_server(model_path, cost_warmup=True)
    try:
        warm = server.warmup
        assert warm is not None and warm.prompts == LANES and warm.steps > 0
        fitter = server.runner.engine.cost_fitter
        assert fitter is warm.fitter and len(fitter) == min(warm.steps, 64)
        assert server.scheduler.step_cost == warm.cost != StepCost()
        assert server.context.slo.cost() == warm.cost  # shedding predicts from it at once
        store = server.host.prefix_store
        assert store is not None and store.entries == 0 and store.inserts == 0
        state = server.host.host_state(detail=True)
        assert not state.active and not state.lane_positions and state.kv_tokens == 0
        before = metrics(server.url)
        assert not any(v for k, v in before.items() if k.startswith("skippy:request_success"))
        prompt = list(range(5, 45))
        assert server.scheduler.metrics().iterations == 0  # the warm-up had its own
        r = httpx.post(server.url + "/v1/completions", timeout=60, json={
            "model": server.context.model_name, "prompt": prompt, "max_tokens": 8, "temperature": 0,
            "return_token_ids": True})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == alone(reference, prompt, 8)
        wait_idle(server)
        assert len(fitter) > min(warm.steps, 63)  # its own steps join the warm-up's
    finally:
        server.shutdown()


def test_by_default_the_server_starts_from_the_generic_model(model_path):
    server = start_server(model_path)
    try:
        assert server.warmup is None
        fitter = server.runner.engine.cost_fitter
        assert fitter is not None and len(fitter) == 0
        assert server.scheduler.step_cost == StepCost()
    finally:
        server.shutdown()


def test_the_command_line_warms_up_when_asked_and_says_what_it_took(tmp_path):
    srv = Spawned(tmp_path, "--cost-warmup")
    try:
        r = httpx.post(srv.url + "/v1/completions", timeout=60, json={
            "model": "tiny-random-llama", "prompt": "the cat", "max_tokens": 4})
        assert r.status_code == 200, r.text
    finally:
        assert srv.stop() == 0
    lines = srv.log().splitlines()
    assert lines[0].startswith("skippy-scheduler serve: tiny-random-llama on http")
    assert lines[1].startswith("skippy-scheduler serve: cost model warmed up: ")
    assert " steps of 8 prompts " in lines[1]
