"""Log-probabilities through the official client: completions `logprobs: k` (legacy shape) and
chat `logprobs` / `top_logprobs`, streamed and not, and `echo`'s prompt log-probabilities, each
equal (to 1e-4) to a log-softmax of the logits llama.cpp's own `Llama` (logits_all) computes
for the same prompt and tokens; with prefix reuse the restored prompt is reported whole."""
from __future__ import annotations

import numpy as np
import openai
import pytest
from serve_support import LANE_CTX, is_idle, start_server, wait_idle

import llama_cpp

MODEL = "tiny-f32"
SAMPLED = {"temperature": 0.8, "top_k": 50}
TOL = 1e-4


@pytest.fixture(scope="module")
def logits_reference(model_path):
    """The model in llama-cpp-python's `Llama`, every position's logits kept, f32 KV."""
    llm = llama_cpp.Llama(str(model_path), n_ctx=LANE_CTX, logits_all=True, type_k=0,
                          type_v=0, n_threads=1, verbose=False)
    yield llm
    llm.close()


def _log_softmax(row) -> np.ndarray:
    x = np.asarray(row, dtype=np.float64)
    m = x.max()
    return x - (m + np.log(np.exp(x - m).sum()))


def _expected(llm, prompt: list[int], generated: list[int]) -> np.ndarray:
    """Row i: the log-softmax at position i of prompt + generated (predicting token i + 1)."""
    llm.reset()
    llm.eval(prompt + generated)
    return np.stack([_log_softmax(r) for r in llm.scores[:len(prompt) + len(generated)]])


def _text(reference, token: int) -> str:
    """A token's name in the completions shape: its text, or OpenAI's `bytes:\\x..` when its
    bytes are not UTF-8 alone (a byte token)."""
    raw = reference.token_bytes(token)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def test_byte_tokens_are_named_by_their_bytes_and_stay_apart(reference):
    from skippy_scheduler.serve.logprob_format import legacy
    from skippy_scheduler.sampling import TokenLogprob

    pieces = [b"", b"a", b"\xc3", b"\xa9"]
    out = legacy([TokenLogprob(2, -0.5, ((2, -0.5), (3, -1.0), (1, -2.0)))], [2], [0], pieces)
    assert out["tokens"] == ["bytes:\\xc3"]
    assert out["top_logprobs"] == [{"bytes:\\xc3": -0.5, "bytes:\\xa9": -1.0, "a": -2.0}]


def _check_legacy_entries(reference, rows, tokens, texts, logprobs, tops, k, first):
    """Entries j of a legacy logprobs object against log-softmax rows (token j at `first + j`
    is predicted by row first + j - 1)."""
    for j, (token, text, lp, top) in enumerate(zip(tokens, texts, logprobs, tops)):
        row = rows[first + j - 1]
        assert text == _text(reference, token)
        assert abs(lp - row[token]) < TOL
        best = np.argsort(-row, kind="stable")[:k]
        want = {_text(reference, t): row[t] for t in best}
        assert set(top) >= set(want) and len(top) <= k + 1
        for name, value in want.items():
            assert abs(top[name] - value) < TOL


def _ids(choice) -> list[int]:
    return list(choice.model_extra["token_ids"])


def test_completion_logprobs_equal_llama_cpp_streamed_and_not(client, reference,
                                                              logits_reference, server):
    prompt = reference.tokenize("the quick brown fox", special=True)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, seed=11,
                                  logprobs=3, extra_body={"return_token_ids": True, **SAMPLED})
    choice = r.choices[0]
    generated = _ids(choice)
    lp = choice.logprobs
    assert len(lp.tokens) == len(generated) == len(lp.token_logprobs) == len(lp.text_offset)
    rows = _expected(logits_reference, prompt, generated)
    _check_legacy_entries(reference, rows, generated, lp.tokens, lp.token_logprobs,
                          lp.top_logprobs, 3, len(prompt))
    # text_offset: where each token's text starts in the choice's text
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)

    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, seed=11,
                                       logprobs=3, stream=True, extra_body=SAMPLED)
    tokens, values, offsets, text = [], [], [], ""
    for chunk in stream:
        c = chunk.choices[0]
        text += c.text
        if c.logprobs is not None:
            tokens += c.logprobs.tokens
            values += c.logprobs.token_logprobs
            offsets += c.logprobs.text_offset
    assert text == choice.text and tokens == lp.tokens and offsets == lp.text_offset
    assert np.allclose(values, lp.token_logprobs, atol=TOL, rtol=0)
    assert is_idle(wait_idle(server), server.host.n_seq_max)


