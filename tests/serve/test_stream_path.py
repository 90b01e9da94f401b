"""The lean streaming path: prebuilt chunk templates, one loop wake-up per engine step, one
write per answer per wake-up."""
from __future__ import annotations

import asyncio
import json
import socket

from hypothesis import given, settings
from hypothesis import strategies as st

from skippy_scheduler import Scheduler, SchedulerConfig
from skippy_scheduler.engine import CostModelHost, FinishEvent, Request, TokenEvent
from skippy_scheduler.serve.protocol import parse_chat, parse_completion
from skippy_scheduler.serve.runner import EngineRunner, Inbox
from skippy_scheduler.serve.stream import Chunks

_HEAD = {"id": "cmpl-\u00e9\"x", "created": 1700000000, "model": "m\u00f6del \"q\""}


@settings(max_examples=200, deadline=None)
@given(text=st.text(), index=st.integers(0, 1000), chat=st.booleans())
def test_a_text_chunk_from_the_template_is_the_encoded_chunk_byte_for_byte(text, index, chat):
    if chat:
        gen = parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}],
                          "stream": True}, 100)
    else:
        gen = parse_completion({"model": "m", "prompt": "x", "stream": True}, 100)
    enc = Chunks(gen, _HEAD)
    assert enc.plain
    assert enc.text(index, text) == enc.chunk(text, [0], None, index=index)
    body = json.loads(enc.text(index, text)[len(b"data: "):])
    assert (body["choices"][0]["delta"]["content"] if chat else body["choices"][0]["text"]) \
        == text


def test_a_chunk_with_token_ids_is_not_plain():
    gen = parse_completion({"model": "m", "prompt": "x", "stream": True,
                            "return_token_ids": True}, 100)
    assert not Chunks(gen, _HEAD).plain


class _CountingLoop(asyncio.SelectorEventLoop):
    """A real event loop that counts the callbacks other threads hand it."""

    handed = 0

    def call_soon_threadsafe(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        self.handed += 1
        return super().call_soon_threadsafe(*args, **kwargs)


def test_the_engine_thread_wakes_the_loop_once_per_step_not_per_token():
    n, max_tokens = 16, 24
    config = SchedulerConfig(max_active_sequences=n, max_waiting_sequences=64,
                             max_tokens_per_iteration=512, prefill_chunk_tokens=256,
                             reserved_sequence_ids=0)
    runner = EngineRunner(Scheduler(config), CostModelHost(7))
    loop = _CountingLoop()
    runner.start()

    async def main() -> tuple[list[list[int]], list[str]]:
        inbox = Inbox(loop)  # shared, as the choices of one answer share it
        subs = [runner.open(Request(f"r{i}", [1, 2, 3], max_tokens), loop, inbox)
                for i in range(n)]
        assert [await s.verdict for s in subs] == [None] * n
        tokens: list[list[int]] = [[] for _ in subs]
        reasons = [""] * n
        while not all(reasons):
            await inbox.wait([s for s, r in zip(subs, reasons) if not r])
            for i, s in enumerate(subs):
                for event in s.take():
                    if isinstance(event, TokenEvent):
                        tokens[i].append(event.token)
                    else:
                        assert isinstance(event, FinishEvent)
                        reasons[i] = event.reason
        for s in subs:
            runner.close(s)
        return tokens, reasons

    try:
        tokens, reasons = loop.run_until_complete(asyncio.wait_for(main(), 60))
        steps = runner.engine.iterations
    finally:
        runner.stop()
        loop.close()
    assert tokens == [[7] * max_tokens] * n and reasons == ["length"] * n
    assert runner.open_subscriptions == 0
    # Every token of every request, in at most one hand-over per step (and the verdicts'):
    assert loop.handed <= steps + n < n * max_tokens


def _raw_stream(url: str, body: dict) -> list[bytes]:
    """The HTTP chunks (transfer-encoding frames) of a streamed answer, read off a socket."""
    host, port = url.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                     b"application/json\r\nContent-Length: %d\r\n\r\n%b" % (len(payload), payload))
        data = b""
        while not data.endswith(b"0\r\n\r\n"):
            more = sock.recv(65536)
            assert more, "the server closed the stream early"
            data += more
    head, rest = data.split(b"\r\n\r\n", 1)
    assert b"transfer-encoding: chunked" in head.lower(), head
    frames = []
    while True:
        size, rest = rest.split(b"\r\n", 1)
        if int(size, 16) == 0:
            return frames
        frames.append(rest[:int(size, 16)])
        rest = rest[int(size, 16) + 2:]


def test_the_last_token_finish_usage_and_done_go_out_in_one_write(server):
    frames = _raw_stream(server.url, {"model": "tiny-f32", "prompt": "Hello there",
                                      "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                                      "stream": True,
                                      "stream_options": {"include_usage": True}})
    events = [[json.loads(e[len(b"data: "):]) if e != b"data: [DONE]" else "[DONE]"
               for e in f.split(b"\n\n") if e] for f in frames]
    last = events[-1]
    assert last[-1] == "[DONE]"
    assert last[-2]["usage"]["completion_tokens"] == 12
    assert last[-3]["choices"][0]["finish_reason"] == "length"
    texts = [e["choices"][0]["text"] for f in events for e in f
             if e != "[DONE]" and e["choices"] and e["choices"][0]["finish_reason"] is None]
    assert len(frames) <= len(texts) + 1  # no write of its own for the tail
