"""What a streamed answer looks like on the wire, read back by the tests that check it there."""
from __future__ import annotations

import json
from typing import Any


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
