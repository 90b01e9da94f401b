"""A request body, read with bounds and decoded as JSON that every later step can trust.

Reading (`read_body`, on the event loop): the body must be declared `application/json` (415
otherwise: a browser's cross-origin "simple" POST is `text/plain` or form-encoded, and must not
drive the API) and not compressed (a `Content-Encoding` but `identity` is a 415); a declared `Content-Length` above the cap is a 413 before a byte is read, and a
chunked body is cut with a 413 as soon as it passes the cap, so a request never holds more than
`max_body_bytes` of memory; the whole body must arrive within `body_timeout_s` of the handler's
first read (408). The three close the connection after their answer. Before that the connection
reads and throws away the rest of a body answered early (connections.py), so that a client that
sends its whole body before reading gets the answer rather than a reset: `read_body` leaves how
much and until when in the request's scope (`DRAIN`): up to `DRAIN_FACTOR` times the cap,
within the same `body_timeout_s` (a 408 is closed at once). A client that leaves mid-upload
raises `ClientGone`: no answer, no error count.

Decoding (`decode_json`, on a worker thread: a few megabytes of JSON take tens of milliseconds):
the body must be UTF-8 and JSON as RFC 8259 writes it (`NaN`, `Infinity`, and a number past a
double's range such as `1e999`, are 400s); a string or a field name holding a lone surrogate
(the escape `"\\ud800"`, which Python's decoder accepts and no encoder can write back) is a
400 naming where it is, and so is nesting deeper than `MAX_DEPTH` anywhere in the body,
ignored fields included. Both checks walk the decoded tree only when a cheap scan of the raw
bytes says they could fail.
"""
from __future__ import annotations

import asyncio
import json
import math
import re
from typing import Any, NamedTuple, Optional, Union

from starlette.requests import ClientDisconnect, Request

from .errors import ClientGone, RequestError

MAX_DEPTH = 64  # arrays and objects inside one another; OpenAI bodies need fewer than ten
DRAIN_FACTOR = 8  # a body answered early is read on (and thrown away) up to this times the cap
DRAIN = "skippy.drain"  # the scope key of a request's `Drain` (set by `read_body`)
JSON_TYPES = ("application/json",)

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")
# A string (skipped whole) or a bracket: what locating too deep a nesting needs.
_STRUCTURE = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]')
_COLON = re.compile(r"\s*:")

Path = tuple[Union[str, int], ...]


class Drain(NamedTuple):
    """How much of a body answered early the connection may still read to close cleanly."""

    deadline: float  # the event loop's time by which the whole body must have arrived
    max_bytes: int  # the most bytes of it to read after the answer


def check_content_type(value: Optional[str]) -> None:
    media = (value or "").split(";", 1)[0].strip().lower()
    if media not in JSON_TYPES:
        shown = f"'{media}'" if media else "none"
        raise RequestError(f"the request body must be JSON (Content-Type: application/json); "
                           f"this one's content type is {shown}", status=415,
                           code="unsupported_media_type")


def check_content_encoding(value: Optional[str]) -> None:
    """A body must arrive as it is (no `Content-Encoding` but `identity`): this server does not
    decompress request bodies, so a compressed one is a 415 naming its encoding, not a 400
    about its bytes."""
    codings = [c.strip().lower() for c in (value or "").split(",") if c.strip()]
    if any(c != "identity" for c in codings):
        raise RequestError(f"the request body must not be compressed; this one's Content-"
                           f"Encoding is '{', '.join(codings)}'", status=415,
                           code="unsupported_media_type")


def _too_large(limit: int) -> RequestError:
    return RequestError(f"the request body is larger than this server's limit of {limit} bytes "
                        "(--max-body-bytes)", status=413, code="body_too_large", close=True)


