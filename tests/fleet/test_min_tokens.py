"""`min_tokens` as vLLM defines it, through a real server and the openai client: the first
min_tokens generated tokens are never an end token nor a stop token id, and a stop string
that ends within their text does not stop the generation (docs/fleet.md)."""
from __future__ import annotations

import httpx
import openai
import pytest
from fleet_support import start_replica

from skippy_scheduler.hosts.tiny_model import write_tiny_llama

PROMPT = "the quick brown fox"  # greedy: distinct tokens early on
MODEL = ""  # the served name, read from the server
MAX = 12


def _client(server):
    global MODEL
    MODEL = server.context.model_name
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=60)


def _complete(client, **extra):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX,
                                    temperature=extra.pop("temperature", 0),
                                    seed=extra.pop("seed", None),
                                    extra_body=dict(extra, return_token_ids=True))
    choice = out.choices[0]
    return choice.text, choice.token_ids, choice.finish_reason


@pytest.fixture(scope="module")
def plain(replica):
    """The greedy tokens of PROMPT with the end token suppressed."""
    server, _ = replica
    with _client(server) as client:
        text, ids, _ = _complete(client, ignore_eos=True)
    assert len(ids) == MAX
    return text, ids


@pytest.fixture(scope="module")
def early_end(tmp_path_factory, plain):
    """A server on the same weights whose end token is the greedy output's token k (its first
    occurrence): PROMPT alone ends after k tokens there. Yields (server, k, end token)."""
    _, ids = plain
    k = next(i for i in range(1, MAX) if ids[i] not in ids[:i])
    path = write_tiny_llama(tmp_path_factory.mktemp("early-end") / "tiny.gguf", seed=7,
                            eos_token_id=ids[k])
    server, _ = start_replica(path, kv_events=False)
    yield server, k, ids[k]
    server.shutdown()


def test_min_tokens_holds_off_the_end_token_greedy_and_streamed(early_end, plain):
    server, k, end = early_end
    _, ids = plain
    m = min(k + 3, MAX)
    with _client(server) as client:
        text, got, finish = _complete(client)
        assert got == ids[:k] and finish == "stop"  # the model ends at token k
        text, got, finish = _complete(client, min_tokens=m)
        assert len(got) >= m and end not in got[:m]
        assert got[:k] == ids[:k]  # nothing before the held token changed
        stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX,
                                           temperature=0, stream=True,
                                           extra_body={"min_tokens": m,
                                                       "return_token_ids": True})
        streamed = [t for chunk in stream for t in (chunk.choices[0].token_ids or [])]
        assert streamed == got
        chat = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=MAX,
            temperature=0, extra_body={"min_tokens": MAX, "return_token_ids": True})
        assert chat.usage.completion_tokens == MAX


def test_min_tokens_holds_off_the_end_token_when_sampling(early_end):
    server, _, end = early_end
    with _client(server) as client:
        # A seed whose draws reach the end token early (draws are seeded by position, so the
        # same seed gives the same tokens until the end would have been sampled).
        for seed in range(40):
            _, free, finish = _complete(client, temperature=0.7, top_k=3, seed=seed)
            if finish == "stop" and len(free) < MAX - 2:
                break
        else:
            pytest.fail("no seed ended early")
        m = len(free) + 2
        _, held, _ = _complete(client, temperature=0.7, top_k=3, seed=seed, min_tokens=m)
        assert len(held) >= m and end not in held[:m]
        assert held[:len(free)] == free


def test_min_tokens_holds_off_stop_token_ids(replica, plain):
    server, _ = replica
    _, ids = plain
    stop = ids[1]
    with _client(server) as client:
        _, got, finish = _complete(client, ignore_eos=True, stop_token_ids=[stop])
        assert got == ids[:ids.index(stop) + 1] and finish == "stop"
        _, got, finish = _complete(client, ignore_eos=True, stop_token_ids=[stop],
                                   min_tokens=4)
        assert stop not in got[:4] and got[0] == ids[0]
        assert finish == "length" or (got[-1] == stop and len(got) > 4)


def _detok(server, tokens):
    return httpx.post(server.url + "/detokenize", json={"tokens": tokens},
                      timeout=10).json()["prompt"]


def test_a_stop_string_within_the_first_min_tokens_does_not_stop(replica, plain):
    server, _ = replica
    text, ids = plain
    m = 4
    held = _detok(server, ids[:m])
    assert text.startswith(held)
    # A one-character stop string that occurs within the held text (not a replacement
    # character: the tiny model's bytes are mostly not UTF-8).
    stop = next((c for c in held if c != "\ufffd"), None)
    if stop is None:
        pytest.skip("the held text has no whole character")
    with _client(server) as client:
        cut, _, finish = _complete(client, ignore_eos=True, stop=[stop])
        assert cut == text[:text.index(stop)] and finish == "stop"
        got, got_ids, finish = _complete(client, ignore_eos=True, stop=[stop], min_tokens=m)
    after = text.find(stop, len(held))
    assert got == (text if after == -1 else text[:after])
    assert finish == ("length" if after == -1 else "stop")
    assert got.startswith(held) and got_ids[:m] == ids[:m]


@pytest.mark.parametrize("extra, param", [
    ({"min_tokens": MAX + 1}, "min_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": "3"}, "min_tokens"),
])
def test_a_min_tokens_that_cannot_be_honoured_is_a_400(replica, extra, param):
    server, _ = replica
    r = httpx.post(server.url + "/v1/completions", timeout=30,
                   json=dict({"prompt": PROMPT, "max_tokens": MAX}, **extra))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_render_carries_min_tokens(replica):
    server, _ = replica
    r = httpx.post(server.url + "/v1/completions/render", timeout=30,
                   json={"prompt": PROMPT, "max_tokens": MAX, "min_tokens": 5})
    assert r.status_code == 200, r.text
    assert r.json()[0]["sampling_params"]["min_tokens"] == 5


def test_the_stop_matcher_skips_matches_that_end_in_held_text():
    from skippy_scheduler.serve.text import StopMatcher

    def run(pieces, held, stops):
        m = StopMatcher(stops)
        out = []
        for piece, h in zip(pieces, held):
            text, stopped = m.push(piece, held=h)
            out.append(text)
            if stopped:
                return "".join(out), m.matched
        return "".join(out) + m.flush(), None

    # "ab" wholly inside the held text: not a stop; the later one is
    assert run(["xab", "c", "ab"], [True, False, False], ["ab"]) == ("xabc", "ab")
    # begins in held text, ends after it: a stop (the text before it is what is sent)
    assert run(["xa", "b", "zz"], [True, False, False], ["ab"]) == ("x", "ab")
    # a shorter stop inside a held-back longer one's prefix stays held
    assert run(["yx", "q"], [True, False], ["x", "yxz"]) == ("yxq", None)
    # nothing held: the first match stops, as before
    assert run(["xab", "c"], [False, False], ["ab"]) == ("x", "ab")
