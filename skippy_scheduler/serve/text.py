"""Generated token ids to text, one token at a time, and stop strings that never leak.

A token's bytes may end in the middle of a UTF-8 character (byte-fallback vocabularies emit
multi-byte characters one byte per token), so `Detokenizer` keeps the incomplete tail until the
character is whole. `StopMatcher` releases only text that cannot be the start of a stop string:
a stop string split across any number of tokens is found, and the text before it is exactly what
the client receives.
"""
from __future__ import annotations

import codecs
from typing import Callable, Sequence


class Detokenizer:
    """Incremental token → text for one generation (invalid bytes become U+FFFD)."""

    __slots__ = ("_pieces", "_decoder")

    def __init__(self, pieces: Sequence[bytes]) -> None:
        self._pieces = pieces
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def add(self, token: int) -> str:
        return self._decoder.decode(self._pieces[token])

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)


def token_pieces(n_vocab: int, token_bytes: Callable[[int], bytes]) -> list[bytes]:
    """Every token's bytes, looked up once (control tokens are empty)."""
    return [token_bytes(t) for t in range(n_vocab)]


class StopMatcher:
    """Cuts streamed text at the first occurrence of any stop string.

    `push(text)` returns (text that may be sent now, stopped). Text that could still grow into
    a stop string is held back. Generation stops at the first push after which any stop string
    is present (as a generator checks after each token): the text ends where the earliest of the
    strings present then begins, the rest is dropped, and `stopped` stays True.
    """

    __slots__ = ("stops", "_pending", "_held", "stopped", "matched")

    def __init__(self, stops: Sequence[str]) -> None:
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        self.stops = tuple(stops)
        self._pending = ""
        self._held = 0  # leading characters of `_pending` no match may end in
        self.stopped = False
        self.matched = ""  # the stop string generation stopped on

    def push(self, text: str, held: bool = False) -> tuple[str, bool]:
        """`held`: `text` is that of a token below the request's min_tokens; no stop string
        that ends within it stops the generation (one that ends later may begin in it)."""
        if self.stopped:
            return "", True
        if not self.stops:
            return text, False
        pending = self._pending + text
        if held:
            self._held = len(pending)
        cut = -1
        for stop in self.stops if not held else ():
            i = pending.find(stop, max(0, self._held - len(stop) + 1))
            if i != -1 and (cut == -1 or i < cut):
                cut, self.matched = i, stop
        if cut != -1:
            self._pending = ""
            self.stopped = True
            return pending[:cut], True
        # NOTE: every text already released was checked not to end in a prefix of any stop
        # string, so a match can only start inside `pending`; holding back its longest suffix
        # that begins some stop string keeps that true.
        hold = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(pending)), hold, -1):
                if pending.endswith(stop[:k]):
                    hold = k
                    break
        release = len(pending) - hold
        self._pending = pending[release:]
        self._held = max(0, self._held - release)
        return pending[:release], False

    def flush(self) -> str:
        """The held-back text, at the end of a generation that did not stop on a string."""
        out, self._pending = self._pending, ""
        return "" if self.stopped else out
