"""A minimal stderr progress bar: shown only on a terminal and only once a run passes 1 s."""
from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    def __init__(self, total: int, label: str, *, stream: TextIO | None = None, delay_s: float = 1.0,
                 enabled: bool | None = None) -> None:
        self.total = max(int(total), 1)
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.delay_s = delay_s
        if enabled is None:
            isatty = getattr(self.stream, "isatty", None)
            enabled = bool(isatty and isatty())
        self.enabled = enabled
        self.start = time.perf_counter()
        self._last = 0.0
        self._shown = False

    def update(self, done: int) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if now - self.start < self.delay_s or now - self._last < 0.1:
            return
        self._last = now
        self._shown = True
        frac = min(max(done / self.total, 0.0), 1.0)
        width = 30
        filled = int(frac * width)
        bar = "#" * filled + "." * (width - filled)
        self.stream.write(f"\r{self.label} [{bar}] {done}/{self.total} "
                          f"{now - self.start:6.1f}s")
        self.stream.flush()

    def close(self) -> None:
        if self._shown:
            self.stream.write("\r" + " " * (len(self.label) + 60) + "\r")
            self.stream.flush()
