"""A streamed answer as server-sent events: one write per wake-up (docs/measuring.md, "The
server's own cost").

Each time the engine hands the event loop new events (once per step, `EngineRunner`), every
choice's new text becomes its chunks, and all the chunks of that wake-up, with the finish
chunks, the usage chunk and `[DONE]` when the answer ended in it, go out in one write. The
common chunk (text only: no log-probabilities, no token ids) is filled into a prebuilt template,
byte for byte what encoding the whole chunk object would give; every other chunk is encoded
from its object.

A text-only answer's token chunks go out from the wake-up itself, its task asleep (`_pump`,
the direct lane: docs/measuring.md), when the server's protocol gave the answer a
`DirectWriter`.
"""
from __future__ import annotations

import json
from contextlib import aclosing
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Optional, Protocol, Sequence

from ..engine import TokenEvent

from .answer import logprobs_of, prompt_logprobs_of
from .choices import batches, usage
from .errors import RequestError

if TYPE_CHECKING:  # pragma: no cover
    from .generation import Generation

_DONE = b"data: [DONE]\n\n"
_quote = json.encoder.encode_basestring  # a str as JSON, as dumps with ensure_ascii=False


#: The ASGI scope extension under which the server puts a request's `DirectWriter`.
BODY_WRITER = "skippy.body_writer"


class DirectWriter(Protocol):
    """Writes body chunks of a started response straight to its connection
    (`connections.BodyWriter`)."""

    def ready(self) -> bool: ...

    def write(self, data: bytes) -> None: ...


class Direct:
    """The direct writer of one streamed answer: set by the response once it has started
    (None: every chunk goes through the ASGI `send`)."""

    __slots__ = ("writer",)

    def __init__(self) -> None:
        self.writer: Optional[DirectWriter] = None


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


class Chunks:
    """The chunk encoder of one streamed answer (`head`: its id, created and model)."""

    def __init__(self, gen: Any, head: dict[str, Any]) -> None:
        self.gen = gen
        self.chat = gen.kind == "chat"
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        self.base = {"id": head["id"], "object": obj, "created": head["created"],
                     "model": head["model"], "system_fingerprint": None}
        self.head = head
        # `data: {...base,"choices":[{"index":` + i + field + text + rest
        self._open = "data: " + dumps(self.base)[:-1].decode("utf-8") + ',"choices":[{"index":'
        self._field = ',"delta":{"content":' if self.chat else ',"text":'
        self._rest = ('}' if self.chat else '') + ',"logprobs":null,"finish_reason":null}]}\n\n'
        # With usage on every chunk (`continuous`) no chunk is the common one.
        self.continuous = gen.continuous_usage
        self.plain = (not gen.return_token_ids and gen.outputs.logprobs is None
                      and not self.continuous)
        # Completions choices whose prompt ids went out (in a choice's first chunk, as vLLM).
        self._prompted: set[int] = set()

    def text(self, index: int, text: str) -> bytes:
        """A chunk with text only (when `plain`)."""
        return (self._open + str(index) + self._field + _quote(text) + self._rest).encode("utf-8")

    def chunk(self, text: Optional[str], ids: Optional[list[int]], finish: Optional[str],
              role: bool = False, index: int = 0, logprobs: Any = None,
              out: Optional["Generation"] = None) -> bytes:
        """A chunk of choice `index`; with usage on every chunk, `out`'s usage so far (its
        prompt and the tokens it has, as vLLM counts it per choice)."""
        if self.chat:
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": logprobs,
                                      "finish_reason": finish}
        else:
            choice = {"index": index, "text": text or "", "logprobs": logprobs,
                      "finish_reason": finish}
        if self.gen.return_token_ids:
            choice["token_ids"] = ids or []
            if not self.chat and out is not None and index not in self._prompted:
                self._prompted.add(index)
                choice["prompt_token_ids"] = list(out.prompt)
        body = dict(self.base, choices=[choice])
        if role and "prompt_token_ids" in self.head:
            body["prompt_token_ids"] = self.head["prompt_token_ids"]
        if self.continuous and out is not None:
            prompt, done = len(out.prompt), len(out.tokens)
            body["usage"] = {"prompt_tokens": prompt, "completion_tokens": done,
                             "total_tokens": prompt + done}
        return b"data: " + dumps(body) + b"\n\n"

    def usage(self, outs: Sequence["Generation"]) -> bytes:
        return b"data: " + dumps(dict(self.base, choices=[], usage=usage(outs))) + b"\n\n"


