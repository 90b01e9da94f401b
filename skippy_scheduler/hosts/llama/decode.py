"""One `llama_decode` call per plan: the batch, staged from numpy buffers the host owns.

The llama_batch struct only points into the buffers, which are sized once from the batch the
context got. Logits are requested only for the entries the host flags: the last entry of
sampling rows, and every entry of the rows whose sequence asks for prompt log-probabilities.
"""
from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import numpy.typing as npt

import llama_cpp as _ll

from ...engine.contract import HostOutOfMemory
from .backend import recent_log

IntArray = npt.NDArray[np.integer[Any]]


class Decoder:
    """Stage rows into the batch (`tok`, `pos`), `decode` them, read one row's logits."""

    def __init__(self, ctx: Any, n: int, n_vocab: int) -> None:
        self._ctx = ctx
        self._n_vocab = n_vocab
        self.size = n
        self.tok = np.zeros(n, dtype=np.int32)
        self.pos = np.zeros(n, dtype=np.int32)
        self._nsid = np.ones(n, dtype=np.int32)
        self._sid = np.zeros(n, dtype=np.int32)
        self._flag = np.zeros(n, dtype=np.int8)
        # seq_id is int32**: entry i points at self._sid[i], so seq ids are filled with numpy.
        self._sid_ptrs = np.uint64(self._sid.ctypes.data) + np.uint64(4) * np.arange(
            n, dtype=np.uint64)
        b: Any = _ll.llama_batch()  # its fields are typed as arrays; they take pointers
        b.n_tokens = 0
        b.token = self.tok.ctypes.data_as(ctypes.POINTER(_ll.llama_token))
        b.embd = ctypes.POINTER(ctypes.c_float)()
        b.pos = self.pos.ctypes.data_as(ctypes.POINTER(_ll.llama_pos))
        b.n_seq_id = self._nsid.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        b.seq_id = ctypes.cast(self._sid_ptrs.ctypes.data,
                               ctypes.POINTER(ctypes.POINTER(_ll.llama_seq_id)))
        b.logits = self._flag.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))
        self._batch = b

    def decode(self, n: int, entry_lanes: IntArray, flagged: IntArray) -> npt.NDArray[np.float32]:
        """Decode the first `n` staged entries (`tok`, `pos`; entry i in lane `entry_lanes[i]`)
        with logits for the `flagged` entries (ascending); returns those logits, one row per
        flagged entry (a view of llama.cpp's buffer, valid until the next decode). RuntimeError
        (with llama.cpp's last log lines) when the decode fails."""
        self._sid[:n] = entry_lanes
        self._flag[:n] = 0
        self._flag[flagged] = 1
        self._batch.n_tokens = n
        rc = _ll.llama_decode(self._ctx, self._batch)
        if rc == -2:  # llama.cpp could not allocate: the device's memory, or the host's
            raise HostOutOfMemory(f"out of memory for a batch of {int(self._batch.n_tokens)} "
                                  f"tokens (llama_decode returned -2): {recent_log()}")
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}: {recent_log()}")
        k = len(flagged)
        if k == 0:
            return np.zeros((0, self._n_vocab), dtype=np.float32)
        # Output logits are contiguous, one row per flagged entry in batch order.
        ptr = _ll.llama_get_logits(self._ctx)
        logits: npt.NDArray[np.float32] = np.ctypeslib.as_array(ptr, shape=(k, self._n_vocab))
        return logits

    def logits_of(self, batch_row: int) -> npt.NDArray[np.float32]:
        """Copy of the logits of one flagged entry of the last decode."""
        ptr = _ll.llama_get_logits_ith(self._ctx, batch_row)
        if not ptr:
            raise ValueError(f"batch row {batch_row} has no logits in the last decode")
        row: npt.NDArray[np.float32] = np.ctypeslib.as_array(ptr, shape=(self._n_vocab,)).copy()
        return row
