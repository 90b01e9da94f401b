"""The per-row llama.cpp calls made in C (`_llama_calls`): they call what they are given, row by
row, in order, check their arguments before calling anything, and seed as `step_seed` does.
The functions here are ctypes callbacks standing where llama.cpp's would be; the backend
sampling tests run the same loops against llama.cpp itself."""
from __future__ import annotations

import ctypes
import random

import numpy as np
import pytest

from skippy_scheduler import _llama_calls
from skippy_scheduler.sampling import step_seed

_READ = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_void_p, ctypes.c_int32)
_INIT = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_uint32)
_COPY = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p)
_FREE = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


def _address(fn: object) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value or 0


def test_sampled_tokens_reads_every_row_in_order_and_counts_the_missing():
    calls: list[tuple[int, int]] = []

    def read(ctx: int, i: int) -> int:
        calls.append((ctx, i))
        return -1 if i % 5 == 4 else 3 * i

    fn = _READ(read)
    rows = np.array([7, 0, 4, 9, 2, 14], dtype=np.int64)
    out = np.full(8, 99, dtype=np.int32)
    missing = _llama_calls.sampled_tokens(_address(fn), 0x1234, rows, out)
    assert calls == [(0x1234, int(r)) for r in rows]
    assert out.tolist() == [21, 0, -1, -1, 6, -1, 99, 99]
    assert missing == 3


def test_sampled_tokens_refuses_before_calling_anything():
    calls: list[int] = []
    fn = _READ(lambda ctx, i: calls.append(i) or 0)
    rows = np.arange(4, dtype=np.int64)
    with pytest.raises(ValueError, match="out holds 3 tokens, 4 rows"):
        _llama_calls.sampled_tokens(_address(fn), 1, rows, np.zeros(3, dtype=np.int32))
    with pytest.raises(ValueError, match="null"):
        _llama_calls.sampled_tokens(_address(fn), 0, rows, np.zeros(4, dtype=np.int32))
    with pytest.raises(ValueError, match="null"):
        _llama_calls.sampled_tokens(0, 1, rows, np.zeros(4, dtype=np.int32))
    assert calls == []


def test_the_c_step_seed_is_the_python_one():
    rng = random.Random(5)
    cases = [(0, 0), (0, -1), ((1 << 64) - 1, 7), (123, 1 << 40)]
    cases += [(rng.randrange(1 << 64), rng.randrange(-1, 1 << 31)) for _ in range(5000)]
    for seed, position in cases:
        assert _llama_calls.step_seed(seed, position) == step_seed(seed, position), \
            (seed, position)


def test_reseed_draws_copies_a_fresh_draw_into_each_sampler_and_frees_it():
    made: list[int] = []
    copied: list[tuple[int, int]] = []
    freed: list[int] = []

    def init(seed: int) -> int:
        made.append(seed)
        return 0x10000 + len(made)  # a distinct fake sampler each time

    def copy(src: int, dst: int) -> None:
        copied.append((src, dst))

    fns = (_INIT(init), _COPY(copy), _FREE(freed.append))
    draws = np.array([0xA0, 0xB0, 0xC0], dtype=np.uint64)
    seeds = np.array([1, 2, (1 << 64) - 3], dtype=np.uint64)
    positions = np.array([5, 0, 300], dtype=np.int64)
    _llama_calls.reseed_draws(*map(_address, fns), draws, seeds, positions)
    assert made == [step_seed(1, 5), step_seed(2, 0), step_seed((1 << 64) - 3, 300)]
    assert copied == [(0x10001, 0xA0), (0x10002, 0xB0), (0x10003, 0xC0)]
    assert freed == [0x10001, 0x10002, 0x10003]


def test_reseed_draws_refuses_mismatched_or_null_arguments_before_calling_anything():
    made: list[int] = []
    fns = tuple(map(_address, (_INIT(lambda s: made.append(s) or 1), _COPY(lambda a, b: None),
                               _FREE(lambda a: None))))
    one = np.ones(1, dtype=np.uint64)
    with pytest.raises(ValueError, match="2 draws, 1 seeds"):
        _llama_calls.reseed_draws(*fns, np.ones(2, dtype=np.uint64), one,
                                  np.zeros(1, dtype=np.int64))
    with pytest.raises(ValueError, match="null sampler"):
        _llama_calls.reseed_draws(*fns, np.array([1, 0], dtype=np.uint64),
                                  np.ones(2, dtype=np.uint64), np.zeros(2, dtype=np.int64))
    with pytest.raises(ValueError, match="null function"):
        _llama_calls.reseed_draws(0, fns[1], fns[2], one, one, np.zeros(1, dtype=np.int64))
    assert made == []


