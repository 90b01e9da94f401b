"""Connections under abuse: uvicorn's h11 protocol with a head deadline and a connection cap,
and a uvicorn server whose shutdown has a deadline.

uvicorn alone holds a connection that has sent half a request head forever (its keep-alive
timer stops at the first byte), accepts connections until the process runs out of file
descriptors (after which nobody gets in), and waits on a client stuck mid-upload at shutdown.
Here:

* the head of a request (request line and headers) must be complete within `header_timeout_s`
  of the connection opening or of its first byte after an idle keep-alive: otherwise the server
  answers 408 and closes (a connection that never sent a byte is closed without an answer: a
  client about to use it must not read a 408 as the answer to its request);
* at most `max_connections` are open (`Server` keeps it below the descriptor limit): one more
  evicts the oldest connection that is not in the middle of a request (idle, or still sending
  its head; one draining a body already answered goes first), and when every connection is
  busy the newcomer gets a 503 and is closed, so the server keeps accepting whatever the
  clients do;
* a response sent before its request's body has arrived (a 413, a 404, ...) ends the
  connection, but in a "lingering close": the server shuts its sending side (the client reads
  the answer, then the end of the stream) and reads and throws away the rest of the body before
  closing. Closing with unread bytes makes the kernel send a reset, which destroys the answer
  before a client that writes its whole body first has read it. The drain is bounded by the
  request's `body.Drain` (set by the app's first read: up to 8 × `--max-body-bytes` by the
  deadline of `--body-timeout`, which the drain counts against), or by `drain_bytes` and
  `body_timeout_s` from the head for a request answered without reading (404, 401, ...): a body
  declared longer, a chunked one still arriving past the bound, or one unfinished at the deadline
  is closed at once (its client may then see a reset). Nothing after the body is read as a
  request;
* at shutdown, connections that are idle, sending a head or sending a body are closed at once
  (an upload in progress reads as a client that left), running requests get up to
  `shutdown_timeout_s` to finish, then `stop_engine` runs (it ends every request still open
  with an error its client sees), their handlers get a moment to send it, and what is left is
  cancelled.

The body's own deadline is the app's (`body.read_body`), since only the app reads a body.

Each request's scope also carries a `BodyWriter` (extension `stream.BODY_WRITER`), through
which a streamed answer writes its chunks straight to the connection.
"""
from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, Callable, Optional, cast

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from .body import DRAIN, Drain
from .stream import BODY_WRITER

log = logging.getLogger("skippy_scheduler.serve")

_FLUSH_S = 1.0  # after the deadline: how long ended requests get to send their last bytes
DRAIN_BYTES = 64 << 20  # a drain's bound when the app set none (8 × the default body cap)