def _pump(outs: Sequence["Generation"], enc: Chunks, direct: Direct) -> Callable[[], bool]:
    """The inbox pump of a text-only answer (`runner.Inbox`): at a step's wake-up, on the loop,
    it feeds each choice's token events and writes their text chunks straight to the
    connection in one write, the task that runs `sse` asleep meanwhile. A wake-up with
    anything but plain tokens (an end, an error, a detail) is put back whole and the task
    wakes to take it the usual way (so an answer's last tokens, finish, usage and [DONE]
    still go out in one write); so does one the writer cannot write at once (flow control,
    a client gone), before anything is taken."""
    inbox = outs[0].sub.inbox

    def pump() -> bool:
        writer = direct.writer
        if writer is None or not writer.ready():
            return False
        inbox.arm()  # before the look, as `Inbox.wait` does
        taken: list[tuple["Generation", list[Any]]] = []
        plain = True
        for out in outs:
            if out.finish is not None:
                continue
            items = out.sub._items
            n = len(items)
            if n:
                events = [items.popleft() for _ in range(n)]  # (atomic against the engine)
                taken.append((out, events))
                if plain:
                    for event in events:
                        if type(event) is not TokenEvent or event.detail is not None:
                            plain = False
                            break
        if not plain:
            for out, events in taken:
                out.sub._items.extendleft(reversed(events))  # ahead of any newer ones
            return False
        parts: list[bytes] = []
        for out, events in taken:
            text, _ = out.feed(events)
            if text:
                parts.append(enc.text(out.index, text))
        if parts:
            writer.write(b"".join(parts))
        return True

    return pump


async def sse(outs: Sequence["Generation"], head: dict[str, Any], pieces: Sequence[bytes],
              failure: Callable[["Generation"], RequestError],
              direct: Optional[Direct] = None) -> AsyncIterator[bytes]:
    """The answer's events as SSE writes (module docstring); `failure(out)` is the error a
    failed choice ends the stream with. With `direct`, a text-only answer's token chunks go
    out from the step's wake-up itself (`_pump`) while this generator waits."""
    gen = outs[0].request
    enc = Chunks(gen, head)
    reports = gen.outputs.logprobs is not None
    if enc.chat:
        yield b"".join(enc.chunk("", [], None, role=True, index=out.index, out=out)
                       for out in outs)
    inbox = outs[0].sub.inbox
    if direct is not None and enc.plain and all(out.text_only and out.echo is None
                                                   for out in outs):
        inbox.pump = _pump(outs, enc, direct)  # only now: after the role chunk went out
    echoed: set[int] = set()
    left = len(outs)
    try:
        async with aclosing(batches(outs)) as wakeups:
            async for got in wakeups:
                parts: list[bytes] = []
                for out, events in got:
                    seen = len(out.tokens)
                    text, ids = out.feed(events)
                    if out.finish == "error":
                        err = failure(out)
                        # Counted as the same failure unstreamed would be (its status).
                        out.ctx.metrics.request_errors.labels(str(err.status)).inc()
                        parts += (b"data: " + dumps(err.body()) + b"\n\n", _DONE)
                        for other in outs:
                            other.failed_beside = True
                        yield b"".join(parts)
                        return  # the others are cancelled when the stream closes
                    if out.echo is not None and out.index not in echoed:
                        echoed.add(out.index)
                        parts.append(enc.chunk(out.echo, [], None, index=out.index,
                                               logprobs=prompt_logprobs_of(out, pieces),
                                               out=out))
                    if text and enc.plain:
                        parts.append(enc.text(out.index, text))
                    elif text or (ids and (gen.return_token_ids or reports)):
                        parts.append(enc.chunk(text, ids, None, index=out.index,
                                               logprobs=logprobs_of(out, pieces, prompt=False,
                                                                    since=seen), out=out))
                    if out.finish is not None:
                        parts.append(enc.chunk(None if enc.chat else "", [], out.finish,
                                               index=out.index, out=out))
                        left -= 1
                if not left:  # the answer ended in this wake-up: its tail goes in the same write
                    for out in outs:  # whole: its choices are judged
                        out.judge_slo()
                    if gen.include_usage:
                        parts.append(enc.usage(outs))
                    parts.append(_DONE)
                if parts:
                    yield b"".join(parts)
                if not left:
                    return
        for out in outs:  # every choice had ended before the first wake-up
            out.judge_slo()
        if gen.include_usage:
            yield enc.usage(outs)
        yield _DONE
    finally:
        inbox.pump = None
