"""Run one stage's layers on stock llama.cpp (docs/stages.md "Exact stage execution").

`StageRunner` owns a stage model and its context. A first stage takes token ids, a later one
takes the previous stage's residual stream as embeddings (`llama_batch.embd`). A stage that is
not the last returns its own residual stream: the graph evaluation callback (`cb_eval`) copies
the output of the stage's last layer (`l_out-{n-1}`) out of every ubatch, and then stops the
graph there, so the unused norm and vocabulary head are never computed. Every row is marked as
an output in such a stage, because llama.cpp prunes the last layer to the output rows. The last
stage computes logits for the rows that sample and returns their greedy tokens.

NOTE: the callback sees ubatches, not the batch. The context uses one KV cache for all its
sequences (`kv_unified`) and a ubatch as large as the batch, so llama.cpp's simple split keeps
batch order and the ubatches are contiguous pieces of the batch in order; a per-sequence cache
would regroup rows by sequence (the order trap of docs/stages.md).

Sequences are llama sequence ids (*lanes*) that the driver assigns; the runner keeps each lane's
next position, rewinds a lane when a row starts before it (a recompute) and refuses a row that
starts past it, before anything is decoded.
"""
from __future__ import annotations

import ctypes
import os
from typing import Any, Callable, Optional, Sequence

import numpy as np

import llama_cpp as _ll

from ..kit import LaneTable, LlamaBatch
from ..llama.backend import KV_TYPES, create_context, init_backend, load_model, recent_log
from ..llama.lanes import KvCells
from ..llama.samplers import Samplers
from ..llama.tokenizer import Tokenizer
from ...sampling import SamplingParams
from .split import StageInfo, read_stage_info


def _ggml_base() -> Any:
    libdir = os.path.join(os.path.dirname(_ll.__file__), "lib")
    for name in ("libggml-base.so", "libggml-base.dylib", "ggml-base.dll"):
        path = os.path.join(libdir, name)
        if os.path.exists(path):
            lib = ctypes.CDLL(path)
            break
    else:  # pragma: no cover - depends on the wheel's layout
        raise RuntimeError(f"libggml-base not found in {libdir}")
    lib.ggml_get_name.argtypes = [ctypes.c_void_p]
    lib.ggml_get_name.restype = ctypes.c_char_p
    lib.ggml_nbytes.argtypes = [ctypes.c_void_p]
    lib.ggml_nbytes.restype = ctypes.c_size_t
    lib.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                            ctypes.c_size_t]
    lib.ggml_backend_tensor_get.restype = None
    return lib


_GGML: Any = None
_NE_OFFSET = 16  # int64 ne[4] follows `type` (int32) and the pointer-aligned `buffer *`


# Memory operation kinds (`apply_ops`).
OP_REMOVE, OP_COPY = 0, 1


class StageError(RuntimeError):
    """A stage could not run a batch (decode failure, a capture of the wrong shape)."""


