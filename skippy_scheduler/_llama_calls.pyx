# cython: language_level=3, boundscheck=False, wraparound=False
"""llama.cpp calls made from C: a step's per-row calls in one pass, and the GIL given up once
a step.

A llama.cpp function called through ctypes releases the GIL before the call and takes it back
after. When another thread runs Python meanwhile (the server's event loop, writing a step's
tokens), taking it back waits until that thread lets go: at the next blocking call it makes, or
after the interpreter's switch interval (5 ms by default). One such wait a step is the price of
`llama_decode`; one per row (the device's sampled token of each row read through ctypes) puts
that wait on the step's critical path once for every row. Here the loop over the rows runs in
C: the GIL is released once for all of them and taken back once. And since `llama_decode`
returns before a GPU has finished (the first read of an output waits for it, and puts the
outputs in batch order), `decode_synced` runs the decode and that first read
(`llama_get_logits`) under one release: after it every read of the step's outputs is a lookup,
made here without giving the GIL up at all (`sampled_tokens` with `release=False`).

The functions are llama-cpp-python's own bindings, called at their addresses (the library is
the one those bindings loaded; nothing here links against it).
"""
from libc.stdint cimport int8_t, int32_t, int64_t, uint8_t, uint32_t, uint64_t, uintptr_t

ctypedef int32_t (*sampled_token_fn)(void *ctx, int32_t i) noexcept nogil


cdef inline int _read_rows(sampled_token_fn call, void *ctx, const int64_t[::1] rows,
                           int32_t[::1] out) noexcept nogil:
    cdef Py_ssize_t j
    cdef int missing = 0
    cdef int32_t t
    for j in range(rows.shape[0]):
        t = call(ctx, <int32_t> rows[j])
        out[j] = t
        if t < 0:
            missing += 1
    return missing


def sampled_tokens(uintptr_t fn, uintptr_t ctx, const int64_t[::1] rows,
                   int32_t[::1] out, bint release=True) -> int:
    """`out[j] = fn(ctx, rows[j])` for every j (`fn`: the address of
    `llama_get_sampled_token_ith`), with the GIL released once, or (`release=False`, for
    outputs already synchronized, where each call is a lookup) not at all; returns how many
    are negative (rows whose chain the device did not finish)."""
    cdef Py_ssize_t n = rows.shape[0]
    cdef int missing
    cdef sampled_token_fn call = <sampled_token_fn> fn
    if out.shape[0] < n:
        raise ValueError(f"out holds {out.shape[0]} tokens, {n} rows to read")
    if fn == 0 or ctx == 0:
        raise ValueError("a null function or context")
    if release:
        with nogil:
            missing = _read_rows(call, <void *> ctx, rows, out)
    else:
        missing = _read_rows(call, <void *> ctx, rows, out)
    return missing


ctypedef struct llama_batch_t:  # llama.h's llama_batch, passed by value
    int32_t n_tokens
    int32_t *token
    float *embd
    int32_t *pos
    int32_t *n_seq_id
    int32_t **seq_id
    int8_t *logits

ctypedef int32_t (*decode_fn)(void *ctx, llama_batch_t batch) noexcept nogil
ctypedef void *(*pointer_fn)(void *ctx) noexcept nogil


def decode_synced(uintptr_t decode, uintptr_t outputs, uintptr_t ctx,
                  uintptr_t batch) -> tuple:
    """`decode(ctx, *batch)` (`llama_decode`, `batch` the address of a `llama_batch`) and,
    when it returned 0, `outputs(ctx)` (`llama_get_logits`: it waits for the device and puts
    the outputs in batch order), with the GIL released once for both: the step's outputs are
    ready, in order, when this returns. Returns (the decode's code, the logits' address: 0
    when the decode failed or llama.cpp keeps no logits)."""
    cdef decode_fn run = <decode_fn> decode
    cdef pointer_fn ready = <pointer_fn> outputs
    cdef llama_batch_t *b = <llama_batch_t *> batch
    cdef int32_t rc
    cdef void *logits = NULL
    if decode == 0 or outputs == 0 or ctx == 0 or batch == 0:
        raise ValueError("a null function, context or batch")
    with nogil:
        rc = run(<void *> ctx, b[0])
        if rc == 0:
            logits = ready(<void *> ctx)
    return rc, <uintptr_t> logits


