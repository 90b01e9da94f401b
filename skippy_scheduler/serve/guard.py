"""An ASGI middleware that refuses what must never reach a route: a foreign `Host`, and a
request whose framing is ambiguous.

* `Host`: a server on loopback answers only to loopback names (`localhost`, `127.0.0.1`,
  `::1`, with any port) unless told otherwise (`--allowed-hosts`). A web page can make a
  visitor's browser send requests to `127.0.0.1`, and with DNS rebinding it can read the
  answers too, but the browser still sends the page's own host name: refusing that name is what
  keeps the page out. A server bound to another address accepts any `Host` by default (it cannot
  know its public names).
* Framing: h11 reads a request carrying both `Content-Length` and `Transfer-Encoding` by the
  latter, but a proxy in front may have read it by the former and sent what it thinks is a
  second request in the same bytes. RFC 9112 §6.1 lets a server reject such a request and
  requires it to close the connection: both are done (400, `Connection: close`).
"""
from __future__ import annotations

import ipaddress
import json
from typing import Any, Awaitable, Callable, Iterable, Optional

from .errors import RequestError

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")

ASGIApp = Callable[[Any, Any, Any], Awaitable[None]]


def is_loopback(address: str) -> bool:
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address.strip("[]")).is_loopback
    except ValueError:
        return False


def default_allowed_hosts(bind: str) -> Optional[tuple[str, ...]]:
    """The `Host` names a server bound to `bind` answers by default (None: any)."""
    if not is_loopback(bind):
        return None
    names = set(LOOPBACK_NAMES) | {bind.strip("[]").lower()}
    return tuple(sorted(names))


def parse_allowed_hosts(text: str) -> Optional[tuple[str, ...]]:
    """`--allowed-hosts`: comma-separated names; `*` allows any; `*.example.com` a domain."""
    names = tuple(n.strip().lower() for n in text.split(",") if n.strip())
    if not names:
        raise ValueError("expected host names separated by commas, or '*'")
    return None if "*" in names else names


def host_name(value: bytes) -> str:
    """The host of a `Host` header value, without its port (lower case; IPv6 unbracketed)."""
    text = value.decode("latin-1").strip().lower()
    if text.startswith("["):
        return text[1:text.find("]")] if "]" in text else text
    if text.count(":") == 1:
        return text.split(":", 1)[0]
    return text


def host_allowed(name: str, allowed: Iterable[str]) -> bool:
    for pattern in allowed:
        if pattern == name:
            return True
        if pattern.startswith("*.") and name.endswith(pattern[1:]):  # a subdomain
            return True
    return False


class HttpGuard:
    """Wraps the app; `on_error(status)` counts each refusal (the app's error counter)."""

    def __init__(self, app: ASGIApp, *, allowed_hosts: Optional[Iterable[str]],
                 on_error: Callable[[int], None]) -> None:
        self.app = app
        self.allowed = None if allowed_hosts is None else tuple(h.lower() for h in allowed_hosts)
        self.on_error = on_error

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            err = self.check(scope["headers"])
            if err is not None:
                await self._refuse(err, send)
                return
        await self.app(scope, receive, send)

    def check(self, headers: list[tuple[bytes, bytes]]) -> Optional[RequestError]:
        hosts = [v for k, v in headers if k == b"host"]
        framing = {k for k, _ in headers if k in (b"content-length", b"transfer-encoding")}
        if len(framing) == 2:
            return RequestError("the request has both Content-Length and Transfer-Encoding; "
                                "its length is ambiguous (RFC 9112 section 6.1)",
                                code="ambiguous_framing", close=True)
        if self.allowed is None:
            return None
        if len(hosts) != 1:
            return RequestError("the request needs exactly one Host header", code="invalid_host")
        name = host_name(hosts[0])
        if not host_allowed(name, self.allowed):
            return RequestError(f"this server does not answer to the host name {name!r} "
                                f"(allowed: {', '.join(self.allowed)}; see --allowed-hosts)",
                                code="invalid_host")
        return None

    async def _refuse(self, err: RequestError, send: Any) -> None:
        self.on_error(err.status)
        await send_error(err, send)


async def send_error(err: RequestError, send: Any,
                     extra: Iterable[tuple[bytes, bytes]] = ()) -> None:
    """Answer `err` in the OpenAI error shape straight from a middleware."""
    body = json.dumps(err.body()).encode("utf-8")
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in err.headers().items()]
    headers += list(extra)
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
