"""The direct lane under flow control: a client that does not read lets the server's writes
back up until its transport pauses writing; the pump then stands aside, the answer's task
waits in `send` for the drain, and once the client reads every event arrives whole and in
order. The server is the real app on the instant host (bench/instant_host.py), served by
uvicorn with the server's own protocol on a loopback socket, its transport's write limits and
send buffer made small so that the pause comes after a few KB rather than megabytes."""
from __future__ import annotations

import json
import socket
import sys
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

import uvicorn  # noqa: E402

from skippy_scheduler.serve import ServeSettings, connections  # noqa: E402
from skippy_scheduler.serve.server import listen_socket  # noqa: E402

sys.path.insert(0, "bench")
from instant_host import InstantHost, build_server  # noqa: E402
from http_wire import chunked_frames, post_completion, sse_events  # noqa: E402


def _small_buffers(base: type) -> type:
    class SmallBuffers(base):  # type: ignore[misc, valid-type]
        def connection_made(self, transport):  # type: ignore[no-untyped-def]
            transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET,
                                                          socket.SO_SNDBUF, 4096)
            transport.set_write_buffer_limits(high=1024, low=256)
            super().connection_made(transport)

    return SmallBuffers


def test_a_stalled_reader_pauses_the_direct_lane_and_gets_every_event_in_order(monkeypatch):
    paused = []
    ready = connections.BodyWriter.ready

    def watched(self):  # type: ignore[no-untyped-def]
        if self._cycle.flow.write_paused:
            paused.append(1)
        return ready(self)

    monkeypatch.setattr(connections.BodyWriter, "ready", watched)
    settings = ServeSettings(max_active=4, max_waiting=16)
    server = build_server(settings, InstantHost(n_seq_max=4, step_s=0.001))
    base = connections.protocol_class(settings.header_timeout_s, settings.max_connections)
    config = uvicorn.Config(server.app, log_level="warning", http=_small_buffers(base),
                            loop="asyncio", lifespan="off")
    http = uvicorn.Server(config)
    sock = listen_socket("127.0.0.1", 0, backlog=16)
    port = sock.getsockname()[1]
    server.runner.start()
    thread = threading.Thread(target=http.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        end = time.monotonic() + 20
        while not http.started:
            assert time.monotonic() < end and thread.is_alive(), "uvicorn did not start"
            time.sleep(0.01)
        n, max_tokens = 2, 1500
        payload = json.dumps({"model": "instant", "prompt": "hi", "max_tokens": max_tokens,
                              "n": n, "stream": True,
                              "stream_options": {"include_usage": True}}).encode()
        # not reading for a second: the server's writes back up and pause
        data = post_completion("127.0.0.1", port, payload, rcvbuf=2048, read_after_s=1.0)
    finally:
        http.should_exit = True
        thread.join(10)
        server.runner.stop()
        sock.close()
    assert paused, "the writes never paused: the test did not reach the drain"
    head, rest = data.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 200"), head
    frames = chunked_frames(rest)
    assert all(f.endswith(b"\n\n") for f in frames)  # whole events in every write
    events = sse_events(b"".join(frames))
    assert events[-1] == "[DONE]"
    texts = [""] * n
    finished = [False] * n
    usage = None
    for event in events[:-1]:
        if not event["choices"]:
            usage = event["usage"]
            continue
        choice = event["choices"][0]
        i = choice["index"]
        assert not finished[i], "an event of a choice after its finish"
        texts[i] += choice["text"]
        if choice["finish_reason"] is not None:
            assert choice["finish_reason"] == "length"
            finished[i] = True
    assert texts == ["a" * max_tokens] * n and all(finished)
    assert usage is not None and usage["completion_tokens"] == n * max_tokens
