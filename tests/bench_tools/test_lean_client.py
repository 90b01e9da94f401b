"""bench/skippy_bench/lean_client.py: the lean streaming client's decoding of an answer, read in
any split, and what it calls a failure (the whole path against the real server runs in
test_serve_overhead.py)."""
from __future__ import annotations

import asyncio
import json
import random
import time

import pytest
from skippy_bench.lean_client import _Connection
from skippy_bench.loads import Result

HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
        b"transfer-encoding: chunked\r\n\r\n")
BASE = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m"}


def _event(obj: object) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def _token(text: str) -> bytes:
    return _event(dict(BASE, choices=[{"index": 0, "text": text, "logprobs": None,
                                       "finish_reason": None}]))


def _chunked(writes: list[bytes]) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(w), w) for w in writes) + b"0\r\n\r\n"


def _answer(n: int, usage: int | None = None, done: bool = True, end: bool = True) -> bytes:
    """A streamed answer of `n` tokens as the server writes it: one write per token (two
    tokens share the third write), the finish, usage and [DONE] in the last write."""
    writes = [_token(f"t{i}") for i in range(n)]
    writes[1:3] = [writes[1] + writes[2]]
    tail = _event(dict(BASE, choices=[{"index": 0, "text": "", "logprobs": None,
                                       "finish_reason": "length"}]))
    if usage is not None:
        tail += _event(dict(BASE, choices=[], usage={"prompt_tokens": 3,
                                                     "completion_tokens": usage,
                                                     "total_tokens": usage + 3}))
    if done:
        tail += b"data: [DONE]\n\n"
    writes[-1] += tail
    body = _chunked(writes)
    return HEAD + (body if end else body[: body.rindex(b"0\r\n\r\n")])


class _Transport:
    """What the connection calls on its transport when it gives up on it."""

    def __init__(self) -> None:
        self.aborted = False

    def abort(self) -> None:
        self.aborted = True


def _read(data: bytes, cuts: list[int], closed: bool = False) -> tuple[Result, _Transport]:
    """Feed `data` to a connection in reads split at `cuts`; the request's result."""
    loop = asyncio.new_event_loop()
    try:
        conn = _Connection(loop)
        transport = _Transport()
        conn.transport = transport  # type: ignore[assignment]
        res = Result(sent=time.perf_counter())
        conn._reset()
        conn._res = res
        conn._waiter = loop.create_future()
        for a, b in zip([0, *cuts], [*cuts, len(data)]):
            if conn._res is None:
                break
            conn.data_received(data[a:b])
        if closed and conn._res is not None:
            conn.connection_lost(None)
        return res, transport
    finally:
        loop.close()


@pytest.mark.parametrize("seed", range(40))
def test_an_answer_decodes_the_same_in_any_split(seed):
    rng = random.Random(seed)
    data = _answer(9, usage=9)
    cuts = sorted(rng.sample(range(1, len(data)), rng.randint(0, 30)))
    res, transport = _read(data, cuts)
    assert res.ok, res.error
    assert res.tokens == 9 and res.error == ""
    assert len(res.gaps) == 8  # one per token event after the first, as loads.one counts
    assert not transport.aborted  # kept for the next request


@pytest.mark.parametrize("answer, closed, error", [
    (_answer(5, usage=None), False, "no usage"),
    (_answer(5, usage=5, done=False), False, "without [DONE]"),
    (_answer(5, usage=3), False, "usage says 3 tokens, 5 token chunks came"),
    (_answer(5, usage=5, end=False), True, "connection lost mid-answer"),
    (HEAD + _chunked([_token("a"), b'data: {"error":{"message":"boom"}}\n\n']), False,
     "error event"),
    (b"HTTP/1.1 400 Bad Request\r\ncontent-length: 14\r\n\r\n{\"error\":\"x\"}\n", False,
     '{"error":"x"}'),
    (b"garbage\r\n\r\n", False, "bad status line"),
])
def test_what_is_a_failure(answer, closed, error):
    res, transport = _read(answer, [len(answer) // 2], closed=closed)
    assert not res.ok
    assert error in res.error
    assert transport.aborted or closed  # a failed connection is not reused
