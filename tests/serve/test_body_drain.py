"""An answer sent before the body has arrived (a 413 above all) reaches a client that writes its
whole body before reading: the server reads and throws away the rest of the body, within bounds,
before closing (a close with unread bytes is a TCP reset, which destroys the answer).

One server process for the module (the tiny model, a 2 MB body cap, so the drain's bound is
16 MB, and a 3 s body timeout), driven over raw sockets.
"""
from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
from serve_support import Spawned

CAP = 2_000_000
DRAIN = 8 * CAP  # body.DRAIN_FACTOR × the cap
BODY_S = 3.0
SLACK_S = 3.0  # scheduling on a busy machine

HEAD = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Type: application/json\r\n")


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    server = Spawned(tmp_path_factory.mktemp("drain"), "--max-body-bytes", str(CAP),
                     "--body-timeout", str(BODY_S))
    yield server
    assert server.stop() == 0, server.log()


def _body(size: int) -> bytes:
    return b'{"prompt": "' + b"a" * (size - 14) + b'"}'


def _chunked(body: bytes, piece: int = 65536) -> bytes:
    out = [b"%x\r\n%s\r\n" % (len(body[i:i + piece]), body[i:i + piece])
           for i in range(0, len(body), piece)]
    return b"".join(out) + b"0\r\n\r\n"


def _send_then_read(port: int, data: bytes, timeout_s: float = 30.0) -> bytes:
    """Write all of `data`, then read until the server closes: what it answered (raises what
    the socket raises: a reset is a failure here)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        sock.sendall(data)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def _error(answer: bytes, status: int) -> dict:
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 %d " % status), answer[:300]
    return json.loads(body)["error"]


def _serves(url: str) -> None:
    assert httpx.get(url + "/health", timeout=10).status_code == 200
    r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
    assert r.status_code == 200, r.text


def test_a_client_that_sends_a_10_mb_body_before_reading_gets_the_413(srv):
    body = _body(10_000_000)
    for framing in (b"Content-Length: %d\r\n\r\n" % len(body) + body,
                    b"Transfer-Encoding: chunked\r\n\r\n" + _chunked(body)):
        err = _error(_send_then_read(srv.port, HEAD + framing), 413)
        assert err["code"] == "body_too_large" and "--max-body-bytes" in err["message"]
    # An answer without reading at all (no such route) is drained the same way.
    missing = (b"POST /v1/nothing HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
               b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    assert _send_then_read(srv.port, missing).startswith(b"HTTP/1.1 404 ")
    _serves(srv.url)


def test_a_body_past_the_drain_bound_is_closed_without_hanging(srv):
    # Declared past the bound: closed at once (the client may see a reset or the answer).
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", srv.port), timeout=20) as sock:
        sock.sendall(HEAD + b"Content-Length: %d\r\n\r\n" % (DRAIN + 1))
        answer = b""
        try:
            while chunk := sock.recv(65536):
                answer += chunk
        except ConnectionResetError:
            pass
    assert answer == b"" or answer.startswith(b"HTTP/1.1 413 "), answer[:300]
    assert time.monotonic() - t0 < SLACK_S
    # Chunked, so no length up front: read on up to the bound, then closed.
    piece = b"a" * 65500
    chunk = b"%x\r\n%s\r\n" % (len(piece), piece)
    sent = 0
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", srv.port), timeout=20) as sock:
        sock.sendall(HEAD + b"Transfer-Encoding: chunked\r\n\r\n")
        with pytest.raises((BrokenPipeError, ConnectionResetError)):
            while sent < 4 * DRAIN:
                sock.sendall(chunk)
                sent += len(piece)
    assert DRAIN < sent < 2 * DRAIN, sent
    assert time.monotonic() - t0 < BODY_S + SLACK_S, time.monotonic() - t0
    _serves(srv.url)


def test_the_drain_ends_at_the_body_timeout(srv):
    """A client that trickles the rest of a refused body is read only until the body's
    deadline (`--body-timeout` from the head), then closed."""
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as sock:
        t0 = time.monotonic()
        sock.sendall(HEAD + b"Content-Length: 10000000\r\n\r\n" + b"a" * 100_000)
        answer = b""
        while chunk := sock.recv(65536):  # the answer, then the end of the server's stream
            answer += chunk
        assert _error(answer, 413)["code"] == "body_too_large"
        assert time.monotonic() - t0 < SLACK_S
        closed_at = None
        while time.monotonic() - t0 < BODY_S + 3 * SLACK_S:
            try:
                sock.sendall(b"a" * 1000)
            except (BrokenPipeError, ConnectionResetError):
                closed_at = time.monotonic() - t0
                break
            time.sleep(0.1)
    assert closed_at is not None and BODY_S - 0.5 < closed_at < BODY_S + 2 * SLACK_S, closed_at
    _serves(srv.url)
