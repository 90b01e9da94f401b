"""A streamed answer is closed (its requests cancelled and released, its prompt no longer held
for shedding) however the send ends, the head's send included (serve/app.py `_EventStream`)."""
from __future__ import annotations

import asyncio
import contextlib

import pytest

from skippy_scheduler.serve.app import _EventStream


def _stream(closed: list[str]) -> _EventStream:
    async def chunks():
        try:
            yield b"data: one\n\n"
            yield b"data: two\n\n"
        finally:
            closed.append("chunks")

    return _EventStream(chunks(), lambda: closed.append("answer"))


async def _never() -> dict:
    await asyncio.sleep(3600)
    return {"type": "http.disconnect"}


@pytest.mark.parametrize("fail_on", ["http.response.start", "http.response.body"])
def test_the_answer_is_closed_when_a_send_fails(fail_on):
    closed: list[str] = []
    sent: list[str] = []

    async def send(message: dict) -> None:
        if message["type"] == fail_on:
            raise OSError("the client is gone")
        sent.append(message["type"])

    async def run() -> None:
        failing_head = fail_on == "http.response.start"
        with pytest.raises(OSError) if failing_head else contextlib.nullcontext():
            await _stream(closed)({"type": "http"}, _never, send)

    asyncio.run(run())
    assert closed.count("answer") == 1 and closed[-1] == "answer"
    if fail_on == "http.response.start":
        assert sent == []


def test_the_answer_is_closed_after_a_whole_stream():
    closed: list[str] = []
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(_stream(closed)({"type": "http"}, _never, send))
    assert [m["type"] for m in sent] == ["http.response.start"] + ["http.response.body"] * 3
    assert closed.count("answer") == 1

