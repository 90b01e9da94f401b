"""`n` > 1: n choices of one prompt, choice j sampling with seed + j, each equal to a separate
request with that seed; streamed and not; greedy choices are equal; prefill is counted."""
from __future__ import annotations

import openai
import pytest
from serve_support import is_idle, wait_idle

MODEL = "tiny-f32"
SAMPLED = {"temperature": 0.9, "top_k": 40}


def _ids(choice) -> list[int]:
    return list(choice.model_extra["token_ids"])


def test_n_seeded_completions_equal_separate_requests_with_seed_plus_j(client, server):
    prompt, seed = "the cat sat on the mat", 1234
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, n=3, seed=seed,
                                  extra_body={"return_token_ids": True, **SAMPLED})
    assert [c.index for c in r.choices] == [0, 1, 2]
    alone = [client.completions.create(model=MODEL, prompt=prompt, max_tokens=12,
                                       seed=seed + j, extra_body={"return_token_ids": True,
                                                                  **SAMPLED})
             for j in range(3)]
    for choice, single in zip(r.choices, alone):
        assert _ids(choice) == _ids(single.choices[0])
        assert choice.text == single.choices[0].text
    assert len({tuple(_ids(c)) for c in r.choices}) > 1  # the seed streams differ
    assert r.usage.prompt_tokens == alone[0].usage.prompt_tokens  # the prompt counted once
    assert r.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    assert is_idle(wait_idle(server), server.host.n_seq_max)


def test_n_streamed_chat_choices_equal_separate_requests(client):
    messages = [{"role": "user", "content": "Tell me a story"}]
    seed = 99
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10,
                                            n=3, seed=seed, stream=True, extra_body=SAMPLED)
    text = {j: "" for j in range(3)}
    roles, finishes = set(), {}
    for chunk in stream:
        for c in chunk.choices:
            if c.delta.role:
                roles.add(c.index)
            text[c.index] += c.delta.content or ""
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert roles == {0, 1, 2} and set(finishes) == {0, 1, 2}
    for j in range(3):
        single = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10,
                                                seed=seed + j, extra_body=SAMPLED)
        assert text[j] == single.choices[0].message.content
        assert finishes[j] == single.choices[0].finish_reason


def test_n_greedy_choices_are_equal_and_several_prompts_times_n_are_ordered(client):
    r = client.completions.create(model=MODEL, prompt=["a b c", "once upon"], n=2,
                                  max_tokens=6, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text == r.choices[1].text and r.choices[2].text == r.choices[3].text


def test_each_choice_prefills_its_prompt(client, server):
    """What n = 3 costs in prompt prefill today: every choice's prompt tokens are prefilled
    or restored from the prefix store (this server keeps no prefixes: all prefilled)."""
    prompt = [1] + list(range(3, 60))
    wait_idle(server)
    before = server.runner.stats
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, n=3, seed=5,
                              extra_body=SAMPLED)
    wait_idle(server)
    after = server.runner.stats
    prefilled = after.prefill_tokens - before.prefill_tokens
    restored = after.restored_tokens - before.restored_tokens
    assert prefilled + restored == 3 * len(prompt)
    assert restored == 0


@pytest.mark.parametrize("body,what", [({"n": 0}, "'n' must be in [1, 16]"),
                                       ({"n": 17}, "'n' must be in [1, 16]"),
                                       ({"n": 16, "prompt": ["a"] * 5}, "at most 64 choices")])
def test_a_bad_n_is_a_400_naming_it(client, body, what):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=body.pop("prompt", "hi"), max_tokens=2,
                                  extra_body=body)
    assert info.value.body["param"] == "n" and what in info.value.body["message"]
