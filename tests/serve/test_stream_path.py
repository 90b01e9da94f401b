"""The lean streaming path: prebuilt chunk templates, one loop wake-up per engine step, one
write per answer per wake-up."""
from __future__ import annotations

import asyncio
import json
import socket
import threading
from types import SimpleNamespace

import h11
import httpx
import pytest

from hypothesis import given, settings
from hypothesis import strategies as st

from http_wire import choice_texts, chunked_frames, post_completion, sse_events

from skippy_scheduler import Scheduler, SchedulerConfig, TwinScheduler
from skippy_scheduler.engine import CostModelHost, FinishEvent, Request, TokenEvent
from skippy_scheduler.serve.protocol import parse_chat, parse_completion
from skippy_scheduler.serve.connections import BodyWriter
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
    return chunked_frames(rest)


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


# -- the direct lane: chunks written past the send chain (connections.BodyWriter, stream._pump)


def _h11_response(http_version: bytes) -> h11.Connection:
    """A server-side h11 connection that has sent a streamed response's head."""
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(b"POST /v1/completions HTTP/" + http_version + b"\r\nHost: x\r\n"
                      b"Content-Length: 0\r\n\r\n")
    assert isinstance(conn.next_event(), h11.Request)
    conn.next_event()  # EndOfMessage
    conn.send(h11.Response(status_code=200, headers=[(b"content-type", b"text/event-stream")]))
    return conn


class _Transport:
    def __init__(self) -> None:
        self.out = b""
        self.closing = False

    def write(self, data: bytes) -> None:
        self.out += data

    def is_closing(self) -> bool:
        return self.closing


def _cycle(conn: h11.Connection, transport: _Transport, method: str = "POST") -> SimpleNamespace:
    """What BodyWriter reads of uvicorn's request cycle."""
    return SimpleNamespace(conn=conn, transport=transport, scope={"method": method},
                           response_started=True, response_complete=False, disconnected=False,
                           flow=SimpleNamespace(write_paused=False))


@pytest.mark.parametrize("version", [b"1.1", b"1.0"])
def test_the_body_writer_writes_what_h11_writes(version):
    chunks = [b"data: {\"x\":1}\n\n", b"", "data: \u00e9\n\n".encode(), b"y" * 70000]
    expected_conn, conn = _h11_response(version), _h11_response(version)
    expected = b"".join(expected_conn.send(h11.Data(data=c)) or b"" for c in chunks)
    transport = _Transport()
    writer = BodyWriter(_cycle(conn, transport), transport)
    for c in chunks:
        assert writer.ready()
        writer.write(c)
    assert transport.out == expected
    assert (b"\r\n" in expected) == (version == b"1.1")  # chunked / close-delimited
    # h11 still ends the body (the end goes through send): its state was never disturbed.
    assert conn.send(h11.EndOfMessage()) == expected_conn.send(h11.EndOfMessage())


@pytest.mark.parametrize("change", [
    {"response_started": False}, {"response_complete": True}, {"disconnected": True},
    {"flow": SimpleNamespace(write_paused=True)}, {"scope": {"method": "HEAD"}},
    {"closing": True}])
def test_the_body_writer_is_not_ready_where_send_would_not_write_at_once(change):
    transport = _Transport()
    cycle = _cycle(_h11_response(b"1.1"), transport)
    if "closing" in change:
        transport.closing = True
    else:
        for key, value in change.items():
            setattr(cycle, key, value)
    assert not BodyWriter(cycle, transport).ready()


def test_an_inbox_pump_that_takes_the_events_leaves_its_consumer_asleep():
    loop = asyncio.new_event_loop()
    try:
        inbox = Inbox(loop)
        answers = iter([True, False])
        inbox.pump = lambda: next(answers)

        async def main() -> list[bool]:
            waiting = asyncio.ensure_future(inbox.wait([]))
            await asyncio.sleep(0)
            inbox._fire()  # the pump took it: still asleep
            await asyncio.sleep(0)
            first = waiting.done()
            inbox._fire()  # the pump handed it over
            await asyncio.wait_for(waiting, 5)
            return [first, waiting.done()]

        assert loop.run_until_complete(main()) == [False, True]
    finally:
        loop.close()


