"""`n` > 1: n choices of one prompt, choice j sampling with seed + j, each equal to a separate
request with that seed; streamed and not; greedy choices are equal; the prompt is prefilled
once (counted); `best_of` keeps the completions of highest cumulative log-probability."""
from __future__ import annotations

import openai
import pytest
from serve_support import ON_DEVICE, is_idle, metrics, start_server, wait_idle

MODEL = "tiny-f32"
SAMPLED = {"temperature": 0.9, "top_k": 40}


@pytest.fixture(scope="module")
def server(model_path):
    """Without prefix reuse (on by default): the prefill counts below are of a prompt computed
    in full, not partly restored from what an earlier test left resident."""
    srv = start_server(model_path, prefix_cache_tokens=0)
    yield srv
    srv.shutdown()


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


def test_n_choices_prefill_their_prompt_once(client, server):
    """n = 3 of one prompt: the scheduler plans each choice's prompt rows (it knows no model),
    the host decodes them once and copies the KV to the two other choices (forks.py)."""
    prompt = [1] + list(range(3, 60))
    wait_idle(server)

    def counters():
        return server.runner.call(lambda: (server.host.decoded_tokens,
                                           server.host.shared_tokens))

    decoded0, shared0 = counters()
    counted0 = metrics(server.url)["skippy:prompt_tokens_total"]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, n=3, seed=5,
                                  extra_body={"return_token_ids": True, **SAMPLED})
    wait_idle(server)
    decoded1, shared1 = counters()
    assert metrics(server.url)["skippy:prompt_tokens_total"] - counted0 == len(prompt)
    generated = sum(len(_ids(c)) for c in r.choices)
    # One prefill of the prompt, then each choice's decode rows (its tokens but the last). A
    # sequence sampled on the device never forks (docs/hosts.md): each choice prefills it.
    prefills = 3 if ON_DEVICE else 1
    assert shared1 - shared0 == (3 - prefills) * len(prompt)
    shown = metrics(server.url)  # published by the engine thread at its next step
    assert shown["skippy:shared_prefill_tokens_total"] == shared1
    assert shown["skippy:decoded_tokens_total"] == decoded1
    assert decoded1 - decoded0 == prefills * len(prompt) + generated - 3
    # ... and the choices are still the three separate seeded requests.
    for j, choice in enumerate(r.choices):
        alone = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, seed=5 + j,
                                          extra_body={"return_token_ids": True, **SAMPLED})
        assert _ids(choice) == _ids(alone.choices[0])


def test_best_of_returns_the_completion_with_the_highest_cumulative_logprob(client):
    prompt, seed = "pick the best", 77
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, best_of=4, n=2,
                                  seed=seed, logprobs=0, extra_body=SAMPLED)
    runs = [client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, seed=seed + j,
                                      logprobs=0, extra_body=SAMPLED).choices[0]
            for j in range(4)]
    ranked = sorted(range(4), key=lambda j: (-sum(runs[j].logprobs.token_logprobs), j))
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == [runs[j].text for j in ranked[:2]]
    assert r.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in runs)
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, best_of=4,
                                      seed=seed, extra_body=SAMPLED)
    assert plain.choices[0].text == runs[ranked[0]].text and plain.choices[0].logprobs is None


@pytest.mark.parametrize("body,what", [({"n": 0}, "'n' must be in [1, 16]"),
                                       ({"n": 17}, "'n' must be in [1, 16]"),
                                       ({"n": 16, "prompt": ["a"] * 5}, "at most 64 choices")])
def test_a_bad_n_is_a_400_naming_it(client, body, what):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=body.pop("prompt", "hi"), max_tokens=2,
                                  extra_body=body)
    assert info.value.body["param"] == "n" and what in info.value.body["message"]
