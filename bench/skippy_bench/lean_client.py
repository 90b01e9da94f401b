"""A lean streaming load client on raw asyncio: the closed loop of `loads.run_load`, with the
client's own CPU per token kept far below the server's.

`loads.run_load` drives a load with httpx, which spends more CPU per streamed token than the
server it measures (on two cores ~70 µs against ~30 µs), so on a fast server the client, not the
server, caps the rate. Here every concurrent stream owns one HTTP/1.1 keep-alive connection (an
`asyncio.Protocol`, `_Connection`) that sends that stream's requests one after the other. Each
read (`data_received`) is decoded in place: the status line and headers, then the body by its
Content-Length or its chunked framing, and the body's server-sent events are split on blank
lines. A token chunk is recognised by a byte search (`"finish_reason":null` with text), not
parsed; only the other events (the finish chunk, the one with `usage`, errors) go through
`json.loads`, and `[DONE]` is matched as bytes. One `perf_counter` per read is the time of all
the events it holds (the gaps between events of one read are 0).

A request's body is `loads.one`'s (prompt, max_tokens, temperature 0, stream, ignore_eos,
stream_options include_usage, model, and `token_ids` / `extra` when given). It counts as done
only once its stream has sent `[DONE]` and its body has ended (the chunked terminator, or the
Content-Length); its tokens are the server's `usage.completion_tokens`. It is an error (and
not counted) when the answer is not 200 (the error is its body), when the connection is lost
or the body ends before `[DONE]`, when `usage` is missing or below the token chunks counted,
when an event cannot be parsed or carries an error, and when the request runs past its timeout
(`args.timeout`, the whole request including the connect). A failed connection is closed and
the stream's next request opens a new one.

`run_load(args)` takes `loads.run_load`'s arguments (`loads.load_args`) and returns its figures
under the same keys; the generated text is not kept (`outputs` is refused).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any, Optional, Sequence
from urllib.parse import urlsplit

from .loads import Result, load_figures, make_prompts

_MAX_HEAD = 65536  # bytes of status line and headers (or of one chunk-size or trailer line)
_TOKEN_MARK = b'"finish_reason":null'
_EMPTY_TEXT = b'"text":""'
_USAGE = b'"usage"'

# Body framing, and the states of the chunked decoder.
_LENGTH, _CHUNKED, _UNTIL_CLOSE = 0, 1, 2
_SIZE, _DATA, _DATA_END, _TRAILER, _ENDED = 0, 1, 2, 3, 4


class _Connection(asyncio.Protocol):
    """One keep-alive connection, one request at a time (`request`)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: Optional[asyncio.Transport] = None
        self.closed = False
        self._res: Optional[Result] = None
        self._waiter: Optional[asyncio.Future[None]] = None
        self._timer: Optional[asyncio.TimerHandle] = None
        self._reset()

    def _reset(self) -> None:
        """Forget the previous answer's parsing state."""
        self._pending = b""  # bytes read but not yet decoded (a part of a line or of the head)
        self._head_done = False
        self._framing = _LENGTH
        self._left = 0  # bytes left of the Content-Length body or of the current chunk
        self._state = _SIZE
        self._keep = True  # the connection may carry the next request
        self._body = bytearray()  # a non-200 answer's body
        self._sse = b""  # an event not yet ended by its blank line
        self._last = 0.0
        self._counted = 0  # token chunks seen
        self._usage: Optional[int] = None
        self._done = False  # `[DONE]` seen
        self._fault = ""

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self.closed = True
        if self._res is None:
            return
        if self._head_done and self._framing == _UNTIL_CLOSE and exc is None:
            self._complete()  # a body delimited by the end of the connection
        else:
            why = f": {exc}" if exc else ""
            self._fail(f"connection lost mid-answer after {self._counted} token chunks{why}")

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        if self._res is None:
            self._abort()  # bytes nobody asked for: the connection is not reusable
            return
        if self._pending:
            data = self._pending + data
            self._pending = b""
        if not self._head_done:
            end = data.find(b"\r\n\r\n")
            if end < 0:
                if len(data) > _MAX_HEAD:
                    self._fail("response head too long")
                else:
                    self._pending = data
                return
            if not self._head(data[:end]):
                return
            data = data[end + 4:]
        if self._framing == _CHUNKED:
            body = self._dechunk(data)
            if body is None:
                return
            ended = self._state == _ENDED
        elif self._framing == _LENGTH:
            body = data[: self._left]
            self._left -= len(body)
            if len(data) > len(body):
                self._keep = False  # bytes past the answer
            ended = self._left == 0
        else:
            body, ended = data, False
        if body:
            if self._res.status == 200:
                self._events(body, now)
            else:
                self._body += body
        if ended and self._res is not None:
            self._complete()

    # the answer

    def _head(self, head: bytes) -> bool:
        """Read the status line and headers; False when the answer is refused (failed)."""
        assert self._res is not None
        lines = head.split(b"\r\n")
        parts = lines[0].split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
            self._fail(f"bad status line {lines[0][:80]!r}")
            return False
        try:
            self._res.status = int(parts[1])
        except ValueError:
            self._fail(f"bad status line {lines[0][:80]!r}")
            return False
        if parts[0] == b"HTTP/1.0":
            self._keep = False
        length: Optional[int] = None
        chunked = False
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            value = value.strip().lower()
            if name == b"transfer-encoding":
                chunked = value.endswith(b"chunked")
            elif name == b"content-length":
                try:
                    length = int(value)
                except ValueError:
                    self._fail(f"bad content-length {value[:40]!r}")
                    return False
            elif name == b"connection" and b"close" in value:
                self._keep = False
        self._head_done = True
        if self._res.status < 200 or self._res.status in (204, 304):
            self._fail(f"unexpected status {self._res.status}")
            return False
        if chunked:
            self._framing, self._state = _CHUNKED, _SIZE
        elif length is not None:
            self._framing, self._left = _LENGTH, length
        else:
            self._framing, self._keep = _UNTIL_CLOSE, False
        return True

    def _dechunk(self, data: bytes) -> Optional[bytes]:
        """The chunk data in `data` (the rest kept for the next read); None when the framing is
        broken (failed)."""
        pos, n = 0, len(data)
        state = self._state
        if state == _SIZE:  # the usual read: exactly one whole chunk (one token's event)
            eol = data.find(b"\r\n")
            if 0 < eol <= 16 and data.endswith(b"\r\n"):
                try:
                    end = eol + 2 + int(data[:eol], 16)
                except ValueError:
                    end = -1  # a chunk extension or a bad size: the general path tells
                if end + 2 == n and end > eol + 2:
                    return data[eol + 2:end]
        out: list[bytes] = []
        while pos < n:
            if state == _DATA:
                take = min(self._left, n - pos)
                out.append(data[pos:pos + take])
                pos += take
                self._left -= take
                if self._left:
                    break
                state = _DATA_END
            elif state == _DATA_END:
                if n - pos < 2:
                    break
                if data[pos:pos + 2] != b"\r\n":
                    self._fail("chunk not ended by CRLF")
                    return None
                pos += 2
                state = _SIZE
            elif state == _SIZE or state == _TRAILER:
                eol = data.find(b"\r\n", pos)
                if eol < 0:
                    if n - pos > _MAX_HEAD:
                        self._fail("chunk-size line too long")
                        return None
                    break
                line = data[pos:eol]
                pos = eol + 2
                if state == _TRAILER:
                    if not line:
                        state = _ENDED
                    continue
                try:
                    size = int(line.split(b";", 1)[0], 16)
                except ValueError:
                    self._fail(f"bad chunk size {line[:40]!r}")
                    return None
                if size == 0:
                    state = _TRAILER
                else:
                    self._left, state = size, _DATA
            else:  # _ENDED with bytes left: more than the answer
                self._keep = False
                break
        self._state = state
        if pos < n and state != _ENDED:
            self._pending = data[pos:]
        return b"".join(out) if len(out) != 1 else out[0]

    def _events(self, body: bytes, now: float) -> None:
        """Count the token chunks among the events that `body` ends; parse only the others."""
        events = (self._sse + body if self._sse else body).split(b"\n\n")
        self._sse = events.pop()
        tokens = 0
        for ev in events:
            if (_TOKEN_MARK in ev and _EMPTY_TEXT not in ev and _USAGE not in ev
                    and ev.startswith(b"data: {")):
                if self._done:
                    self._fail("token chunk after [DONE]")
                    return
                tokens += 1
            else:
                tokens += self._event(ev)
                if self._res is None:
                    return  # failed
        if tokens:
            res = self._res
            assert res is not None
            if self._last:
                res.gaps.append(now - self._last)
                tokens_left = tokens - 1
            else:
                res.first = now
                tokens_left = tokens - 1
            if tokens_left:
                res.gaps.extend([0.0] * tokens_left)
            self._last = now
            self._counted += tokens

    def _event(self, ev: bytes) -> int:
        """An event that is not a plain token chunk: `[DONE]`, the finish and usage chunks, an
        error; the token chunks it carries (`loads.one`'s count)."""
        data = b"\n".join(line[5:].lstrip(b" ") for line in ev.split(b"\n")
                          if line.startswith(b"data:"))
        if not data:
            return 0  # a comment or another field
        if data == b"[DONE]":
            self._done = True
            return 0
        if self._done:
            self._fail("event after [DONE]")
            return 0
        try:
            doc = json.loads(data)
        except ValueError as exc:
            self._fail(f"bad event {data[:80]!r}: {exc}")
            return 0
        if not isinstance(doc, dict):
            self._fail(f"bad event {data[:80]!r}")
            return 0
        if "error" in doc:
            self._fail(f"error event: {json.dumps(doc['error'])[:160]}")
            return 0
        usage = doc.get("usage")
        if usage:
            tokens = usage.get("completion_tokens")
            if not isinstance(tokens, int):
                self._fail(f"usage without completion_tokens: {usage}")
                return 0
            self._usage = tokens
        choices = doc.get("choices") or []
        if not choices:
            return 0
        c = choices[0]
        if "token_ids" in c:
            return len(c["token_ids"] or [])
        return 1 if c.get("text") else 0

    def _complete(self) -> None:
        """The body has ended: the request's outcome."""
        res = self._res
        assert res is not None
        if res.status != 200:
            self._fail(bytes(self._body).decode("utf-8", "replace")[:200])
            return
        if self._sse.strip():
            self._fail(f"body ended inside an event after {self._counted} token chunks")
        elif not self._done:
            self._fail(f"stream ended without [DONE] after {self._counted} token chunks")
        elif self._usage is None:
            self._fail(f"no usage after {self._counted} token chunks")
        elif self._usage < self._counted:
            self._fail(f"usage says {self._usage} tokens, {self._counted} token chunks came")
        elif self._counted == 0:
            self._fail(f"no token chunk (usage {self._usage})")
        else:
            res.end = time.perf_counter()
            res.tokens = self._usage
            res.ok = True
            if not self._keep:
                self._abort()
            self._settle()

    def _fail(self, error: str) -> None:
        """End the request as failed; the connection is closed."""
        if self._res is None:
            return
        self._res.error = error
        self._res.ok = False
        self._res.end = time.perf_counter()
        self._abort()
        self._settle()

    def _timeout(self, limit: float) -> None:
        self._timer = None
        self._fail(f"timeout: no complete answer within {limit:g} s of sending")

    def _abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    def _settle(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        waiter, self._waiter, self._res = self._waiter, None, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def request(self, payload: bytes, res: Result, left: float, limit: float) -> Result:
        """Send `payload` (a whole HTTP request) and read its streamed answer into `res`,
        failing it after `left` seconds (`limit`: the whole request's timeout, for the
        error)."""
        assert self.transport is not None and self._res is None and not self.closed
        self._reset()
        self._res = res
        self._waiter = waiter = self.loop.create_future()
        self._timer = self.loop.call_later(left, self._timeout, limit)
        self.transport.write(payload)
        try:
            await waiter
        except asyncio.CancelledError:
            self._fail("cancelled")
            raise
        return res


def _payload(host: str, prompt: str, args: argparse.Namespace) -> bytes:
    """The HTTP request of one streamed completion: `loads.one`'s JSON body."""
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": args.max_tokens,
                            "temperature": 0, "stream": True, "ignore_eos": True,
                            "stream_options": {"include_usage": True}}
    if args.model is not None:
        body["model"] = args.model
    if getattr(args, "token_ids", False):
        body["return_token_ids"] = True
    body.update(getattr(args, "extra", None) or {})
    data = json.dumps(body).encode("utf-8")
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\n"
            "Content-Type: application/json\r\nAccept: text/event-stream\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode("ascii")
    return head + data