async def read_body(request: Request, max_bytes: int, timeout_s: float) -> bytes:
    """The whole body of a JSON request, or a RequestError / ClientGone (see the docstring)."""
    request.scope[DRAIN] = Drain(asyncio.get_running_loop().time() + timeout_s,
                                 DRAIN_FACTOR * max_bytes)
    check_content_type(request.headers.get("content-type"))
    check_content_encoding(request.headers.get("content-encoding"))
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(max_bytes)
    chunks: list[bytes] = []

    async def take() -> None:
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise _too_large(max_bytes)
            chunks.append(chunk)

    try:
        await asyncio.wait_for(take(), timeout_s)
    except asyncio.TimeoutError:
        raise RequestError(f"the request body did not arrive within {timeout_s:g} s "
                           "(--body-timeout)", status=408, code="body_timeout",
                           close=True) from None
    except ClientDisconnect:
        raise ClientGone() from None
    return b"".join(chunks)


def _not_json(name: str) -> Any:
    """Python's decoder reads NaN and ±Infinity, which JSON (RFC 8259) has no words for: a
    constraint or a number built from one would not survive being written back as JSON."""
    raise ValueError(f"{name} is not a JSON value")


def _finite(text: str) -> float:
    """A JSON number as a float; one past a double's range (1e999) would be infinity."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:40]} is out of a double's range")
    return value


def decode_json(raw: bytes) -> Any:
    """`raw` as JSON (a 400 for anything that is not, or that later steps could not use)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RequestError(f"the request body is not valid UTF-8 ({exc.reason} at byte "
                           f"{exc.start})") from None
    try:
        value = json.loads(text, parse_constant=_not_json, parse_float=_finite)
    except RecursionError:
        raise _deep(_deep_path(text)) from None
    except ValueError as exc:  # JSONDecodeError, and integers longer than Python converts
        raise RequestError(f"We could not parse the JSON body of your request ({exc}).") from None
    brackets = raw.count(b"[") + raw.count(b"{")
    surrogates = _SURROGATE_ESCAPE.search(raw) is not None
    if brackets > MAX_DEPTH or surrogates:
        _walk(value, check_depth=brackets > MAX_DEPTH, check_strings=surrogates)
    return value


def field_name(path: Path) -> Optional[str]:
    """`messages[0].content` for ("messages", 0, "content"); None for the body itself."""
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            name = part.encode("utf-8", "backslashreplace").decode("ascii", "backslashreplace")
            out += f".{name}" if out else name
    return out or None


def _deep(path: Path) -> RequestError:
    top = field_name(path[:1])
    where = f"'{top}'" if top else "the request body"
    return RequestError(f"{where} nests arrays or objects deeper than {MAX_DEPTH} levels",
                        param=top)


def _lone_surrogate(text: str) -> bool:
    if text.isascii():
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _walk(value: Any, *, check_depth: bool, check_strings: bool) -> None:
    """Raise the 400 for the first lone surrogate or too deep a nesting in `value`."""
    stack: list[tuple[Any, Path]] = [(value, ())]
    while stack:
        node, path = stack.pop()
        if check_depth and len(path) >= MAX_DEPTH:
            raise _deep(path)
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, item in items:
            if check_strings and isinstance(key, str) and _lone_surrogate(key):
                raise RequestError(f"the field name {field_name(path + (key,))!r} holds a lone "
                                   "UTF-16 surrogate, which is not text",
                                   param=field_name(path + (key,)))
            kind = type(item)
            if kind is dict or kind is list:
                stack.append((item, path + (key,)))
            elif kind is str and check_strings and _lone_surrogate(item):
                where = field_name(path + (key,))
                raise RequestError(f"'{where}' holds a lone UTF-16 surrogate, which is not text",
                                   param=where)


def _deep_path(text: str) -> Path:
    """Where `text` (which Python could not even decode) first nests deeper than MAX_DEPTH:
    the field names on the way (array levels unnamed), found without decoding it."""
    keys: list[Optional[str]] = []  # per open level: the current key of an object, or None
    kinds: list[str] = []
    for m in _STRUCTURE.finditer(text):
        token = m.group()
        if token in "[{":
            kinds.append(token)
            keys.append(None)
            if len(kinds) > MAX_DEPTH:
                return tuple(k for k in keys if k is not None)
        elif token in "]}":
            if kinds:
                kinds.pop()
                keys.pop()
        elif kinds and kinds[-1] == "{" and _COLON.match(text, m.end()):
            try:
                keys[-1] = json.loads(token)
            except ValueError:
                keys[-1] = token[1:-1]
    return ()
