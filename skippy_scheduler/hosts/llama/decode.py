"""One `llama_decode` call per plan: the batch, staged from numpy buffers the host owns.

The llama_batch struct only points into the buffers, which are sized once from the batch the
context got. Logits are requested only for the last entry of sampling rows; the sampled token of
each is the argmax of its logits (one vectorised call), overwritten for the lanes that keep a
sampler chain.
"""
from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import numpy.typing as npt

import llama_cpp as _ll

from .backend import recent_log
from .samplers import Samplers

IntArray = npt.NDArray[np.integer[Any]]


class Decoder:
    """Stage rows into the batch (`tok`, `pos`), `decode` them, read one row's logits."""

    def __init__(self, ctx: Any, n: int, n_vocab: int, samplers: Samplers) -> None:
        self._ctx = ctx
        self._n_vocab = n_vocab
        self._samplers = samplers
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

    def decode(self, n: int, row_lanes: IntArray, offsets: IntArray,
               sample_rows: IntArray) -> npt.NDArray[np.int32]:
        """Decode the first `n` staged entries; return the sampled token of each sampling row.
        RuntimeError (with llama.cpp's last log lines) when the decode fails."""
        self._sid[:n] = np.repeat(row_lanes, np.diff(offsets))
        self._flag[:n] = 0
        out_rows = offsets[sample_rows + 1] - 1
        self._flag[out_rows] = 1
        self._batch.n_tokens = n
        rc = _ll.llama_decode(self._ctx, self._batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}: {recent_log()}")
        samplers = self._samplers
        samplers.feed(row_lanes, offsets, self.tok, self.pos)
        k = len(sample_rows)
        if k == 0:
            return np.zeros(0, dtype=np.int32)
        # Output logits are contiguous, one row per flagged entry in batch order.
        ptr = _ll.llama_get_logits(self._ctx)
        logits = np.ctypeslib.as_array(ptr, shape=(k, self._n_vocab))
        tokens: npt.NDArray[np.int32] = logits.argmax(axis=1).astype(np.int32)
        samplers.pick(self._ctx, tokens, logits, row_lanes, sample_rows, out_rows, self.pos)
        return tokens

    def logits_of(self, batch_row: int) -> npt.NDArray[np.float32]:
        """Copy of the logits of one flagged entry of the last decode."""
        ptr = _ll.llama_get_logits_ith(self._ctx, batch_row)
        if not ptr:
            raise ValueError(f"batch row {batch_row} has no logits in the last decode")
        row: npt.NDArray[np.float32] = np.ctypeslib.as_array(ptr, shape=(self._n_vocab,)).copy()
        return row