@pytest.mark.parametrize("version", ["1.1", "1.0"])
def test_streamed_choices_written_straight_to_the_socket_are_the_answer(server, version):
    # Text-only choices: their tokens go out from the step's wake-up (the pump), the end
    # through the task. Each HTTP chunk holds whole events, and the text is the answer's.
    body = {"model": "tiny-f32", "prompt": "Once upon", "max_tokens": 24, "n": 2,
            "temperature": 0, "ignore_eos": True}
    whole = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
    payload = json.dumps(dict(body, stream=True)).encode()
    host, port = server.url.removeprefix("http://").split(":")
    raw = post_completion(host, int(port), payload, version=version)
    head, rest = raw.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 200")
    if version == "1.1":
        assert b"transfer-encoding: chunked" in head.lower()
        frames = chunked_frames(rest)
        assert all(f.endswith(b"\n\n") for f in frames)
        rest = b"".join(frames)
    events = sse_events(rest)
    assert events[-1] == "[DONE]"
    assert choice_texts(events, 2) == [c["text"] for c in sorted(whole["choices"], key=lambda c: c["index"])]


def test_a_client_that_reads_slowly_gets_the_whole_stream_in_order(server):
    # A small receive window and a pause before reading, the direct lane writing meanwhile:
    # every event still arrives, whole and in order. (Whether the writes back up as far as
    # flow control depends on the kernel's socket buffers, larger here than this answer; the
    # writer's own check of flow control is the test above.)
    body = {"model": "tiny-f32", "prompt": "Once upon", "max_tokens": 400, "n": 4,
            "temperature": 0, "ignore_eos": True}
    whole = httpx.post(server.url + "/v1/completions", json=body, timeout=120).json()
    payload = json.dumps(dict(body, stream=True)).encode()
    host, port = server.url.removeprefix("http://").split(":")
    # the answer is being written while the client waits
    data = post_completion(host, int(port), payload, rcvbuf=2048, read_after_s=1.5, timeout=120)
    head, rest = data.split(b"\r\n\r\n", 1)
    events = sse_events(b"".join(chunked_frames(rest)))
    assert events[-1] == "[DONE]"
    assert choice_texts(events, 4) == [c["text"] for c in sorted(whole["choices"], key=lambda c: c["index"])]


class _HeldHost(CostModelHost):
    """A host whose first step waits until the test lets it finish."""

    def __init__(self) -> None:
        super().__init__(7)
        self.inside = threading.Event()
        self.go = threading.Event()

    def execute(self, plan):
        if not self.go.is_set():
            self.inside.set()
            assert self.go.wait(30)
        return super().execute(plan)


@pytest.mark.parametrize("impl", [Scheduler, TwinScheduler], ids=["native", "twin"])
def test_a_first_token_deadline_counts_from_the_arrival_not_from_the_end_of_the_step(impl):
    """A request that arrives while the engine is inside a step is taken only after it; its
    first-token deadline still counts from when the server opened it."""
    config = SchedulerConfig(max_active_sequences=4, max_waiting_sequences=8,
                             max_tokens_per_iteration=64, prefill_chunk_tokens=64,
                             reserved_sequence_ids=0)
    sched = impl(config)
    host = _HeldHost()
    runner = EngineRunner(sched, host)
    loop = asyncio.new_event_loop()
    runner.start()
    try:
        async def main() -> float:
            first = runner.open(Request("first", [1, 2, 3], 2), loop)
            assert await first.verdict is None
            assert await asyncio.to_thread(host.inside.wait, 30)
            before = runner.engine.now()
            late = runner.open(Request("late", [4, 5, 6], 100_000, ttft_ms=1000.0), loop)
            after = runner.engine.now()
            await asyncio.sleep(0.3)  # the step runs on; the engine has not taken it yet
            host.go.set()
            assert await late.verdict is None
            deadline = runner.call(lambda: sched.sequence("late").ttft_deadline)
            taken = runner.engine.now()
            assert taken - after >= 0.3e6
            assert before / 1e6 + 1.0 <= deadline <= after / 1e6 + 1.0
            for sub in (first, late):
                runner.cancel(sub.request_id)
                runner.close(sub)
            return deadline

        loop.run_until_complete(asyncio.wait_for(main(), 60))
    finally:
        host.go.set()
        runner.stop()
        loop.close()