def _address(url: str) -> tuple[str, int, str]:
    """(host, port, Host header) of an http:// URL."""
    u = urlsplit(url)
    if u.scheme != "http" or not u.hostname:
        raise ValueError(f"lean_client: only http://host[:port] URLs, not {url!r}")
    port = u.port or 80
    return u.hostname, port, u.netloc


async def closed_loop(url: str, prompts: Sequence[str], args: argparse.Namespace,
                      concurrency: int, timeout: float) -> tuple[list[Result], float]:
    """Every prompt sent by `concurrency` streams, each on its own keep-alive connection and
    sending its next request when its previous one ended; the results in prompt order and the
    wall time from the first send to the last end."""
    loop = asyncio.get_running_loop()
    host, port, netloc = _address(url)
    todo = iter(range(len(prompts)))
    results: list[Optional[Result]] = [None] * len(prompts)

    async def stream() -> None:
        conn: Optional[_Connection] = None
        try:
            for i in todo:
                payload = _payload(netloc, prompts[i], args)
                res = Result(sent=time.perf_counter())
                results[i] = res
                if conn is None or conn.closed:
                    conn = None
                    try:
                        _, proto = await asyncio.wait_for(loop.create_connection(
                            lambda: _Connection(loop), host, port), timeout)
                    except (OSError, asyncio.TimeoutError) as exc:
                        res.error = f"connect: {type(exc).__name__}: {exc}"
                        res.end = time.perf_counter()
                        continue
                    conn = proto
                    left = timeout - (time.perf_counter() - res.sent)
                    if left <= 0:
                        res.error = f"timeout: connect took over {timeout:g} s"
                        continue
                else:
                    left = timeout
                await conn.request(payload, res, left, timeout)
        finally:
            if conn is not None and conn.transport is not None:
                conn.transport.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(stream() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    return [r if r is not None else Result(error="not sent") for r in results], wall


async def run_load(args: argparse.Namespace) -> dict[str, Any]:
    """`loads.run_load` with this client: the closed loop of `args` (`loads.load_args`) against
    one server; its figures under the same keys."""
    if getattr(args, "outputs", False):
        raise ValueError("lean_client keeps no generated text: use loads.run_load for outputs")
    prompts = make_prompts(args.requests, args.prompt_tokens, args.shared_prefix,
                           args.shared_fraction, args.seed)
    if args.warmup:
        warm = argparse.Namespace(**{**vars(args), "max_tokens": 4})
        await closed_loop(args.url, [prompts[0][: len(prompts[0]) // 8]], warm, 1,
                          args.timeout)
    results, wall = await closed_loop(args.url, prompts, args, args.concurrency, args.timeout)
    return load_figures(args, results, wall)