def test_sampled_tokens_reads_the_same_without_releasing_the_gil():
    fn = _READ(lambda ctx, i: 2 * i - 3)
    rows = np.array([0, 5, 1, 9], dtype=np.int64)
    released, held = np.zeros(4, dtype=np.int32), np.zeros(4, dtype=np.int32)
    assert _llama_calls.sampled_tokens(_address(fn), 7, rows, released) == 2
    assert _llama_calls.sampled_tokens(_address(fn), 7, rows, held, release=False) == 2
    assert held.tolist() == released.tolist() == [-3, 7, -1, 15]


class _Batch(ctypes.Structure):  # llama.h's llama_batch
    _fields_ = [("n_tokens", ctypes.c_int32), ("token", ctypes.POINTER(ctypes.c_int32)),
                ("embd", ctypes.POINTER(ctypes.c_float)), ("pos", ctypes.POINTER(ctypes.c_int32)),
                ("n_seq_id", ctypes.POINTER(ctypes.c_int32)),
                ("seq_id", ctypes.POINTER(ctypes.POINTER(ctypes.c_int32))),
                ("logits", ctypes.POINTER(ctypes.c_int8))]


_DECODE = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_void_p, _Batch)
_POINTER = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)


@pytest.mark.parametrize("rc", [0, 1, -2])
def test_decode_synced_passes_the_batch_and_reads_the_outputs_only_after_a_decode_that_worked(rc):
    calls: list[tuple] = []
    tokens = (ctypes.c_int32 * 3)(11, 12, 13)

    def decode(ctx: int, batch: _Batch) -> int:
        calls.append(("decode", ctx, batch.n_tokens, [batch.token[i] for i in range(3)]))
        return rc

    fns = (_DECODE(decode), _POINTER(lambda ctx: calls.append(("outputs", ctx)) or 0xF00D))
    batch = _Batch(n_tokens=3, token=tokens)
    got = _llama_calls.decode_synced(_address(fns[0]), _address(fns[1]), 0x55,
                                     ctypes.addressof(batch))
    assert got == (rc, 0xF00D if rc == 0 else 0)
    expected = [("decode", 0x55, 3, [11, 12, 13])] + ([("outputs", 0x55)] if rc == 0 else [])
    assert calls == expected


def test_decode_synced_refuses_nulls_before_calling_anything():
    calls: list[int] = []
    decode = _DECODE(lambda ctx, batch: calls.append(1) or 0)
    outputs = _POINTER(lambda ctx: calls.append(2) or 0)
    batch = _Batch()
    for args in [(0, _address(outputs), 1, ctypes.addressof(batch)),
                 (_address(decode), 0, 1, ctypes.addressof(batch)),
                 (_address(decode), _address(outputs), 0, ctypes.addressof(batch)),
                 (_address(decode), _address(outputs), 1, 0)]:
        with pytest.raises(ValueError, match="null"):
            _llama_calls.decode_synced(*args)
    assert calls == []


_SEQ_RM = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32,
                           ctypes.c_int32)


_SEQ_CP = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32,
                           ctypes.c_int32)


def test_remove_range_and_copy_range_call_through_with_their_arguments():
    calls: list[tuple] = []
    rm = _SEQ_RM(lambda mem, seq, p0, p1: calls.append(("rm", mem, seq, p0, p1)) or seq > 0)
    cp = _SEQ_CP(lambda mem, src, dst, p0, p1: calls.append(("cp", mem, src, dst, p0, p1)))
    assert _llama_calls.remove_range(_address(rm), 0x9, 2, -1, -1) is True
    assert _llama_calls.remove_range(_address(rm), 0x9, 0, 5, 9) is False
    _llama_calls.copy_range(_address(cp), 0x9, 3, 7, 0, 128)
    assert calls == [("rm", 0x9, 2, -1, -1), ("rm", 0x9, 0, 5, 9), ("cp", 0x9, 3, 7, 0, 128)]
    for call in (lambda: _llama_calls.remove_range(0, 0x9, 1, 0, 1),
                 lambda: _llama_calls.remove_range(_address(rm), 0, 1, 0, 1),
                 lambda: _llama_calls.copy_range(0, 0x9, 1, 2, 0, 1),
                 lambda: _llama_calls.copy_range(_address(cp), 0, 1, 2, 0, 1)):
        with pytest.raises(ValueError, match="null"):
            call()
    assert len(calls) == 3
