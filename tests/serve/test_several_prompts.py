"""Several prompts in one completions request: one choice per prompt, in order, streamed and
not, each equal to its prompt run alone; usage summed."""
from __future__ import annotations

import httpx
import openai
import pytest
from serve_support import alone, is_idle, text_of, wait_idle

MODEL = "tiny-f32"
PROMPTS = ["the cat sat on the mat", "a b c", "once upon a time there was"]


def _expected(reference, prompts, max_tokens):
    out = []
    for p in prompts:
        ids = reference.tokenize(p, special=True) if isinstance(p, str) else p
        out.append((ids, alone(reference, ids, max_tokens)))
    return out


@pytest.mark.parametrize("prompts", [PROMPTS, [[1, 17, 40, 9], [1, 5], [1, 300, 2, 77, 8]]],
                         ids=["strings", "token-lists"])
def test_one_choice_per_prompt_in_order(client, reference, server, prompts):
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=10, temperature=0,
                                  extra_body={"return_token_ids": True})
    expected = _expected(reference, prompts, 10)
    assert [c.index for c in r.choices] == list(range(len(prompts)))
    for choice, (ids, tokens) in zip(r.choices, expected):
        assert list(choice.model_extra["token_ids"]) == tokens
        assert list(choice.model_extra["prompt_token_ids"]) == ids
        assert choice.text == text_of(reference, tokens)
    assert r.usage.prompt_tokens == sum(len(ids) for ids, _ in expected)
    assert r.usage.completion_tokens == sum(len(t) for _, t in expected)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert is_idle(wait_idle(server), server.host.n_seq_max)


def test_streamed_choices_interleave_and_each_equals_its_prompt_alone(client, reference):
    stream = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=10,
                                       temperature=0, stream=True,
                                       stream_options={"include_usage": True},
                                       extra_body={"return_token_ids": True})
    ids: dict[int, list[int]] = {i: [] for i in range(len(PROMPTS))}
    text: dict[int, str] = {i: "" for i in range(len(PROMPTS))}
    finish: dict[int, str] = {}
    prompt_ids: dict[int, list] = {}
    usage = None
    for chunk in stream:
        if not chunk.choices:
            usage = chunk.usage
            continue
        assert "prompt_token_ids" not in chunk.model_extra
        for c in chunk.choices:
            if c.index not in prompt_ids:  # a choice's first chunk has its prompt (as vLLM)
                prompt_ids[c.index] = c.model_extra["prompt_token_ids"]
            else:
                assert "prompt_token_ids" not in c.model_extra
            ids[c.index] += list(c.model_extra["token_ids"])
            text[c.index] += c.text
            if c.finish_reason:
                assert c.index not in finish
                finish[c.index] = c.finish_reason
    expected = _expected(reference, PROMPTS, 10)
    for i, (prompt, tokens) in enumerate(expected):
        assert prompt_ids[i] == prompt
        assert ids[i] == tokens and text[i] == text_of(reference, tokens)
        assert finish[i] == ("length" if len(tokens) == 10 else "stop")
    assert usage is not None
    assert usage.completion_tokens == sum(len(t) for _, t in expected)
    assert usage.prompt_tokens == sum(len(p) for p, _ in expected)


@pytest.mark.parametrize("prompt,what", [
    (["fine", []], "'prompt[1]' as token ids must hold at least one id"),
    ([[1, 2], [1, "x"]], "'prompt[1][1]' must be a token id"),
    (["fine", [1, 10 ** 9]], "'prompt[1][1]' = 1000000000 is not a token id"),
    ([[1, 2], [-1, 4]], "'prompt[1][0]' = -1 is not a token id"),
    ([3, -1], "'prompt[1]' = -1 is not a token id"),
    (["x"] * 65, "at most 64 prompts"),
])
def test_a_bad_prompt_among_several_is_a_400_before_any_runs(client, server, prompt, what):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=4)
    assert info.value.body["param"] == "prompt" and what in info.value.body["message"]
    assert is_idle(wait_idle(server), server.host.n_seq_max)


def test_a_prompt_too_long_among_several_admits_none(client, server, reference):
    long = [1] + [7] * 5000
    r = httpx.post(server.url + "/v1/completions", timeout=30,
                   json={"model": MODEL, "prompt": [[1, 5, 6], long], "max_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert is_idle(wait_idle(server), server.host.n_seq_max)
