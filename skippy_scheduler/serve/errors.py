"""Errors a client sees, in the OpenAI error shape.

    {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}

400 `invalid_request_error` names the offending field in `param`; 503 (waiting queue full, or
the engine not running) carries `Retry-After`. Every other failure is a 500 with the same
shape: the server answers every request and keeps serving. An error that leaves the request's
framing in doubt (a body too large or too slow to read, a request both chunked and
length-delimited) closes the connection after its answer (`Connection: close`).
"""
from __future__ import annotations

from typing import Optional

RETRY_AFTER_S = 1


class RequestError(Exception):
    """An error answered to the client; `param` is the request field at fault."""

    def __init__(self, message: str, *, param: Optional[str] = None, status: int = 400,
                 type: str = "invalid_request_error", code: Optional[str] = None,
                 retry_after: Optional[int] = None, close: bool = False) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.type = type
        self.code = code
        self.retry_after = retry_after
        self.close = close  # answer with Connection: close (the rest of the body is not read)

    def body(self) -> dict[str, dict[str, Optional[str]]]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def headers(self) -> dict[str, str]:
        out = {} if self.retry_after is None else {"Retry-After": str(self.retry_after)}
        if self.close:
            out["Connection"] = "close"
        return out


class ClientGone(Exception):
    """The client closed its connection before its request was read: nobody is left to answer,
    and it is not a server error (neither logged nor counted)."""


def queue_full(message: str) -> RequestError:
    return RequestError(message, status=503, type="server_error", code="queue_full",
                        retry_after=RETRY_AFTER_S)


def unavailable(message: str) -> RequestError:
    return RequestError(message, status=503, type="server_error", code="engine_unavailable",
                        retry_after=RETRY_AFTER_S)


def internal(message: str) -> RequestError:
    return RequestError(message, status=500, type="server_error", code="internal_error")
