"""Connections and the process's life: half-sent requests, a low descriptor limit, and the
signals `timeout`, `docker stop`, systemd and Ctrl-C send. Each test runs its own server
process (they end it, or need limits of their own)."""
from __future__ import annotations

import selectors
import signal
import socket
import threading
import time

import httpx
import pytest
from serve_support import Spawned, metrics

HEAD_S, BODY_S = 1.0, 2.0
SLACK_S = 1.5  # scheduling on a busy machine


def _half_sent(port: int, kind: str) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    if kind == "head":
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Ty")
    elif kind == "body":
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                     b"application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\": ")
    return sock


def _close_times(socks: list[socket.socket], seconds: float) -> dict[int, tuple[float, bytes]]:
    """For each socket the server closed within `seconds`: (when, what it said before)."""
    t0 = time.monotonic()
    data = {i: b"" for i in range(len(socks))}
    closed: dict[int, tuple[float, bytes]] = {}
    with selectors.DefaultSelector() as sel:
        for i, s in enumerate(socks):
            s.setblocking(False)
            sel.register(s, selectors.EVENT_READ, i)
        while len(closed) < len(socks):
            left = t0 + seconds - time.monotonic()
            if left <= 0:
                break
            for key, _ in sel.select(left):
                i = key.data
                try:
                    chunk = key.fileobj.recv(4096)  # type: ignore[union-attr]
                except ConnectionResetError:
                    chunk = b""
                if chunk:
                    data[i] += chunk
                else:
                    closed[i] = (time.monotonic() - t0, data[i])
                    sel.unregister(key.fileobj)
    return closed


def test_half_sent_requests_are_closed_within_the_stated_timeouts(tmp_path):
    srv = Spawned(tmp_path, "--header-timeout", str(HEAD_S), "--body-timeout", str(BODY_S))
    kinds = ["silent", "head", "body"] * 10
    socks: list[socket.socket] = []
    try:
        socks = [_half_sent(srv.port, kind) for kind in kinds]
        closed = _close_times(socks, BODY_S + 2 * SLACK_S)
        assert sorted(closed) == list(range(len(kinds))), sorted(closed)
        for i, kind in enumerate(kinds):
            when, said = closed[i]
            limit, flag = (BODY_S, b"--body-timeout") if kind == "body" else (HEAD_S,
                                                                             b"--header-timeout")
            assert when < limit + SLACK_S, (kind, when)
            if kind == "silent":  # nothing to answer
                assert said == b"", said
            else:
                assert said.startswith(b"HTTP/1.1 408 ") and flag in said, (kind, said)
        assert httpx.get(srv.url + "/health").status_code == 200
        # Every 408 is counted, the head's (written below the app) as the body's.
        assert metrics(srv.url)['skippy:request_errors_total{status="408"}'] == 20
    finally:
        for s in socks:
            s.close()
        assert srv.stop() == 0, srv.log()


def test_the_server_keeps_accepting_under_a_low_descriptor_limit(tmp_path):
    """192 half-sent heads used to take every descriptor of a 200-descriptor process; now the
    oldest idle connection makes room for each newcomer."""
    srv = Spawned(tmp_path, "--header-timeout", "60", nofile=200)
    socks: list[socket.socket] = []
    try:
        socks = [_half_sent(srv.port, "head") for _ in range(300)]
        for _ in range(3):
            r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                           timeout=10)
            assert r.status_code == 200, r.text
        assert "serving at most" in srv.log()
        assert "Too many open files" not in srv.log()
    finally:
        for s in socks:
            s.close()
        assert srv.stop() == 0, srv.log()


def _stream_in_background(url: str, out: list) -> threading.Thread:
    def run() -> None:
        try:
            with httpx.stream("POST", url + "/v1/completions", timeout=60, json={
                    "prompt": "long", "max_tokens": 16000, "ignore_eos": True,
                    "stream": True}) as r:
                out.append(r.status_code)
                for line in r.iter_lines():
                    out.append(line)
        except httpx.HTTPError as exc:
            out.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _wait_for_tokens(out: list) -> None:
    end = time.monotonic() + 20
    while not any(isinstance(x, str) and x.startswith("data: {") for x in out):
        assert time.monotonic() < end, out
        time.sleep(0.02)


@pytest.mark.parametrize("signals", [[signal.SIGTERM], [signal.SIGINT],
                                     [signal.SIGINT, signal.SIGINT]])
def test_a_signal_drains_closes_everything_and_exits_0(tmp_path, signals):
    srv = Spawned(tmp_path, "--ctx-size", "32768", "--max-active", "2", "--shutdown-timeout",
                  "1", "--header-timeout", "60", "--body-timeout", "60")
    assert list(srv.tmp.iterdir()), "the tiny model is written under TMPDIR"
    out: list = []
    stream = _stream_in_background(srv.url, out)
    stuck = _half_sent(srv.port, "body")  # an upload that never ends
    try:
        _wait_for_tokens(out)
        t0 = time.monotonic()
        for sig in signals:
            srv.proc.send_signal(sig)
            time.sleep(0.05)
        status = srv.stop(None, timeout_s=20)
        elapsed = time.monotonic() - t0
    finally:
        stuck.close()
    stream.join(10)
    log = srv.log()
    assert status == 0, log
    assert elapsed < 1 + 6, elapsed  # the drain deadline, the engine's stop, closing llama.cpp
    assert "stopped (engine, model and temporary files closed)" in log
    assert "Traceback" not in log and "Event loop is closed" not in log, log
    assert list(srv.tmp.iterdir()) == [], "the temporary model directory is left"
    # The running stream was ended with an error event and [DONE], not cut.
    lines = [x for x in out if isinstance(x, str) and x]
    assert lines[-1] == "data: [DONE]", out[-3:]
    assert '"error"' in lines[-2] and "engine_unavailable" in lines[-2], lines[-2]


def test_accepted_connections_send_without_nagles_delay():
    """The listener says it is TCP, so asyncio turns Nagle's algorithm off on each connection
    it accepts (with Nagle on, a stream's small writes on a reused keep-alive connection wait
    for the client's delayed ACK)."""
    import asyncio

    from skippy_scheduler.serve.server import listen_socket

    async def accept_one() -> int:
        seen: asyncio.Future = asyncio.get_running_loop().create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport) -> None:  # type: ignore[override]
                sock = transport.get_extra_info("socket")
                seen.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                transport.close()

        listener = listen_socket("127.0.0.1", 0)
        server = await asyncio.get_running_loop().create_server(Probe, sock=listener)
        try:
            port = listener.getsockname()[1]
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                return await asyncio.wait_for(seen, 10)
            finally:
                writer.close()
        finally:
            server.close()
            await server.wait_closed()

    assert asyncio.run(accept_one()) != 0


def test_a_signal_after_the_closing_does_not_kill_the_process(tmp_path):
    """Once serve has closed everything the process still takes a moment to exit; a second
    SIGTERM sent then (a supervisor's repeat) is ignored rather than given its default action,
    which would end the process with the signal's status instead of 0."""
    srv = Spawned(tmp_path)
    srv.proc.send_signal(signal.SIGTERM)
    end = time.monotonic() + 30
    while "stopped (engine, model and temporary files closed)" not in srv.log():
        assert time.monotonic() < end and srv.proc.poll() is None, srv.log()
        time.sleep(0.002)
    try:
        srv.proc.send_signal(signal.SIGTERM)
    except ProcessLookupError:  # (gone already: nothing left to test this time)
        pass
    assert srv.stop(None, timeout_s=20) == 0, srv.log()