def test_chat_logprobs_equal_llama_cpp_streamed_and_not(client, reference, logits_reference):
    messages = [{"role": "user", "content": "Name a colour"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, seed=5,
                                       logprobs=True, top_logprobs=2,
                                       extra_body={"return_token_ids": True, **SAMPLED})
    choice = r.choices[0]
    generated = _ids(choice)
    prompt = r.model_extra["prompt_token_ids"]
    rows = _expected(logits_reference, prompt, generated)
    content = choice.logprobs.content
    assert len(content) == len(generated)
    for j, (token, entry) in enumerate(zip(generated, content)):
        row = rows[len(prompt) + j - 1]
        assert entry.token == reference.token_bytes(token).decode("utf-8", "replace")
        assert entry.bytes == list(reference.token_bytes(token))
        assert abs(entry.logprob - row[token]) < TOL
        best = np.argsort(-row, kind="stable")[:2]
        assert [abs(a.logprob - row[t]) < TOL for a, t in zip(entry.top_logprobs, best)] == [
            True, True]
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                            seed=5, logprobs=True, top_logprobs=2, stream=True,
                                            extra_body=SAMPLED)
    streamed = [e for chunk in stream for c in chunk.choices if c.logprobs
                for e in c.logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert np.allclose([e.logprob for e in streamed], [e.logprob for e in content], atol=TOL,
                       rtol=0)
    # Greedy logprobs report the same figures (raw logits, before sampling).
    g = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3,
                                       temperature=0, logprobs=True)
    assert len(g.choices[0].logprobs.content) == g.usage.completion_tokens


def _check_echo(reference, logits_reference, r, prompt_text, prompt):
    choice = r.choices[0]
    assert choice.text.startswith(prompt_text)
    lp = choice.logprobs
    generated = _ids(choice)
    n = len(prompt)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert len(lp.tokens) == n + len(generated)
    rows = _expected(logits_reference, prompt, generated)
    _check_legacy_entries(reference, rows, prompt[1:] + generated, lp.tokens[1:],
                          lp.token_logprobs[1:], lp.top_logprobs[1:], 2, 1)
    if generated:  # the first generated token's text starts where the prompt's ends
        assert lp.text_offset[n] == len(prompt_text)
    # Offsets into the echoed text, the prompt as sent (no leading space of the tokenizer's):
    # each token's text is found where its offset says, the first one's from its first letter.
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[1] == 0
    assert prompt_text.startswith(lp.tokens[1].lstrip())
    for token, offset in zip(lp.tokens[2:n], lp.text_offset[2:n]):
        assert token.startswith("bytes:") or choice.text.startswith(token, offset), (token,
                                                                                     offset)


def test_echo_reports_the_prompt_logprobs(client, reference, logits_reference):
    prompt_text = "once upon a time there was a tiny model"
    prompt = reference.tokenize(prompt_text, special=True)
    r = client.completions.create(model=MODEL, prompt=prompt_text, max_tokens=4, echo=True,
                                  logprobs=2, temperature=0,
                                  extra_body={"return_token_ids": True})
    _check_echo(reference, logits_reference, r, prompt_text, prompt)
    stream = client.completions.create(model=MODEL, prompt=prompt_text, max_tokens=4, echo=True,
                                       logprobs=2, temperature=0, stream=True)
    chunks = [c.choices[0] for c in stream if c.choices]
    assert chunks[0].text == prompt_text
    assert chunks[0].logprobs.tokens == r.choices[0].logprobs.tokens[:len(prompt)]
    assert "".join(c.text for c in chunks) == r.choices[0].text
    plain = client.completions.create(model=MODEL, prompt=prompt_text, max_tokens=4, echo=True,
                                      temperature=0)
    assert plain.choices[0].text == r.choices[0].text and plain.choices[0].logprobs is None


