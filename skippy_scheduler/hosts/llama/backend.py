"""llama.cpp's process-wide setup (the backend, the log sink), loading, contexts, checks.

llama.cpp logs through one process-wide callback. The sink keeps warnings and errors (and their
continuation lines) in a short ring, so an error message can say what llama.cpp complained
about; the INFO metadata dump a model load prints would drown a terminal and is dropped.
"""
from __future__ import annotations

import collections
import ctypes
from typing import Any

import numpy as np

import llama_cpp as _ll

# ggml log levels as llama.cpp emits them: DEBUG 1, INFO 2, WARN 3, ERROR 4, CONT 5 (the
# Python binding's own constants are off by one).
_LOG_WARN, _LOG_ERROR, _LOG_CONT = 3, 4, 5
_recent_log: collections.deque[str] = collections.deque(maxlen=64)
_log_keep_continuation = False

KV_TYPES = {"f32": 0, "f16": 1}  # ggml_type values of GGML_TYPE_F32 / GGML_TYPE_F16


@_ll.llama_log_callback  # type: ignore[untyped-decorator, unused-ignore]
def _log_sink(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    global _log_keep_continuation
    if level == _LOG_CONT:
        keep = _log_keep_continuation
    else:
        keep = level in (_LOG_WARN, _LOG_ERROR)
        _log_keep_continuation = keep
    if keep:
        _recent_log.append(text.decode("utf-8", "replace"))


_backend_ready = False


def init_backend() -> None:
    global _backend_ready
    if not _backend_ready:
        _ll.llama_log_set(_log_sink, ctypes.c_void_p(0))
        _ll.llama_backend_init()
        _backend_ready = True


def recent_log(n: int = 8) -> str:
    """The last `n` warning/error lines llama.cpp logged (for diagnostics)."""
    return "".join(list(_recent_log)[-n:]).strip()


def load_model(path: str) -> Any:
    """The model at `path`, on the CPU; RuntimeError with llama.cpp's complaint otherwise."""
    mparams = _ll.llama_model_default_params()
    mparams.n_gpu_layers = 0
    model = _ll.llama_model_load_from_file(path.encode(), mparams)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {path}: {recent_log()}")
    return model


def create_context(model: Any, *, n_ctx: int, n_batch: int, n_ubatch: int, sequence_ids: int,
                   n_threads: int, kv_type: str, flash_attn: bool, unified: bool,
                   cb_eval: Any = None) -> Any:
    """A context as asked (NULL when llama.cpp cannot make one); it may get less than asked,
    so read its sizes back (`llama_n_batch`, `llama_n_ctx`, ...). `cb_eval`: a graph
    evaluation callback (`ggml_backend_sched_eval_callback`; the caller keeps it alive)."""
    # Fields are set by name: the struct layout changes between llama.cpp versions.
    cparams = _ll.llama_context_default_params()
    cparams.n_ctx = n_ctx
    cparams.n_batch = n_batch
    cparams.n_ubatch = n_ubatch
    cparams.n_seq_max = sequence_ids
    # NOTE: llama.cpp reserves one output row per sequence id at creation and asserts that
    # this fits its output limit, which defaults to n_batch: with fewer batch tokens than
    # sequence ids (a 3-token batch over 4 lanes) the context aborts the process. A plan
    # never samples more rows than it has tokens, so raising the limit to the id count only
    # sizes the reserve llama.cpp makes anyway.
    cparams.n_outputs_max = max(n_batch, sequence_ids)
    cparams.n_threads = n_threads
    cparams.n_threads_batch = n_threads
    cparams.flash_attn_type = 1 if flash_attn else 0
    cparams.type_k = KV_TYPES[kv_type]
    cparams.type_v = KV_TYPES[kv_type]
    cparams.kv_unified = unified
    cparams.embeddings = False
    cparams.no_perf = True
    if cb_eval is not None:
        cparams.cb_eval = cb_eval
        cparams.cb_eval_user_data = None
    return _ll.llama_init_from_model(model, cparams)


def check_int(name: str, value: object, lo: int, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    value = int(value)
    if value < lo or (hi is not None and value > hi):
        bound = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise ValueError(f"{name} must be {bound}, got {value}")
    return value
