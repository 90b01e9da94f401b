"""Log-probabilities in the two shapes of the OpenAI API.

Completions (the legacy shape): `{"tokens": [...], "token_logprobs": [...], "top_logprobs":
[{text: logprob, ...}, ...], "text_offset": [...]}`, one entry per token; `top_logprobs` holds
the k most likely tokens and the sampled one (so up to k + 1 entries, as vLLM answers); an
echoed prompt's first token has null for both (nothing predicts it). `text_offset` is where each
token's text starts in the choice's text (echoed prompt included), in characters.

Chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
"bytes"}, ...]}, ...], "refusal": null}` with exactly `top_logprobs` alternatives.

A token's text is its bytes decoded alone (invalid UTF-8 replaced, as the text is). In the
completions shape, whose `top_logprobs` are keyed by that text, a token whose bytes are not
UTF-8 alone (a byte-fallback token, part of a character) is written as OpenAI writes one,
`bytes:` and its bytes escaped (`bytes:\\xc3`), so that two such tokens stay apart; the chat
shape carries every token's `bytes`.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

from ..sampling import TokenLogprob


def _text(pieces: Sequence[bytes], token: int) -> str:
    return pieces[token].decode("utf-8", "replace")


def _key(pieces: Sequence[bytes], token: int) -> str:
    """A token's name in the completions shape: its text, or `bytes:\\x..` when its bytes are
    not UTF-8 alone."""
    raw = pieces[token]
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def legacy(entries: Sequence[Optional[TokenLogprob]], tokens: Sequence[int],
           offsets: Sequence[int], pieces: Sequence[bytes]) -> dict[str, Any]:
    """The completions shape of `entries` (None: a token nothing predicts)."""
    top: list[Optional[dict[str, float]]] = []
    for entry in entries:
        if entry is None:
            top.append(None)
            continue
        alternatives = {_key(pieces, t): lp for t, lp in entry.top}
        alternatives.setdefault(_key(pieces, entry.token), entry.logprob)
        top.append(alternatives)
    return {"tokens": [_key(pieces, t) for t in tokens],
            "token_logprobs": [None if e is None else e.logprob for e in entries],
            "top_logprobs": top, "text_offset": list(offsets)}


def chat(entries: Sequence[TokenLogprob], pieces: Sequence[bytes]) -> dict[str, Any]:
    """The chat shape of `entries`."""
    def one(token: int, logprob: float) -> dict[str, Any]:
        return {"token": _text(pieces, token), "logprob": logprob,
                "bytes": list(pieces[token])}

    return {"content": [dict(one(e.token, e.logprob),
                             top_logprobs=[one(t, lp) for t, lp in e.top]) for e in entries],
            "refusal": None}


def prompt_offsets(prompt: Sequence[int], pieces: Sequence[bytes]) -> tuple[list[int], str]:
    """Where each prompt token's text starts in the prompt's text, and that text."""
    from .text import Detokenizer

    detok = Detokenizer(pieces)
    offsets, parts, chars = [], [], 0
    for t in prompt:
        offsets.append(chars)
        piece = detok.add(t)
        parts.append(piece)
        chars += len(piece)
    parts.append(detok.flush())
    return offsets, "".join(parts)
