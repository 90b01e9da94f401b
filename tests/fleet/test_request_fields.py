"""Bodies routers and other servers' clients send: their fields are honoured, accepted in
their neutral value, ignored, or refused with a 400 naming them (a real server, real HTTP)."""
from __future__ import annotations

import logging

import httpx
import pytest

GREEDY = {"temperature": 0}
# What vllm-router adds to every body it forwards (seen on the wire from vllm-router 0.1.17).
ROUTER_FIELDS = {"echo": False, "no_stop_trim": False, "ignore_eos": False,
                 "skip_special_tokens": True, "return_hidden_states": False, "stream": False}


def _post(url, path, body):
    return httpx.post(url + path, json=body, timeout=60)


def _complete(url, **body):
    r = _post(url, "/v1/completions", dict(body, **GREEDY))
    assert r.status_code == 200, r.text
    return r.json()


def test_a_body_forwarded_by_vllm_router_runs_as_the_plain_one(replica):
    server, _ = replica
    plain = _complete(server.url, prompt="the router says", max_tokens=6)
    routed = _complete(server.url, prompt="the router says", max_tokens=6, **ROUTER_FIELDS)
    assert routed["choices"][0]["text"] == plain["choices"][0]["text"]
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **GREEDY}
    a = _post(server.url, "/v1/chat/completions", chat)
    b = _post(server.url, "/v1/chat/completions", dict(chat, **ROUTER_FIELDS))
    assert a.status_code == b.status_code == 200, b.text
    assert a.json()["choices"][0]["message"] == b.json()["choices"][0]["message"]


def test_an_unknown_field_is_ignored_with_a_warning_and_refused_by_a_strict_server(
        replica, strict_server, caplog):
    server, _ = replica
    with caplog.at_level(logging.WARNING, logger="skippy_scheduler.serve"):
        out = _complete(server.url, prompt="x", max_tokens=2, frobnicate=1, cache_prompt=True)
    assert out["usage"]["completion_tokens"] >= 1
    assert any("frobnicate" in r.getMessage() for r in caplog.records)
    assert not any("cache_prompt" in r.getMessage() for r in caplog.records)
    r = _post(strict_server.url, "/v1/completions", {"prompt": "x", "frobnicate": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "frobnicate"
    # Fields other servers define are known to a strict server too.
    ok = _post(strict_server.url, "/v1/completions", dict(prompt="x", max_tokens=2,
                                                          **ROUTER_FIELDS))
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("path, extra, param", [
    ("/v1/completions", {"best_of": 2, "stream": True}, "best_of"),
    ("/v1/completions", {"echo": "yes"}, "echo"),
    ("/v1/chat/completions", {"echo": True}, "echo"),
    ("/v1/completions", {"no_stop_trim": True}, "no_stop_trim"),
    ("/v1/completions", {"return_hidden_states": True}, "return_hidden_states"),
    ("/v1/completions", {"skip_special_tokens": False}, "skip_special_tokens"),
    ("/v1/chat/completions", {"add_generation_prompt": False}, "add_generation_prompt"),
    ("/v1/chat/completions", {"chat_template_kwargs": {"enable_thinking": True}},
     "chat_template_kwargs"),
    ("/v1/completions", {"guided_json": {"type": "object"}}, "guided_json"),
    ("/v1/chat/completions", {"response_format": {"type": "grammar"}}, "response_format.type"),
    ("/v1/completions", {"n_predict": 3, "max_tokens": 4}, "n_predict"),
    ("/v1/completions", {"stop_token_ids": [-1]}, "stop_token_ids"),
    ("/v1/completions", {"include_stop_str_in_output": "yes"}, "include_stop_str_in_output"),
])
def test_a_value_this_server_cannot_honour_is_a_400_naming_the_field(replica, path, extra,
                                                                      param):
    server, _ = replica
    body = ({"prompt": "x"} if path == "/v1/completions"
            else {"messages": [{"role": "user", "content": "x"}]})
    r = _post(server.url, path, dict(body, **extra))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_fields_not_acted_on_are_ignored_with_a_warning_unless_at_their_default(
        replica, caplog):
    server, _ = replica
    with caplog.at_level(logging.WARNING, logger="skippy_scheduler.serve"):
        _complete(server.url, prompt="x", max_tokens=2, cache_prompt=True, id_slot=-1,
                  request_id="abc")
        assert not caplog.records
        _complete(server.url, prompt="x", max_tokens=2, cache_prompt=False,
                  cache_salt="tenant-1")
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert "cache_prompt" in warned and "cache_salt" in warned


def test_llama_server_names_are_aliases(replica):
    server, _ = replica
    a = _complete(server.url, prompt="alias", n_predict=5, ignore_eos=True)
    assert a["usage"]["completion_tokens"] == 5
    b = _complete(server.url, prompt="alias", max_tokens=5, ignore_eos=True)
    assert a["choices"][0]["text"] == b["choices"][0]["text"]
    c = _complete(server.url, prompt="alias", max_tokens=5, repeat_penalty=1.3, seed=1,
                  ignore_eos=True)
    d = _complete(server.url, prompt="alias", max_tokens=5, repetition_penalty=1.3, seed=1,
                  ignore_eos=True)
    assert c["choices"][0]["text"] == d["choices"][0]["text"]


def test_stop_token_ids_end_the_generation_after_that_token(replica):
    server, _ = replica
    full = _complete(server.url, prompt="stop here", max_tokens=12, ignore_eos=True,
                     return_token_ids=True)
    ids = full["choices"][0]["token_ids"]
    stop = ids[3]
    cut = ids.index(stop)
    out = _complete(server.url, prompt="stop here", max_tokens=12, ignore_eos=True,
                    return_token_ids=True, stop_token_ids=[stop])
    choice = out["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["token_ids"] == ids[:cut + 1]
    pieces = [httpx.post(server.url + "/detokenize", json={"tokens": ids[:n]},
                         timeout=10).json()["prompt"] for n in (cut, cut + 1)]
    assert choice["text"] == pieces[0]
    kept = _complete(server.url, prompt="stop here", max_tokens=12, ignore_eos=True,
                     stop_token_ids=[stop], include_stop_str_in_output=True)
    assert kept["choices"][0]["text"] == pieces[1]


def test_include_stop_str_in_output_keeps_the_matched_stop_string(replica):
    server, _ = replica
    text = _complete(server.url, prompt="a stop string", max_tokens=16,
                     ignore_eos=True)["choices"][0]["text"]
    # A two-character stop string first found after the start (the tiny model's text is
    # mostly replacement characters, which are left out).
    cut, stop = next((i, text[i:i + 2]) for i in range(1, len(text) - 1)
                     if "\ufffd" not in text[i:i + 2] and text.index(text[i:i + 2]) == i)
    dropped = _complete(server.url, prompt="a stop string", max_tokens=16, ignore_eos=True,
                        stop=[stop])["choices"][0]
    kept = _complete(server.url, prompt="a stop string", max_tokens=16, ignore_eos=True,
                     stop=[stop], include_stop_str_in_output=True)["choices"][0]
    assert dropped["text"] == text[:cut] and dropped["finish_reason"] == "stop"
    assert kept["text"] == text[:cut] + stop and kept["finish_reason"] == "stop"
