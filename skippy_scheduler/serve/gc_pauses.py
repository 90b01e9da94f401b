"""The cyclic garbage collector's pauses in the server's process, and the startup heap kept out
of its passes.

Every collection holds the GIL for its whole pass, on whichever thread's allocation set it off:
the event loop, the engine thread or the host's worker, which stops the device's next step. A
full collection walks every tracked object, and a loaded server holds about 90 000 of them
before its first request (modules, the app, the model's tables), which it keeps to the end.
`freeze_startup_heap` collects once and moves them to the interpreter's permanent generation
(`gc.freeze()`), so later collections walk only what serving allocates; `skippy-scheduler
serve` does so just before it listens, as vLLM does after its start-up (an embedding process
that runs `Server.start_in_thread` keeps its own policy).

`GcPauses` counts the collections per generation and times them (`gc.callbacks`; one per
process, installed by the first server's metrics) for `/metrics`:
`skippy:gc_collections_total{generation}`, `skippy:gc_pause_seconds_total{generation}`,
`skippy:gc_pause_max_seconds{generation}` and `skippy:gc_frozen_objects`.
"""
from __future__ import annotations

import gc
import threading
import time
from typing import Any, Optional

GENERATIONS = 3


class GcPauses:
    """Collections and their wall time per generation (0-2) since installed."""

    def __init__(self) -> None:
        self.collections = [0] * GENERATIONS
        self.seconds = [0.0] * GENERATIONS
        self.longest = [0.0] * GENERATIONS
        self._started = 0  # perf_counter_ns at the running collection's start
        self._installed = False

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        # Collections do not nest (one at a time, under the GIL): one start suffices.
        if phase == "start":
            self._started = time.perf_counter_ns()
            return
        if not self._started:
            return
        took = (time.perf_counter_ns() - self._started) / 1e9
        self._started = 0
        g = info["generation"]
        self.collections[g] += 1
        self.seconds[g] += took
        if took > self.longest[g]:
            self.longest[g] = took

    def install(self) -> "GcPauses":
        if not self._installed:
            gc.callbacks.append(self)
            self._installed = True
        return self

    def remove(self) -> None:
        if self._installed:
            gc.callbacks.remove(self)
            self._installed = False


_LOCK = threading.Lock()
_PROCESS: Optional[GcPauses] = None


def process_pauses() -> GcPauses:
    """This process's `GcPauses`, installed on first use."""
    global _PROCESS
    with _LOCK:
        if _PROCESS is None:
            _PROCESS = GcPauses().install()
        return _PROCESS


def freeze_startup_heap() -> int:
    """Collect everything once, then move what is left (the heap a started server keeps) out
    of later collections; returns how many objects are frozen. Collecting first matters:
    `gc.freeze()` takes the generations as they are, and garbage frozen with them would never
    be freed."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


__all__ = ["GcPauses", "freeze_startup_heap", "process_pauses"]
