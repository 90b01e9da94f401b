"""What a client written for llama-server sends and reads: `seed: -1` (a random seed), the
penalty window `repeat_last_n`, its samplers in their off values (and a 400 when on),
`n_predict: -1`, `/tokenize` with `content`, `/detokenize`'s `content`, and `/props`."""
from __future__ import annotations

import httpx
import pytest

from serve_support import LANE_CTX, LANES  # noqa: F401  (tests/support)

from skippy_scheduler._validate import I32_MAX
from skippy_scheduler.sampling import SamplingParams


def _post(server, path, body, status=200):
    r = httpx.post(server.url + path, json=body, timeout=60)
    assert r.status_code == status, (path, body, r.text)
    return r.json()


def _text(server, **body):
    body = {"prompt": "once upon a time", "max_tokens": 8, **body}
    return _post(server, "/v1/completions", body)["choices"][0]["text"]


def test_seed_minus_one_is_a_random_seed(server):
    """llama-server reads -1 as "no seed": four requests differ, where a fixed seed (the same
    bits as an unsigned number) repeats."""
    fixed = {_text(server, temperature=1.0, seed=(1 << 64) - 1) for _ in range(2)}
    assert len(fixed) == 1
    drawn = {_text(server, temperature=1.0, seed=-1) for _ in range(4)}
    assert len(drawn) > 1, drawn


def test_the_penalty_window(server):
    """repeat_last_n (or penalty_last_n) is the penalties' window: 0 turns them off, -1 is the
    whole context, 64 is the default."""
    greedy = dict(temperature=0, max_tokens=24)
    plain = _text(server, **greedy)
    penalized = _text(server, repetition_penalty=1.8, **greedy)
    assert _text(server, repetition_penalty=1.8, repeat_last_n=0, **greedy) == plain
    assert _text(server, repetition_penalty=1.8, repeat_last_n=64, **greedy) == penalized
    assert _text(server, repetition_penalty=1.8, penalty_last_n=64, **greedy) == penalized
    # The whole context, and a window past it (cut to the context, not allocated).
    for window in (-1, I32_MAX):
        assert _text(server, repetition_penalty=1.8, repeat_last_n=window, **greedy) == \
            penalized
    err = _post(server, "/v1/completions", {"prompt": "x", "repeat_last_n": -2}, 400)
    assert err["error"]["param"] == "repeat_last_n"


def test_a_window_longer_than_the_context_is_cut_to_it(reference):
    params = SamplingParams(repetition_penalty=1.5, penalty_last_n=I32_MAX)
    assert reference._samplers.resolve(params).penalty_last_n == reference.n_ctx


def test_llama_server_samplers_are_accepted_off_and_refused_on(server):
    off = dict(dry_multiplier=0.0, dry_base=1.75, dry_allowed_length=2, dry_penalty_last_n=-1,
               dry_sequence_breakers=["\n"], xtc_probability=0, xtc_threshold=0.1,
               top_n_sigma=-1, dynatemp_exponent=1)
    assert _text(server, temperature=0, **off) == _text(server, temperature=0)
    for name, value in (("dry_multiplier", 0.8), ("xtc_probability", 0.5),
                        ("top_n_sigma", 1.0)):
        err = _post(server, "/v1/completions", {"prompt": "x", name: value}, 400)
        assert err["error"]["param"] == name, err


def test_n_predict_minus_one_runs_to_the_end_of_the_lane(server):
    """llama-server's "until the context ends": the lane's cells, not the 16-token default."""
    got = _post(server, "/v1/completions", {"prompt": "abc", "n_predict": -1,
                                           "ignore_eos": True, "temperature": 0})
    usage = got["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == \
        server.context.n_ctx_seq, usage
    assert got["choices"][0]["finish_reason"] == "length"
    # With max_tokens beside it, they must agree as any alias must; the other aliases are
    # read as ever.
    _post(server, "/v1/completions", {"prompt": "abc", "n_predict": -1, "max_tokens": 4}, 400)
    err = _post(server, "/v1/completions", {"prompt": "abc", "n_predict": -1,
                                           "repeat_penalty": 1.2, "repetition_penalty": 1.5},
                400)
    assert err["error"]["param"] == "repeat_penalty"


def test_tokenize_with_content_answers_as_llama_server(server):
    text = "héllo wörld"
    vllm = _post(server, "/tokenize", {"prompt": text, "add_special_tokens": False})["tokens"]
    plain = _post(server, "/tokenize", {"content": text})
    assert plain == {"tokens": vllm}  # no BOS unless add_special
    with_bos = _post(server, "/tokenize", {"content": text, "add_special": True})["tokens"]
    assert with_bos == _post(server, "/tokenize", {"prompt": text})["tokens"]
    pieces = _post(server, "/tokenize", {"content": text, "with_pieces": True})["tokens"]
    assert [p["id"] for p in pieces] == vllm
    joined = b"".join(p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"])
                      for p in pieces)
    assert joined.decode("utf-8").endswith(text)
    back = _post(server, "/detokenize", {"tokens": vllm})
    assert back["content"] == back["prompt"] and back["content"].endswith(text)
    err = _post(server, "/tokenize", {"content": text, "with_pieces": "yes"}, 400)
    assert err["error"]["param"] == "with_pieces"


def test_props(server):
    props = httpx.get(server.url + "/props", timeout=10).json()
    assert props["total_slots"] == server.settings.max_active
    assert props["default_generation_settings"]["n_ctx"] == server.context.n_ctx_seq
    assert props["model_path"] == server.context.model_name
    chat = server.context.chat
    assert props["chat_template"] == (chat.text if chat.source == "model" else "chatml")
    assert props["modalities"] == {"vision": False, "audio": False}


@pytest.mark.parametrize("field", ["seed", "repeat_last_n"])
def test_bad_values_name_the_field(server, field):
    err = _post(server, "/v1/completions", {"prompt": "x", field: "1"}, 400)
    assert err["error"]["param"] == field
