"""`serve -bs/--backend-sampling`: the server's host samples on the device (llama.cpp's backend
samplers, on its CPU backend here) when told, and a greedy answer through the OpenAI API is
the same as the host path's, token for token."""
from __future__ import annotations

import openai
import pytest

pytest.importorskip("llama_cpp")
pytest.importorskip("fastapi")

from serve_support import start_server  # noqa: E402

PROMPTS = ("The quick brown fox", "Once upon a time", "1 2 3 4")


def _greedy(server) -> list[list[int]]:
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                       timeout=60) as c:
        out = c.completions.create(model=c.models.list().data[0].id, prompt=list(PROMPTS),
                                   max_tokens=8, temperature=0,
                                   extra_body={"return_token_ids": True, "ignore_eos": True})
    return [list(choice.model_extra["token_ids"])
            for choice in sorted(out.choices, key=lambda c: c.index)]


def test_serve_samples_on_the_device_when_told_with_the_same_greedy_tokens(model_path):
    answers = {}
    for mode in ("off", "on"):
        server = start_server(model_path, backend_sampling=mode)
        try:
            assert server.host.settings["backend_sampling"] is (mode == "on")
            answers[mode] = _greedy(server)
        finally:
            server.shutdown()
    assert answers["on"] == answers["off"]
    assert all(len(ids) == 8 for ids in answers["on"])


def test_the_gpu_defaults_give_the_tokens_of_depth_one_host_sampling(model_path):
    """With layers on a GPU the server samples on the device and keeps two plans in flight;
    the same pair on llama.cpp's CPU backend answers greedy requests with the tokens of one
    plan in flight sampled on the host."""
    answers = {}
    for depth, mode in ((1, "off"), (2, "on")):
        server = start_server(model_path, backend_sampling=mode, inflight=depth)
        try:
            assert server.scheduler.config.max_inflight_plans == depth
            answers[depth] = _greedy(server)
        finally:
            server.shutdown()
    assert answers[2] == answers[1]


def test_serve_refuses_a_bad_backend_sampling_value(model_path):
    with pytest.raises(ValueError, match="backend_sampling"):
        start_server(model_path, backend_sampling="maybe")