def _raw_response(status: int, reason: str, message: str, code: str) -> bytes:
    body = json.dumps({"error": {"message": message, "type": "server_error" if status >= 500
                                 else "invalid_request_error", "param": None, "code": code}})
    extra = "Retry-After: 1\r\n" if status == 503 else ""
    return (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n{extra}Connection: close\r\n\r\n{body}").encode()


class _LingeringTransport:
    """The socket's transport as uvicorn sees it: `close()` after an early answer starts the
    protocol's drain instead, and the transport then reads as closing."""

    def __init__(self, inner: Any, protocol: "GuardedH11Protocol") -> None:
        self.inner = inner
        self._protocol = protocol

    def close(self) -> None:
        if not self._protocol._linger():
            self.inner.close()

    def is_closing(self) -> bool:
        return self._protocol._draining or self.inner.is_closing()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class BodyWriter:
    """Body chunks of a started response written straight to the connection, past the ASGI
    send chain (the app's middleware wrappers, uvicorn's `send`, h11's event processing): a
    streamed answer writes one chunk per token, and the chain costs more than the write.

    It writes exactly what uvicorn's `send` would for a body message with more to come:
    h11 frames the first chunk (a `Data` event, which changes no state in the middle of a
    body), and the framing it chose is read back from its output: chunked (size line, data,
    CRLF) or raw (a close-delimited HTTP/1.0 body); anything else keeps every chunk going
    through h11. The end of the body still goes through the app's `send` (h11's last chunk
    and end of message). `ready()` is False whenever `send` would not write at once (response
    not started or complete, client gone, writes paused by flow control, transport closing,
    a HEAD request): the caller then awaits `send`, which waits for the drain."""

    __slots__ = ("_cycle", "_transport", "_framing")

    _H11, _CHUNKED, _RAW = range(3)

    def __init__(self, cycle: Any, transport: Any) -> None:
        self._cycle = cycle
        self._transport = transport  # the socket's own (the cycle's is the lingering wrapper)
        self._framing: Optional[int] = None  # learnt from the first chunk

    def ready(self) -> bool:
        cycle = self._cycle
        return bool(cycle.response_started and not cycle.response_complete
                    and not cycle.disconnected and not cycle.flow.write_paused
                    and not cycle.transport.is_closing() and cycle.scope["method"] != "HEAD")

    def write(self, data: bytes) -> None:
        """One chunk of the body, more to follow (call only when `ready()`)."""
        if not data:
            return  # (an empty Data writes nothing either)
        framing = self._framing
        if framing == BodyWriter._CHUNKED:
            self._transport.write(b"%x\r\n" % len(data) + data + b"\r\n")
        elif framing == BodyWriter._RAW:
            self._transport.write(data)
        else:
            out = self._cycle.conn.send(h11.Data(data=data))
            if framing is None:
                self._framing = (BodyWriter._CHUNKED if out == b"%x\r\n" % len(data) + data
                                 + b"\r\n" else BodyWriter._RAW if out == data
                                 else BodyWriter._H11)
            if out:
                self._transport.write(out)


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the limits above (set on a subclass by `protocol_class`)."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0  # a drain's deadline when the app set none (after the head)
    drain_bytes: int = DRAIN_BYTES
    max_connections: int = 1024
    # Called with the status of each answer written here, below the app (the head's 408, the
    # connection cap's 503): what `skippy:request_errors_total` counts.
    on_error: Optional[Callable[[int], None]] = None

    _head_timer: Optional[asyncio.TimerHandle] = None
    _drain_timer: Optional[asyncio.TimerHandle] = None
    _opened: float = 0.0
    _head_done: float = 0.0  # when the current request's head was complete
    _silent = True  # not a byte received yet
    _draining = False  # answered early; reading the rest of the body to close cleanly
    _drain_left = 0  # bytes the drain may still read
    _lost = False

    def connection_made(self, transport: Any) -> None:
        self._socket = transport
        super().connection_made(cast(asyncio.Transport, _LingeringTransport(transport, self)))
        self._opened = self.loop.time()
        self._arm_head()
        if len(self.connections) > self.max_connections:
            # Closed ones stay in the set until their connection_lost, a loop turn later.
            live = [c for c in self.connections if not _closed(c)]
            if len(live) <= self.max_connections:
                return
            victim = min((c for c in live if isinstance(c, GuardedH11Protocol)
                          and c is not self and (c.idle or c._draining)),
                         key=lambda c: (not c._draining, c._opened), default=None)
            if victim is not None:
                victim._close()
            else:
                self._answer(503, "Service Unavailable", "the server has as many connections "
                             "as it can hold; retry later", "too_many_connections")

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self._lost = True
        self._draining = False
        self._disarm_head()
        self._disarm_drain()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self._silent = False
        if self._draining:
            self._drain(data)
            return
        was_idle = self.conn.their_state is h11.IDLE
        super().data_received(data)
        if self.conn.their_state is h11.IDLE:
            self._arm_head()  # a head has begun (no-op when its timer already runs)
        else:
            if was_idle:
                self._head_done = self.loop.time()
            self._disarm_head()

    def on_response_complete(self) -> None:
        if self.conn.their_state is h11.SEND_BODY and not self.transport.is_closing():
            # Answered before the body arrived (e.g. 404): never take it for a next request.
            if not self._linger():
                self._close()
            return
        super().on_response_complete()

    def shutdown(self) -> None:
        if self.conn.their_state in (h11.IDLE, h11.SEND_BODY):
            self._close()  # idle, mid-head or mid-upload: nothing to finish
        else:
            super().shutdown()

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        new = self.cycle
        if new is not None and new is not cycle:  # a request began: its app runs later
            extensions: dict[str, Any] = new.scope.setdefault("extensions", {})
            extensions[BODY_WRITER] = BodyWriter(new, self._socket)

    @property
    def idle(self) -> bool:
        """Not inside a request: idle between requests, or still sending a head (h11 leaves
        IDLE at a complete head and comes back only once the response is complete)."""
        return self.conn.their_state is h11.IDLE

    # -- internals ----------------------------------------------------------------------------

    def _arm_head(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_expired)

    def _disarm_head(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _disarm_drain(self) -> None:
        if self._drain_timer is not None:
            self._drain_timer.cancel()
            self._drain_timer = None

    def _linger(self) -> bool:
        """Start draining the unread body of a request already answered, if it is worth it
        and allowed (see the module's docstring); False when the connection should close now."""
        if self._draining:
            return True
        cycle = self.cycle
        if (self._lost or self._socket.is_closing() or cycle is None
                or not cycle.response_complete or self.conn.their_state is not h11.SEND_BODY):
            return False
        drain = cycle.scope.get(DRAIN)
        if not isinstance(drain, Drain):
            drain = Drain(self._head_done + self.body_timeout_s, self.drain_bytes)
        length = next((v for k, v in cycle.scope["headers"] if k == b"content-length"), b"")
        if drain.deadline <= self.loop.time() or (length.isdigit()
                                                   and int(length) > drain.max_bytes):
            return False  # draining would not spare the client a reset
        self._draining = True
        self._drain_left = drain.max_bytes
        self._drain_timer = self.loop.call_at(drain.deadline, self._close)
        if self._socket.can_write_eof():
            self._socket.write_eof()  # the answer is whole: the client may stop sending
        cycle.body = bytearray()  # what uvicorn buffered for the app, which is done with it
        self.flow.resume_reading()
        self._drain(b"")  # what h11 holds already
        return True

    def _drain(self, data: bytes) -> None:
        self._drain_left -= len(data)
        if self._drain_left < 0:
            self._close()
            return
        try:
            if data:  # (h11 reads b"" as the end of the stream)
                self.conn.receive_data(data)
            while self._draining:
                event = self.conn.next_event()
                if event is h11.NEED_DATA:
                    return
                if not isinstance(event, h11.Data):
                    break  # the end of the body (or of the connection): nothing left unread
        except h11.RemoteProtocolError:
            pass  # a malformed body: stop reading it
        self._close()

    def _head_expired(self) -> None:
        self._head_timer = None
        if self._silent:
            self._close()
        elif self.idle:
            self._answer(408, "Request Timeout", f"the request head did not arrive within "
                         f"{self.header_timeout_s:g} s (--header-timeout)", "header_timeout")

    def _answer(self, status: int, reason: str, message: str, code: str) -> None:
        if not self.transport.is_closing():
            self.transport.write(_raw_response(status, reason, message, code))
            if self.on_error is not None:
                self.on_error(status)
        self._close()

    def _close(self) -> None:
        self._draining = False
        self._disarm_head()
        self._disarm_drain()
        if not self._socket.is_closing():
            self._socket.close()


def _closed(connection: Any) -> bool:
    """Closed for good (a draining connection still holds its descriptor)."""
    if isinstance(connection, GuardedH11Protocol):
        return bool(connection._socket.is_closing())
    return bool(connection.transport.is_closing())


def protocol_class(header_timeout_s: float, max_connections: int, *,
                   body_timeout_s: float = GuardedH11Protocol.body_timeout_s,
                   drain_bytes: int = DRAIN_BYTES,
                   on_error: Optional[Callable[[int], None]] = None,
                   ) -> type[GuardedH11Protocol]:
    """The protocol class with these limits; `on_error(status)` counts the answers it writes
    itself (None: not counted)."""
    return type("SkippyH11Protocol", (GuardedH11Protocol,),
                {"header_timeout_s": header_timeout_s, "max_connections": max_connections,
                 "body_timeout_s": body_timeout_s, "drain_bytes": drain_bytes,
                 "on_error": None if on_error is None else staticmethod(on_error)})


class DeadlineServer(uvicorn.Server):
    """uvicorn's server without its signal handling (the owner installs its own and sets
    `should_exit` / `force_exit`) and with a shutdown that ends by a deadline."""

    def __init__(self, config: uvicorn.Config, *, shutdown_timeout_s: float,
                 stop_engine: Callable[[], None], listen_backlog: int) -> None:
        super().__init__(config)
        self.shutdown_timeout_s = shutdown_timeout_s
        self.stop_engine = stop_engine
        self.listen_backlog = listen_backlog

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets=sockets)
        # asyncio listened with the accept batch (`config.backlog`); the kernel's queue of
        # connections waiting to be accepted may be longer.
        for sock in sockets or ():
            sock.listen(self.listen_backlog)

    def install_signal_handlers(self) -> None:  # uvicorn < 0.29
        pass

    def capture_signals(self) -> Any:  # uvicorn >= 0.29 (a context manager)
        import contextlib

        return contextlib.nullcontext()

    async def shutdown(self, sockets: Any = None) -> None:
        loop = asyncio.get_running_loop()
        state = self.server_state
        for server in self.servers:
            server.close()
        for connection in list(state.connections):
            connection.shutdown()
        end = loop.time() + self.shutdown_timeout_s
        while (state.connections or state.tasks) and not self.force_exit and loop.time() < end:
            await asyncio.sleep(0.02)
        if state.tasks:
            log.warning("%d request(s) still running at the shutdown deadline: ending them",
                        len(state.tasks))
        # Ends every request still open (its client gets an error): its handler then returns.
        await loop.run_in_executor(None, self.stop_engine)
        end = loop.time() + _FLUSH_S
        while state.tasks and loop.time() < end:
            await asyncio.sleep(0.02)
        for task in list(state.tasks):
            task.cancel()
        for connection in list(state.connections):
            if isinstance(connection, GuardedH11Protocol):
                connection._close()
