"""Ctrl-C (SIGINT) and SIGTERM in a command that writes results: keep what finished.

Inside `interruptible()` both signals raise `Interrupted`. A command catches it where it holds
the finished part of its work (the suite's finished runs, the requests that ended), writes that
with `saving()` (both signals ignored meanwhile, so a second Ctrl-C cannot cut a file in half),
and raises `Interrupted` on with a sentence saying what it kept; `main` prints that one line and
exits 128 + the signal number (130 for SIGINT, 143 for SIGTERM), as shells expect.
`serve` handles its own signals (it drains and exits 0) and does not use this.
"""
from __future__ import annotations

import contextlib
import signal
import threading
from types import FrameType
from typing import Iterator, Optional

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(BaseException):
    """A signal stopped the command; `kept` says what was saved (one line). A BaseException,
    like KeyboardInterrupt, so that no `except Exception` on the way swallows it."""

    def __init__(self, signum: int, kept: str = "") -> None:
        super().__init__(signum, kept)
        self.signum = signum
        self.kept = kept

    @property
    def status(self) -> int:
        return 128 + self.signum

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name

    def keeping(self, kept: str) -> "Interrupted":
        """The same interruption, now saying what was kept."""
        return Interrupted(self.signum, kept)

    def line(self) -> str:
        return f"interrupted by {self.signal_name}" + (f": {self.kept}" if self.kept else
                                                       ": nothing had finished")


def _raise(signum: int, frame: Optional[FrameType]) -> None:
    raise Interrupted(signum)


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """SIGINT and SIGTERM raise `Interrupted` inside the block (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = [signal.signal(s, _raise) for s in SIGNALS]
    try:
        yield
    finally:
        for s, handler in zip(SIGNALS, previous):
            signal.signal(s, handler)


@contextlib.contextmanager
def saving() -> Iterator[None]:
    """Both signals ignored while the finished results are written."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = [signal.signal(s, signal.SIG_IGN) for s in SIGNALS]
    try:
        yield
    finally:
        for s, handler in zip(SIGNALS, previous):
            signal.signal(s, handler)


__all__ = ["Interrupted", "interruptible", "saving"]
