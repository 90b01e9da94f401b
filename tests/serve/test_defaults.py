"""The server's defaults (README "Serve", docs/serving.md "Defaults"): with no tuning
settings it runs the slack rule at a 150 ms inter-token target and keeps finished prompts as
reusable prefixes, sized from the KV cache; `prefix_cache_tokens=0` and
`planning_rule="reference"` turn them off; bad planning settings are refused before the model
loads. On the real tiny model, through the real HTTP server."""
from __future__ import annotations

import math

import httpx
import pytest
from serve_support import LANE_CTX, LANES, ON_DEVICE, metrics, start_server, wait_idle

from skippy_scheduler import PlanningRule
from skippy_scheduler.serve import ServeSettings
from skippy_scheduler.serve.server import (Server, default_reuse, plans_in_flight,
                                           resolve_settings)


def test_reuse_is_sized_from_the_kv_cache():
    assert default_reuse(8, 4096) == (8 * 512, 8)  # a holder per lane, a lane's tokens each
    assert default_reuse(16, 16384) == (16 * 1024, 16)
    assert default_reuse(250, 250 * 64) == (6 * 64, 6)  # the sequence ids llama.cpp leaves
    assert default_reuse(256, 4096) == (0, 1)  # none left: no reuse


def test_resolved_settings_keep_what_was_given():
    s = resolve_settings(ServeSettings(max_active=4, ctx_size=2048))
    assert (s.prefix_cache_tokens, s.prefix_holders) == (2048, 4)
    assert (s.planning_rule, s.itl_target_ms) == ("slack", 150.0)
    assert s.prefill_age_max_ms == 2000.0
    assert resolve_settings(ServeSettings(prefill_age_max_ms=0)).prefill_age_max_ms == 0
    s = resolve_settings(ServeSettings(max_active=4, ctx_size=2048, prefix_cache_tokens=0))
    assert s.prefix_cache_tokens == 0
    for stages in (dict(stages="dir"), dict(stage_addresses=("tcp://127.0.0.1:1",))):
        s = resolve_settings(ServeSettings(max_active=4, ctx_size=2048, **stages))
        assert (s.prefix_cache_tokens, s.prefix_holders) == (2048, 4)  # the same on stages
        s = resolve_settings(ServeSettings(max_active=4, ctx_size=2048, prefix_cache_tokens=0,
                                           **stages))
        assert s.prefix_cache_tokens == 0
    s = resolve_settings(ServeSettings(max_active=4, ctx_size=2048, prefix_cache_tokens=300,
                                       prefix_holders=2))
    assert (s.prefix_cache_tokens, s.prefix_holders) == (300, 2)


@pytest.mark.parametrize("bad", [dict(planning_rule="fast"), dict(itl_target_ms=0),
                                 dict(itl_target_ms=-5.0), dict(itl_target_ms=math.nan),
                                 dict(itl_target_ms=True), dict(prefill_age_max_ms=-1.0),
                                 dict(prefill_age_max_ms=math.inf),
                                 dict(prefill_age_max_ms=math.nan),
                                 dict(prefill_age_max_ms="2000"), dict(inflight=0),
                                 dict(inflight=True), dict(inflight=1.5),
                                 dict(stage_ahead="sometimes"), dict(stage_ahead=True)])
def test_bad_planning_settings_are_refused_before_loading(bad):
    with pytest.raises(ValueError,
                       match="planning_rule|itl_target_ms|prefill_age_max_ms|inflight|"
                             "stage_ahead"):
        Server(ServeSettings(model="/nonexistent.gguf", **bad))


def test_plans_in_flight_default_to_two_with_layers_on_a_gpu():
    assert plans_in_flight(None, on_gpu=True) == 2
    assert plans_in_flight(None, on_gpu=False) == 1
    assert plans_in_flight(1, on_gpu=True) == 1  # what was given stays
    assert plans_in_flight(3, on_gpu=False) == 3


def _hits(url: str) -> float:
    """Prompt tokens found in the prefix cache (vLLM's counter, whatever its labels)."""
    return sum(v for k, v in metrics(url).items() if k.startswith("vllm:prefix_cache_hits_total"))


def _complete(url: str, prompt: list[int], **extra) -> dict:
    r = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 4,
                                                  "temperature": 0, "ignore_eos": True,
                                                  **extra}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


PROMPT = [1] + [(7 * i) % 300 + 5 for i in range(200)]


def test_defaults_reuse_prefixes_under_the_slack_rule(model_path):
    server = start_server(model_path)
    try:
        config = server.scheduler.config
        assert config.planning_rule is PlanningRule.SLACK
        assert config.itl_target == pytest.approx(0.15)
        assert config.slack_prefill_age_max == 2.0  # shortest first (docs/serving.md)
        # No layer on a GPU (this llama.cpp runs on the CPU): one plan in flight; two with the
        # layers on a device (SKIPPY_SERVE_DEVICE, tests/support/serve_support.py).
        depth = 2 if ON_DEVICE else 1
        assert server.settings.inflight == depth and config.max_inflight_plans == depth
        # Admission reserves in the memory of the device that holds the KV cells.
        kv = config.memory_components
        assert [c.name for c in kv] == ["kv-RPC0" if ON_DEVICE else "kv-CPU"]
        assert kv[0].capacity_bytes == server.fitted.placement.kv[kv[0].name[3:]]
        assert server.host.prefix_store is not None
        assert server.settings.prefix_holders == LANES
        assert server.settings.prefix_cache_tokens == LANES * LANE_CTX
        first = _complete(server.url, PROMPT)
        wait_idle(server)
        again = _complete(server.url, PROMPT, skippy={"itl_ms": 20})  # its own target too
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
        assert _hits(server.url) >= len(PROMPT) - 16
        # The engine times the steps and refits the rule's cost model (every 8 steps).
        prior = server.runner.call(lambda: server.scheduler.step_cost)
        _complete(server.url, [1, 9, 8, 7], max_tokens=24)
        wait_idle(server)
        assert server.runner.call(lambda: server.scheduler.step_cost) != prior
    finally:
        server.shutdown()


def test_reuse_and_the_slack_rule_turn_off(model_path):
    server = start_server(model_path, prefix_cache_tokens=0, planning_rule="reference")
    try:
        assert server.scheduler.config.planning_rule is PlanningRule.REFERENCE
        assert server.host.prefix_store is None
        first = _complete(server.url, PROMPT)
        wait_idle(server)
        assert _complete(server.url, PROMPT)["choices"][0]["text"] == first["choices"][0]["text"]
        assert _hits(server.url) == 0
        assert any(k.startswith("vllm:prefix_cache_hits_total") for k in metrics(server.url))
    finally:
        server.shutdown()
