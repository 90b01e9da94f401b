"""One `llama_decode` call per plan: the batch, staged from numpy buffers the host owns.

The batch (`LlamaBatch`, hosts/kit.py) is sized once from the batch the context got. Logits are
requested only for the entries the host flags: the last entry of sampling rows, and every entry
of the rows whose sequence asks for prompt log-probabilities.

A decode with outputs waits for them before it returns (`llama_get_logits`, which waits for
the device and puts the outputs in batch order, in the same C call as `llama_decode`, the GIL
given up once): on a GPU `llama_decode` returns once the work is queued, so `decode_ns` is the
device's whole step (for a step without outputs, the time to queue it), and the reads after it
(the device's sampled tokens) are lookups made without giving the GIL up, each of which would
otherwise wait to take it back from the event loop. A host that stages the next plan while the
device runs this one splits the call (`launch`, then `wait`, each giving the GIL up once), and
the decoder keeps two batches so that the next plan is staged into the one this decode does not
use (`spare`).
"""
from __future__ import annotations

import ctypes
import time
from typing import Any, Callable, Optional

import numpy as np
import numpy.typing as npt

import llama_cpp as _ll

from ...engine.contract import HostOutOfMemory
from ..kit import IntArray, LlamaBatch
from .backend import recent_log



class Decoder:
    """Stage rows into the batch (`tok`, `pos`), `decode` them, read one row's logits."""

    def __init__(self, ctx: Any, n: int, n_vocab: int, *, queues: bool = False) -> None:
        self._ctx = ctx
        self._n_vocab = n_vocab
        self.size = n
        # Two batches: the next plan is staged into the one the running decode does not use
        # (`spare`), while the device runs it.
        self._batches = (LlamaBatch(n), LlamaBatch(n))
        self.batch = self._batches[0]  # the last decoded (or, before any, the first)
        self.decode_ns = 0  # time spent decoding so far, the wait for the outputs included (ns)
        self._launched_ns = 0  # when the decode that `wait` waits for started
        self.last_wait_ns = 0  # the last `launch` to the end of its `wait` (ns; 0: none yet)
        # Called at each decode's start (the host's worker: `HostWorker.launching`): just before
        # the C call, or, for a `launch` on a device that computes apart from the host
        # (`queues`), just after it, once the device has the step.
        self.on_launch: Optional[Callable[[], None]] = None
        # Whether `llama_decode` returns once the step is queued (layers on a GPU or an RPC
        # server) rather than done (the CPU).
        self.queues = queues

    @property
    def tok(self) -> IntArray:
        return self.batch.tok

    @property
    def pos(self) -> IntArray:
        return self.batch.pos

    def spare(self) -> LlamaBatch:
        """The batch the last decode did not use."""
        a, b = self._batches
        return b if self.batch is a else a

    def decode(self, n: int, entry_lanes: IntArray, flagged: IntArray,
               batch: LlamaBatch | None = None) -> npt.NDArray[np.float32]:
        """Decode the first `n` staged entries of `batch` (`tok`, `pos`; default: the last
        decoded; entry i in lane `entry_lanes[i]`) with logits for the `flagged` entries
        (ascending), waiting for them; returns those logits, one row per flagged entry (a view
        of llama.cpp's buffer, valid until the next decode). RuntimeError (with llama.cpp's
        last log lines) when the decode fails."""
        # A step without outputs (a prompt's middle chunk alone) is not waited for: the device
        # runs it while the host stages the next one.
        self._start(n, entry_lanes, flagged, batch, synchronize=len(flagged) > 0)
        self.decode_ns += time.perf_counter_ns() - self._launched_ns
        return self._logits(len(flagged))

    def launch(self, n: int, entry_lanes: IntArray, flagged: IntArray,
               batch: LlamaBatch | None = None) -> None:
        """`decode` without the wait: `llama_decode` returns once the work is queued (on a
        device; on the CPU, once it is done); `wait` then waits for the outputs."""
        self._start(n, entry_lanes, flagged, batch, synchronize=False)

    def wait(self, k: int) -> npt.NDArray[np.float32]:
        """The `k` flagged rows' logits of the decode `launch` started, waited for (in one C
        call, the GIL given up); `decode_ns` counts from the launch."""
        if k:
            self.batch.read_outputs(self._ctx)
        self.last_wait_ns = took = time.perf_counter_ns() - self._launched_ns
        self.decode_ns += took
        return self._logits(k)

    def _start(self, n: int, entry_lanes: IntArray, flagged: IntArray,
               batch: LlamaBatch | None, synchronize: bool) -> None:
        if batch is not None:
            self.batch = batch
        # A `launch` on a device that computes apart from the host says the decode started
        # once the C call has queued the step: what `on_launch` wakes (the engine thread,
        # completing the plan before and planning the next) then runs while the device
        # computes, not beside the host's share of the call (building the graph, handing over
        # the inputs) while the device waits for it. Elsewhere (the CPU computing inside the
        # call, or a decode that waits for its outputs in the call) it is said before.
        after = self.queues and not synchronize
        on_launch = self.on_launch
        if on_launch is not None and not after:
            on_launch()
        t = self._launched_ns = time.perf_counter_ns()
        rc = self.batch.decode(self._ctx, n, entry_lanes, flagged, synchronize=synchronize)
        if on_launch is not None and after:
            on_launch()
        if rc != 0:
            self.decode_ns += time.perf_counter_ns() - t
        if rc == -2:  # llama.cpp could not allocate: the device's memory, or the host's
            raise HostOutOfMemory(f"out of memory for a batch of {n} tokens (llama_decode "
                                  f"returned -2): {recent_log()}")
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}: {recent_log()}")

    def _logits(self, k: int) -> npt.NDArray[np.float32]:
        if k == 0:
            return np.zeros((0, self._n_vocab), dtype=np.float32)
        # Output logits are contiguous, one row per flagged entry in batch order (the decode
        # waited for them and read where they are).
        address = self.batch.logits_address
        if not address:
            raise RuntimeError("llama.cpp gave no logits for the decode's flagged entries")
        ptr = ctypes.cast(address, ctypes.POINTER(ctypes.c_float))
        logits: npt.NDArray[np.float32] = np.ctypeslib.as_array(ptr, shape=(k, self._n_vocab))
        return logits

    def logits_of(self, batch_row: int) -> npt.NDArray[np.float32]:
        """Copy of the logits of one flagged entry of the last decode."""
        ptr = _ll.llama_get_logits_ith(self._ctx, batch_row)
        if not ptr:
            raise ValueError(f"batch row {batch_row} has no logits in the last decode")
        row: npt.NDArray[np.float32] = np.ctypeslib.as_array(ptr, shape=(self._n_vocab,)).copy()
        return row
