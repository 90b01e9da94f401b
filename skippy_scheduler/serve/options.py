"""The request fields that ask for more than text: `logprobs`, `top_logprobs`, `echo`,
`best_of`, `response_format` (parsed here, apart from the rest of the body: protocol.py calls
`parse_outputs` once per request).

* completions `logprobs: k` (0..20): every sampled token's log-probability and the k most likely
  tokens (OpenAI's legacy format: tokens, token_logprobs, top_logprobs, text_offset).
* chat `logprobs: true` and `top_logprobs: k` (0..20; only with logprobs).
* completions `echo: true`: the prompt's text before the completion; with `logprobs`, the
  prompt's tokens are listed first (the first with a null log-probability).
* completions `best_of: m` (n <= m <= 16, not streamed): m completions per prompt, the n with
  the highest cumulative log-probability returned (choice j of the m samples with seed + j).
* `response_format` (chat and completions): `text`, `json_object` or `json_schema`, enforced by
  llama.cpp's grammar sampler (structured.py).

Log-probabilities are the model's raw ones (before logit bias, penalties and temperature),
vLLM's default: see sampling.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from .errors import RequestError
from .structured import grammar_of

MAX_LOGPROBS = 20  # alternatives per token, as vLLM's default max_logprobs
MAX_BEST_OF = 16


@dataclass(frozen=True)
class OutputRequest:
    """What a request asks for besides the text (module docstring)."""

    logprobs: Optional[int] = None  # alternatives per token; None: no logprobs
    echo: bool = False
    best_of: Optional[int] = None  # None: n
    grammar: Optional[str] = None

    @property
    def reports(self) -> bool:
        """Whether the host must report log-probabilities."""
        return self.logprobs is not None or self.best_of is not None


def _count(body: dict[str, Any], name: str, lo: int, hi: int) -> Optional[int]:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise RequestError(f"'{name}' must be an integer in [{lo}, {hi}], got {value!r}",
                           param=name)
    return value


def _flag(body: dict[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise RequestError(f"'{name}' must be a boolean", param=name)
    return bool(value)


def parse_outputs(body: dict[str, Any], kind: str, n: int, stream: bool) -> OutputRequest:
    """The output fields of a completions (`kind` "completion") or chat body."""
    if kind == "completion":
        logprobs = (None if body.get("logprobs") is False  # as some clients send "none"
                    else _count(body, "logprobs", 0, MAX_LOGPROBS))
        echo = _flag(body, "echo")
        best_of = _count(body, "best_of", 1, MAX_BEST_OF)
        if best_of is not None:
            if best_of < n:
                raise RequestError(f"'best_of' ({best_of}) must be at least 'n' ({n})",
                                   param="best_of")
            if best_of == n:
                best_of = None  # every completion is returned: nothing to rank
            elif stream:
                raise RequestError("'best_of' cannot be used with 'stream' (the best are known "
                                   "only at the end)", param="best_of")
    else:
        wanted = _flag(body, "logprobs")
        top = _count(body, "top_logprobs", 0, MAX_LOGPROBS)
        if top and not wanted:  # 0 without logprobs asks for nothing
            raise RequestError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        logprobs = (top or 0) if wanted else None
        echo, best_of = False, None
    grammar = grammar_of(body.get("response_format"))
    if grammar is not None and body.get("ignore_eos"):
        raise RequestError("'response_format' cannot be combined with 'ignore_eos' (a complete "
                           "JSON value must be able to end)", param="response_format")
    return OutputRequest(logprobs=logprobs, echo=echo, best_of=best_of, grammar=grammar)