def test_max_tokens_zero_scores_the_prompt(client, server, reference, logits_reference):
    """echo with max_tokens 0 answers the prompt's text and log-probabilities and no token
    (lm-eval's loglikelihood request): the token the engine ran to is not answered."""
    prompt_text = "once upon a time there was a tiny model"
    prompt = reference.tokenize(prompt_text, special=True)
    scored = client.completions.create(model=MODEL, prompt=prompt_text, max_tokens=0, echo=True,
                                       logprobs=2, temperature=0,
                                       extra_body={"return_token_ids": True})
    choice = scored.choices[0]
    assert choice.text == prompt_text and choice.finish_reason == "length"
    assert _ids(choice) == []
    assert (scored.usage.prompt_tokens, scored.usage.completion_tokens) == (len(prompt), 0)
    _check_echo(reference, logits_reference, scored, prompt_text, prompt)
    longer = client.completions.create(model=MODEL, prompt=prompt_text, max_tokens=3, echo=True,
                                       logprobs=2, temperature=0)
    n = len(prompt)
    assert choice.logprobs.tokens == longer.choices[0].logprobs.tokens[:n]
    assert choice.logprobs.token_logprobs == longer.choices[0].logprobs.token_logprobs[:n]
    # Streamed: the echo chunk, then the finish, and usage with no completion tokens.
    chunks = list(client.completions.create(model=MODEL, prompt=[prompt_text, "two"],
                                            max_tokens=0, echo=True, stream=True,
                                            stream_options={"include_usage": True}))
    texts = {i: "".join(c.choices[0].text for c in chunks if c.choices and
                        c.choices[0].index == i) for i in (0, 1)}
    assert texts == {0: prompt_text, 1: "two"}
    assert [c.choices[0].finish_reason for c in chunks if c.choices and
            c.choices[0].finish_reason] == ["length", "length"]
    assert chunks[-1].usage.completion_tokens == 0
    # Without echo it asks for nothing to be answered: a 400 naming max_tokens.
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=prompt_text, max_tokens=0)
    assert e.value.body["param"] == "max_tokens"
    assert is_idle(wait_idle(server), server.host.n_seq_max)


def test_echo_on_a_restored_prefix_still_reports_the_whole_prompt(model_path, reference,
                                                                  logits_reference):
    """With prefix reuse a repeated prompt is restored, not prefilled: the host decodes the
    restored span again for a request that wants its prompt's log-probabilities."""
    srv = start_server(model_path, prefix_cache_tokens=4 * LANE_CTX, prefix_holders=4,
                       ctx_size=4 * LANE_CTX)
    try:
        with openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0,
                           timeout=60) as c:
            text = "a long shared system prompt that the store keeps for the next request"
            prompt = reference.tokenize(text, special=True)
            c.completions.create(model=MODEL, prompt=text, max_tokens=2, temperature=0)
            wait_idle(srv)
            before = srv.runner.stats.restored_tokens
            r = c.completions.create(model=MODEL, prompt=text, max_tokens=3, echo=True,
                                     logprobs=2, temperature=0,
                                     extra_body={"return_token_ids": True})
            wait_idle(srv)
            assert srv.runner.stats.restored_tokens > before  # it was a restore
            _check_echo(reference, logits_reference, r, text, prompt)
            assert is_idle(wait_idle(srv), srv.host.n_seq_max)
    finally:
        srv.shutdown()


def test_plans_in_flight_report_the_same_logprobs(model_path, client):
    """With two plans in flight (decode on the host's worker) every token keeps its own
    figures: the details travel with the plan that sampled them."""
    body = dict(model=MODEL, prompt=["in flight", "two plans at once"], max_tokens=8, seed=3,
                logprobs=2, n=2, extra_body=SAMPLED)
    want = client.completions.create(**body)
    srv = start_server(model_path, inflight=2)
    try:
        with openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0,
                           timeout=60) as c:
            got = c.completions.create(**body)
            assert is_idle(wait_idle(srv), srv.host.n_seq_max)
    finally:
        srv.shutdown()
    for a, b in zip(want.choices, got.choices):
        assert a.text == b.text and a.logprobs.tokens == b.logprobs.tokens
        assert np.allclose(a.logprobs.token_logprobs, b.logprobs.token_logprobs, atol=TOL,
                           rtol=0)


def test_neutral_values_ask_for_nothing(server):
    import httpx

    for path, body in [("/v1/completions", {"prompt": "x", "logprobs": False}),
                       ("/v1/completions", {"prompt": "x", "echo": False, "best_of": 1}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                 "logprobs": False, "top_logprobs": 0})]:
        r = httpx.post(server.url + path, json=dict(body, model=MODEL, max_tokens=2,
                                                    temperature=0), timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["logprobs"] is None
