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
  its head), and when every connection is busy the newcomer gets a 503 and is closed, so the
  server keeps accepting whatever the clients do;
* a response sent before its request's body has arrived closes the connection (the rest of the
  body is never read, so it cannot be taken for a next request);
* at shutdown, connections that are idle, sending a head or sending a body are closed at once
  (an upload in progress reads as a client that left), running requests get up to
  `shutdown_timeout_s` to finish, then `stop_engine` runs (it ends every request still open
  with an error its client sees), their handlers get a moment to send it, and what is left is
  cancelled.

The body's own deadline is the app's (`body.read_body`), since only the app reads a body.
"""
from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, Callable, Optional

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("skippy_scheduler.serve")

_FLUSH_S = 1.0  # after the deadline: how long ended requests get to send their last bytes


def _raw_response(status: int, reason: str, message: str, code: str) -> bytes:
    body = json.dumps({"error": {"message": message, "type": "server_error" if status >= 500
                                 else "invalid_request_error", "param": None, "code": code}})
    extra = "Retry-After: 1\r\n" if status == 503 else ""
    return (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n{extra}Connection: close\r\n\r\n{body}").encode()


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the limits above (set on a subclass by `protocol_class`)."""

    header_timeout_s: float = 10.0
    max_connections: int = 1024

    _head_timer: Optional[asyncio.TimerHandle] = None
    _opened: float = 0.0
    _silent = True  # not a byte received yet

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self._opened = self.loop.time()
        self._arm_head()
        if len(self.connections) > self.max_connections:
            # Closed ones stay in the set until their connection_lost, a loop turn later.
            live = [c for c in self.connections if not c.transport.is_closing()]
            if len(live) <= self.max_connections:
                return
            victim = min((c for c in live
                          if isinstance(c, GuardedH11Protocol) and c is not self and c.idle),
                         key=lambda c: c._opened, default=None)
            if victim is not None:
                victim._close()
            else:
                self._answer(503, "Service Unavailable", "the server has as many connections "
                             "as it can hold; retry later", "too_many_connections")

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self._disarm_head()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self._silent = False
        super().data_received(data)
        if self.conn.their_state is h11.IDLE:
            self._arm_head()  # a head has begun (no-op when its timer already runs)
        else:
            self._disarm_head()

    def on_response_complete(self) -> None:
        if self.conn.their_state is h11.SEND_BODY and not self.transport.is_closing():
            self._close()  # answered before the body arrived (e.g. 404): never read it
            return
        super().on_response_complete()

    def shutdown(self) -> None:
        if self.conn.their_state in (h11.IDLE, h11.SEND_BODY):
            self._close()  # idle, mid-head or mid-upload: nothing to finish
        else:
            super().shutdown()

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
        self._close()

    def _close(self) -> None:
        self._disarm_head()
        if not self.transport.is_closing():
            self.transport.close()


def protocol_class(header_timeout_s: float, max_connections: int) -> type[GuardedH11Protocol]:
    return type("SkippyH11Protocol", (GuardedH11Protocol,),
                {"header_timeout_s": header_timeout_s, "max_connections": max_connections})


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