ctypedef uint8_t (*seq_rm_fn)(void *mem, int32_t seq, int32_t p0, int32_t p1) noexcept nogil


def remove_range(uintptr_t fn, uintptr_t mem, int32_t seq, int32_t p0, int32_t p1) -> bool:
    """`fn(mem, seq, p0, p1)` (`llama_memory_seq_rm`) without giving the GIL up; its answer."""
    cdef seq_rm_fn call = <seq_rm_fn> fn
    if fn == 0 or mem == 0:
        raise ValueError("a null function or memory")
    return call(<void *> mem, seq, p0, p1) != 0


ctypedef void (*seq_cp_fn)(void *mem, int32_t src, int32_t dst, int32_t p0,
                           int32_t p1) noexcept nogil


def copy_range(uintptr_t fn, uintptr_t mem, int32_t src, int32_t dst, int32_t p0,
               int32_t p1) -> None:
    """`fn(mem, src, dst, p0, p1)` (`llama_memory_seq_cp`: it walks the cells on the host; a
    copy of a KV stream happens at the next decode) without giving the GIL up."""
    cdef seq_cp_fn call = <seq_cp_fn> fn
    if fn == 0 or mem == 0:
        raise ValueError("a null function or memory")
    call(<void *> mem, src, dst, p0, p1)


ctypedef void *(*init_dist_fn)(uint32_t seed) noexcept nogil
ctypedef void (*copy_fn)(void *src, void *dst) noexcept nogil
ctypedef void (*free_fn)(void *smpl) noexcept nogil


cdef inline uint32_t _step_seed(uint64_t seed, int64_t position) noexcept nogil:
    # splitmix64 of the seed and the position, as sampling.step_seed computes it
    cdef uint64_t x = seed + <uint64_t> (position + 1) * 0x9E3779B97F4A7C15ULL
    cdef uint32_t s
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL
    x ^= x >> 31
    s = <uint32_t> (x >> 32)
    return s if s != 0xFFFFFFFFU else 0xFFFFFFFEU


def step_seed(uint64_t seed, int64_t position) -> int:
    """`sampling.step_seed` computed here, for a seed in [0, 2**64) (mask a larger or negative
    one with `& (2**64 - 1)` first: `step_seed` takes it modulo 2**64)."""
    return _step_seed(seed, position)


def reseed_draws(uintptr_t init, uintptr_t copy, uintptr_t free,
                 const uint64_t[::1] draws, const uint64_t[::1] seeds,
                 const int64_t[::1] positions) -> None:
    """For every i: the `dist` sampler at address `draws[i]` takes the state of a fresh one
    seeded `step_seed(seeds[i], positions[i])` (`init`, `copy`, `free`: the addresses of
    `llama_sampler_init_dist`, `llama_sampler_copy` and `llama_sampler_free`), with the GIL
    released once."""
    cdef Py_ssize_t n = draws.shape[0], i
    cdef init_dist_fn make = <init_dist_fn> init
    cdef copy_fn take = <copy_fn> copy
    cdef free_fn drop = <free_fn> free
    cdef void *fresh
    cdef int failed = 0
    if seeds.shape[0] != n or positions.shape[0] != n:
        raise ValueError(f"{n} draws, {seeds.shape[0]} seeds, {positions.shape[0]} positions")
    if init == 0 or copy == 0 or free == 0:
        raise ValueError("a null function")
    for i in range(n):
        if draws[i] == 0:
            raise ValueError(f"draw {i} is a null sampler")
    with nogil:
        for i in range(n):
            fresh = make(_step_seed(seeds[i], positions[i]))
            if fresh == NULL:
                failed = 1
                break
            take(fresh, <void *> <uintptr_t> draws[i])
            drop(fresh)
    if failed:
        raise MemoryError("llama.cpp could not make a dist sampler")
