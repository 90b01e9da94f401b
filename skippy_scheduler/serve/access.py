"""Who may call the server: an API key, CORS origins, and the model names it answers to.

* API key (`--api-key`, or `SKIPPY_API_KEY`): every request except those to the open paths
  (`/health` and `/metrics` by default, `--open-paths`) must carry `Authorization: Bearer KEY`;
  otherwise it is a 401 in OpenAI's error shape (`code: invalid_api_key`) with
  `WWW-Authenticate: Bearer`. The key is compared in constant time.
* CORS (`--allowed-origins`, none by default): a preflight (`OPTIONS` with `Origin` and
  `Access-Control-Request-Method`) from an allowed origin is answered 204 with the
  `Access-Control-Allow-*` headers and needs no key (browsers send none on a preflight); from
  any other origin it is a 403. Answers to an allowed origin's requests carry
  `Access-Control-Allow-Origin`; answers to others carry none, so the browser withholds them.
* Model names: a request naming a model this server does not serve is a 404
  `model_not_found` (as vLLM answers); a request naming none gets the first name.
"""
from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Iterable, Optional

from .errors import RequestError
from .guard import send_error

API_KEY_ENV = "SKIPPY_API_KEY"
DEFAULT_OPEN_PATHS = ("/health", "/metrics")
_ALLOW_METHODS = b"GET, POST, OPTIONS"
_ALLOW_HEADERS = b"Authorization, Content-Type"
_MAX_AGE = b"600"

ASGIApp = Callable[[Any, Any, Any], Awaitable[None]]


@dataclass(frozen=True)
class AccessSettings:
    api_key: Optional[str] = None  # None: no key needed
    open_paths: tuple[str, ...] = DEFAULT_OPEN_PATHS  # answered without a key
    allowed_origins: tuple[str, ...] = ()  # CORS origins ("*": any); empty: no CORS


def parse_origins(text: str) -> tuple[str, ...]:
    """`--allowed-origins`: comma-separated origins (`scheme://host[:port]`), or `*`."""
    out = []
    for item in (o.strip() for o in text.split(",")):
        if not item:
            continue
        scheme, sep, rest = item.partition("://")
        if item != "*" and (not sep or not scheme or not rest or any(c in rest for c in "/?#")):
            # A browser's Origin header is scheme://host[:port], never a path, so an entry
            # with one would match nothing.
            raise ValueError(f"expected an origin such as https://example.com (scheme, host "
                             f"and port only), got {item!r}")
        out.append(item.lower())
    if not out:
        raise ValueError("expected origins separated by commas, or '*'")
    return tuple(out)


def parse_paths(text: str) -> tuple[str, ...]:
    """`--open-paths`: comma-separated paths answered without a key (empty: none)."""
    paths = tuple(p.strip() for p in text.split(",") if p.strip())
    for p in paths:
        if not p.startswith("/"):
            raise ValueError(f"expected paths starting with '/', got {p!r}")
    return paths


def _header(headers: Iterable[tuple[bytes, bytes]], name: bytes) -> Optional[bytes]:
    found = [v for k, v in headers if k == name]
    return found[0] if len(found) == 1 else None


class AccessGuard:
    """Wraps the app (inside `guard.HttpGuard`); `on_error(status)` counts each refusal."""

    def __init__(self, app: ASGIApp, *, settings: AccessSettings,
                 on_error: Callable[[int], None]) -> None:
        self.app = app
        self.settings = settings
        self.key = None if settings.api_key is None else settings.api_key.encode("utf-8")
        self.on_error = on_error

    def _origin_allowed(self, origin: Optional[bytes]) -> bool:
        allowed = self.settings.allowed_origins
        if origin is None or not allowed:
            return False
        return "*" in allowed or origin.decode("latin-1").lower() in allowed

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = scope["headers"]
        origin = _header(headers, b"origin")
        allowed = self._origin_allowed(origin)
        if scope["method"] == "OPTIONS" and origin is not None and _header(
                headers, b"access-control-request-method") is not None:
            await self._preflight(origin, allowed, send)
            return
        cors = [(b"access-control-allow-origin", origin), (b"vary", b"Origin")] if (
            allowed and origin is not None) else []
        err = self._check_key(scope["path"], headers)
        if err is not None:
            self.on_error(err.status)
            await send_error(err, send, cors + [(b"www-authenticate", b"Bearer")])
            return
        if not cors:
            await self.app(scope, receive, send)
            return

        async def send_with_cors(message: Any) -> None:
            if message["type"] == "http.response.start":
                message = dict(message, headers=list(message.get("headers", [])) + cors)
            await send(message)

        await self.app(scope, receive, send_with_cors)

    def _check_key(self, path: str, headers: list[tuple[bytes, bytes]]) -> Optional[RequestError]:
        if self.key is None or path in self.settings.open_paths:
            return None
        value = _header(headers, b"authorization")
        if value is None:
            return RequestError("You didn't provide an API key. Send it as "
                                "'Authorization: Bearer KEY'.", status=401,
                                code="invalid_api_key")
        scheme, _, token = value.partition(b" ")
        if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
            return RequestError("Incorrect API key provided.", status=401,
                                code="invalid_api_key")
        return None

    async def _preflight(self, origin: bytes, allowed: bool, send: Any) -> None:
        if not allowed:
            self.on_error(403)
            await send_error(RequestError(
                f"cross-origin requests from {origin.decode('latin-1')!r} are not allowed "
                "(see --allowed-origins)", status=403, code="origin_not_allowed"), send)
            return
        headers = [(b"access-control-allow-origin", origin), (b"vary", b"Origin"),
                   (b"access-control-allow-methods", _ALLOW_METHODS),
                   (b"access-control-allow-headers", _ALLOW_HEADERS),
                   (b"access-control-max-age", _MAX_AGE), (b"content-length", b"0")]
        await send({"type": "http.response.start", "status": 204, "headers": headers})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def served_model(names: tuple[str, ...], requested: Optional[str]) -> str:
    """The name a request is answered under, or a 404 for a model this server does not serve."""
    if requested is None:
        return names[0]
    if requested not in names:
        raise RequestError(f"The model `{requested}` does not exist.", status=404,
                           param="model", code="model_not_found")
    return requested
