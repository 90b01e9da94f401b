"""What a streamed answer looks like on the wire, read back by the tests that check it there."""
from __future__ import annotations

import json
import socket
import time
from typing import Any, Optional


def chunked_frames(body: bytes) -> list[bytes]:
    """The chunks of a chunked transfer-encoded body (what follows the head), in order."""
    frames = []
    rest = body
    while True:
        size, rest = rest.split(b"\r\n", 1)
        n = int(size, 16)
        if not n:
            return frames
        frames.append(rest[:n])
        rest = rest[n + 2:]


def sse_events(body: bytes) -> list[Any]:
    """A server-sent event stream's events: each `data:` object decoded, "[DONE]" as is."""
    return [json.loads(e[len(b"data: "):]) if e != b"data: [DONE]" else "[DONE]"
            for e in body.split(b"\n\n") if e]


def choice_texts(events: list[Any], n: int) -> list[str]:
    """Each choice's text, joined from the completion chunks of `events`."""
    texts = [""] * n
    for event in events:
        if event == "[DONE]":
            continue
        for choice in event["choices"]:
            texts[choice["index"]] += choice["text"]
    return texts


def post_completion(host: str, port: int, payload: bytes, *, version: str = "1.1",
                    rcvbuf: Optional[int] = None, read_after_s: float = 0.0,
                    timeout: float = 60) -> bytes:
    """POST `payload` to /v1/completions over a raw socket (`Connection: close`) and return
    everything the server sent until it closed, head included. `rcvbuf` shrinks the client's
    receive window and `read_after_s` waits before the first read: a late reader, whose
    server's writes back up meanwhile."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        if rcvbuf is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.settimeout(timeout)
        sock.connect((host, port))
        sock.sendall(b"POST /v1/completions HTTP/%b\r\nHost: 127.0.0.1\r\nContent-Type: "
                     b"application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%b"
                     % (version.encode(), len(payload), payload))
        time.sleep(read_after_s)
        data = b""
        while True:
            more = sock.recv(65536)
            if not more:
                return data
            data += more