class StageRunner:
    """One stage model + context executing flat batches (see the module docstring)."""

    def __init__(self, model_path: str | os.PathLike[str], *, n_ctx: int = 4096,
                 n_seq_max: int = 8, n_batch: int = 512, n_threads: int = 2,
                 kv_type: str = "f32", flash_attn: bool = False,
                 offload: Optional[Any] = None) -> None:
        global _GGML
        if kv_type not in KV_TYPES:
            raise ValueError(f"kv_type must be one of {sorted(KV_TYPES)}, got {kv_type!r}")
        for name, v in (("n_ctx", n_ctx), ("n_seq_max", n_seq_max), ("n_batch", n_batch),
                        ("n_threads", n_threads)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if n_seq_max > 256:
            raise ValueError(f"n_seq_max must be <= 256, got {n_seq_max}")
        self.info: StageInfo = read_stage_info(model_path)
        self._model: Any = None
        self._ctx: Any = None
        init_backend()
        if _GGML is None:
            _GGML = _ggml_base()
        # `offload` (hosts.offload.OffloadSpec): this stage's layers on its devices; the one
        # KV cache of the stage is unified (one stream).
        self.placement: Any = None
        try:
            if offload is not None:
                from ..llama.backend import add_rpc_servers, list_devices, no_gpu_reason
                from ..offload import (FitError, ModelFileError, RpcError, footprint_from_gguf,
                                       place)

                try:
                    add_rpc_servers(offload.rpc)
                    self.placement = place(
                        footprint_from_gguf(self.info.path), list_devices(), offload,
                        n_ctx=n_ctx, streams=n_seq_max, unified=True, kv_type=kv_type,
                        n_ubatch=n_batch, flash_attn=bool(flash_attn), no_gpu=no_gpu_reason())
                except (FitError, ModelFileError, RpcError) as exc:
                    raise StageError(f"stage {self.info.index}: {exc}") from None
            self._model = load_model(self.info.path, self.placement)
        except RuntimeError as exc:
            raise StageError(str(exc)) from None
        model = self._model
        self.n_embd = int(_ll.llama_model_n_embd(model))
        self.n_layer = int(_ll.llama_model_n_layer(model))
        # KV bytes one position takes in this stage's cache: K and V of every layer it holds.
        head = self.n_embd // max(1, int(_ll.llama_model_n_head(model)))
        self.kv_bytes_per_token = (self.n_layer * 2 * int(_ll.llama_model_n_head_kv(model))
                                   * head * (4 if kv_type == "f32" else 2))
        self._target = f"l_out-{self.n_layer - 1}".encode()
        vocab = Tokenizer(model)
        self.n_vocab = vocab.n_vocab
        self._eog = vocab.eog
        self.n_batch = n_batch
        self.n_seq_max = n_seq_max
        self.last = self.info.last
        self.first = self.info.first
        # The last stage samples: sequences that are not plain greedy get a sampler chain each,
        # the llama host's (docs/stages.md "Sampling").
        self.samplers: Optional[Samplers] = (
            Samplers(vocab.n_vocab, vocab.eog, vocab.eog_ids, _ll.llama_model_get_vocab(model),
                     max_window=n_ctx)
            if self.last else None)

        # The capture buffer: every batch row's residual stream after the stage's last layer.
        self._act = np.zeros((n_batch, self.n_embd), dtype=np.float32)
        self._act_rows = 0
        self._capture_error: Optional[str] = None
        # One KV cache for all lanes and one ubatch per batch keep the ubatches in batch order.
        self._cb = None if self.last else _ll.ggml_backend_sched_eval_callback(self._on_eval)
        ctx = create_context(model, n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch,
                             sequence_ids=n_seq_max, n_threads=n_threads, kv_type=kv_type,
                             flash_attn=flash_attn, unified=True, cb_eval=self._cb)
        if not ctx:
            self.close()
            raise StageError(f"llama.cpp could not create a context: {recent_log()}")
        self._ctx = ctx
        self._mem = _ll.llama_get_memory(ctx)
        self.n_ctx = int(_ll.llama_n_ctx(ctx))
        # llama.cpp may give a smaller batch than asked (at most the context): plans are sized
        # from what the context got.
        self.n_batch = min(n_batch, int(_ll.llama_n_batch(ctx)))
        # Every sequence id's positions (lanes and holders alike); the driver assigns lanes.
        self._cells = KvCells(ctx)
        self._lanes = LaneTable(n_seq_max, self._cells)
        self._batch = LlamaBatch(n_batch, 0 if self.first else self.n_embd)

    # ------------------------------------------------------------------ capture
    def _on_eval(self, tensor: int, ask: bool, _user: Any) -> bool:
        name = _GGML.ggml_get_name(tensor)
        if ask:
            return bool(name == self._target)
        if name != self._target:
            return True
        try:
            ttype = ctypes.c_int32.from_address(tensor).value
            ne0, ne1 = (ctypes.c_int64 * 2).from_address(tensor + _NE_OFFSET)
            at = self._act_rows
            if ttype != 0 or ne0 != self.n_embd or at + ne1 > self._act.shape[0]:
                self._capture_error = (f"{name.decode()} is type {ttype} with {ne1} x {ne0} "
                                       f"values at row {at}")
                return False
            _GGML.ggml_backend_tensor_get(tensor, self._act[at:].ctypes.data, 0,
                                          _GGML.ggml_nbytes(tensor))
            self._act_rows = at + ne1
        except Exception as exc:  # pragma: no cover - an exception must not cross into C
            self._capture_error = repr(exc)
        # Stop the graph here: the norm and head after the last layer are of no use.
        return False

    # ------------------------------------------------------------------ lanes
    def check_rows(self, lanes: np.ndarray, starts: np.ndarray,
                   held: Optional[Callable[[int], int]] = None) -> None:
        """Refuse rows on unknown lanes, repeated lanes or rows starting past what a lane holds
        (`held(lane)`, default what it holds now)."""
        if len(lanes) and (int(lanes.min()) < 0 or int(lanes.max()) >= self.n_seq_max):
            raise ValueError(f"lanes must be in [0, {self.n_seq_max})")
        if len(np.unique(lanes)) != len(lanes):
            raise ValueError("a lane appears in more than one row")
        if held is None:
            held = self._lanes.end
        for lane, start in zip(lanes.tolist(), starts.tolist()):
            if start > held(lane):
                raise ValueError(f"a row of lane {lane} starts at position {start} but the "
                                 f"stage holds {held(lane)} positions for it")

    def release(self, lane: int) -> None:
        """Drop every KV cell of `lane` (a lane outside the context holds nothing)."""
        if not 0 <= lane < self.n_seq_max:
            return
        self._lanes.cut(lane, 0)  # (no cells once the context is freed)
        if self.samplers is not None:
            self.samplers.drop(lane)

    def rewind(self, lane: int, start: int) -> None:
        """Drop `lane`'s cells from `start` on (the row replays from there)."""
        if self.samplers is not None:
            self.samplers.rewind(lane, start)
        if 0 <= lane < self.n_seq_max and start < self._lanes.end(lane):
            self._lanes.cut(lane, start)

    def check_input(self, n: int, positions: np.ndarray,
                    tokens: Optional[np.ndarray] = None) -> None:
        """Refuse a batch of `n` tokens that this stage cannot take (`run` would refuse it):
        more than its batch, not one position per token, or for a first stage not one token
        id of its vocabulary per position. Nothing is changed."""
        if n < 1 or n > self.n_batch or len(positions) != n:
            raise ValueError(f"a batch holds 1 to {self.n_batch} tokens with one position each;"
                             f" got {n} tokens and {len(positions)} positions")
        if self.first:
            if tokens is None or len(tokens) != n:
                raise ValueError("the first stage takes one token per position")
            if int(tokens.min()) < 0 or int(tokens.max()) >= self.n_vocab:
                raise ValueError(f"tokens must be in [0, {self.n_vocab})")

    def check_ops(self, ops: Any) -> None:
        """Refuse memory operations (see `apply_ops`) that are not lists of five integers,
        name an unknown kind or sequence id, before any of them runs."""
        if not isinstance(ops, list):
            raise ValueError(f"memory operations are a list, got {type(ops).__name__}")
        for op in ops:
            if not (isinstance(op, list) and len(op) == 5
                    and all(isinstance(v, int) and not isinstance(v, bool) for v in op)):
                raise ValueError(f"a memory operation is a list of five integers, got {op!r}")
            if op[0] not in (OP_REMOVE, OP_COPY):
                raise ValueError(f"unknown memory operation {op!r}")
            seqs = op[1:3] if op[0] == OP_COPY else op[1:2]
            if any(not 0 <= s < self.n_seq_max for s in seqs):
                raise ValueError(f"memory operation {op!r} names a sequence id outside "
                                 f"[0, {self.n_seq_max})")
            if op[0] == OP_REMOVE and op[3] != -1:
                raise ValueError(f"a removal keeps a prefix or nothing (open end), got {op!r}")

    def apply_ops(self, ops: list[list[int]]) -> None:
        """Run memory operations in order: [OP_REMOVE, seq, p0, -1, 0] drops seq's positions
        from p0 on (p0 = -1: all); [OP_COPY, src, dst, p0, p1] gives dst src's cells at
        positions [p0, p1) (-1: open end; one KV cache for all, so the cells are shared)."""
        self.check_ops(ops)
        lanes = self._lanes
        for kind, a, b, c, d in ops:
            if kind == OP_REMOVE:
                self._cells.remove(a, b, -1)
                lanes.advance(a, 0 if b <= 0 else min(lanes.end(a), b))
                if b <= 0 and self.samplers is not None:
                    self.samplers.drop(a)  # an emptied lane's sequence is gone
            else:
                self._cells.copy(a, b, c, d)
                held = lanes.end(a) if d < 0 else min(d, lanes.end(a))
                lanes.advance(b, max(lanes.end(b), held))

    def start_sampling(self, lane: int, params: Optional[SamplingParams],
                       prefix: Sequence[int] = ()) -> None:
        """A sequence begins on `lane` (the last stage): its sampler chain (None: greedy).
        `prefix`: the tokens of the positions it restored from a holder, which no plan
        decodes for it; the chain's penalty window takes them first, as after a restore on
        the llama host (the worker checked them against the vocabulary)."""
        if self.samplers is None:
            return
        chain = self.samplers.start(lane, params)
        if chain is not None and len(prefix):
            chain.feed(np.asarray(prefix, dtype=np.int32), 0)

    def held(self, lane: int) -> int:
        """Positions of `lane` in this stage's KV cache."""
        return self._lanes.end(lane)

    def held_lanes(self) -> list[int]:
        return self._lanes.held_lanes()

    def measure_kv(self) -> dict[int, tuple[int, int]]:
        """Sequence id -> (cells, bytes) of every sequence with KV in this stage's cache, as
        llama.cpp counts them: its positions from the cache's lowest to its highest, and the
        size llama.cpp gives that sequence's KV state (K and V of this stage's layers for each
        cell, plus a few bytes of cell metadata and headers). Cells a holder shares with a
        lane count for both."""
        out = {}
        for seq in range(self.n_seq_max):
            hi = int(_ll.llama_memory_seq_pos_max(self._mem, seq))
            if hi < 0:
                continue
            lo = int(_ll.llama_memory_seq_pos_min(self._mem, seq))
            out[seq] = (hi - lo + 1, int(_ll.llama_state_seq_get_size(self._ctx, seq)))
        return out

    # ------------------------------------------------------------------ execution
    def run(self, lanes: np.ndarray, offsets: np.ndarray, positions: np.ndarray,
            sample_rows: np.ndarray, tokens: Optional[np.ndarray] = None,
            embd: Optional[np.ndarray] = None,
            feed_tokens: Optional[np.ndarray] = None) -> np.ndarray:
        """Decode one flat batch of rows (lane per row, row offsets, a position per token);
        tokens for a first stage, `embd` (n, n_embd) float32 for a later one; the last stage
        feeds `feed_tokens` (the rows' input tokens) to its sampler chains.

        Returns the residual stream (n, n_embd) float32, a view valid until the next call, for a
        stage that is not the last; the greedy token of each sampling row (end-of-generation as
        -1) for the last one. A failed decode leaves every lane as it was.
        """
        if not self._ctx:
            raise StageError("the stage is closed")
        n = int(offsets[-1])
        self.check_input(n, positions, tokens)
        starts = positions[offsets[:-1]]
        self.check_rows(lanes, starts)
        batch = self._batch
        if self.first:
            assert tokens is not None
            batch.tok[:n] = tokens
        else:
            if embd is None or embd.shape != (n, self.n_embd) or embd.dtype != np.float32:
                raise ValueError(f"this stage takes ({n}, {self.n_embd}) float32 activations")
            assert batch.embd is not None
            batch.embd[:n] = embd
        for lane, start in zip(lanes.tolist(), starts.tolist()):
            self.rewind(lane, start)
        batch.pos[:n] = positions
        self._act_rows = 0
        self._capture_error = None
        rc = batch.decode(self._ctx, n, np.repeat(lanes.astype(np.int32),
                                                  np.diff(offsets).astype(np.int64)),
                          offsets[sample_rows + 1] - 1 if self.last else None)
        error = f"llama_decode returned {rc}: {recent_log()}" if rc != 0 else None
        if error is None and not self.last and (self._capture_error or self._act_rows != n):
            error = (f"captured {self._act_rows} of {n} rows of {self._target.decode()}"
                     f"{': ' + self._capture_error if self._capture_error else ''}")
        if error is not None:
            for lane, start in zip(lanes.tolist(), starts.tolist()):
                self._lanes.cut(lane, start)
            raise StageError(error)
        ends = positions[offsets[1:] - 1] + 1
        for lane, end in zip(lanes.tolist(), ends.tolist()):
            self._lanes.advance(lane, end)
        if not self.last:
            return self._act[:n]
        samplers = self.samplers
        chains = samplers is not None and len(samplers) > 0
        if chains and feed_tokens is not None:
            samplers.feed(lanes, offsets, feed_tokens, positions)  # type: ignore[union-attr]
        k = len(sample_rows)
        if k == 0:
            return np.zeros(0, dtype=np.int32)
        logits = np.ctypeslib.as_array(_ll.llama_get_logits(self._ctx), shape=(k, self.n_vocab))
        self.last_logits = logits
        out = logits.argmax(axis=1).astype(np.int32)
        if chains:
            samplers.pick(self._ctx, out, logits, None, lanes,  # type: ignore[union-attr]
                          sample_rows, offsets[sample_rows + 1] - 1, batch.pos[:n])
        return np.where(self._eog[out], np.int32(-1), out)

    def close(self) -> None:
        """Free the context, then the model (idempotent)."""
        if getattr(self, "samplers", None) is not None:
            self.samplers.close()  # type: ignore[union-attr]
        if getattr(self, "_cells", None) is not None:
            self._cells.close()
        ctx, self._ctx = self._ctx, None
        if ctx:
            _ll.llama_free(ctx)
        model, self._model = self._model, None
        if model:
            _ll.llama_model_free(model)

    def __enter__(self) -> "StageRunner":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
