# cython: language_level=3, boundscheck=False, wraparound=False
"""Native waiting-work ranking (behaviour.md §3) for Python callers.

Candidates are validated and packed once into a contiguous item array plus one int32 token
arena; the kernel then runs without the GIL. `PackedCandidates` keeps the packing so that a
caller (or a benchmark) can rank the same queue several times without converting tokens again.
"""
from cpython.mem cimport PyMem_Malloc, PyMem_Free
from libc.stdint cimport INT32_MAX, INT32_MIN, int32_t, uint32_t, uint64_t
from libc.stdlib cimport free
from libc.string cimport memcpy

from ._boundary cimport SCAN_OK, as_int, check_u64, scan_exact_ints
from ._sk_grow cimport sk_grow
from ._sk_rank cimport *

MODE_CACHE_AWARE = SK_RANK_CACHE_AWARE
MODE_FCFS = SK_RANK_FCFS
MODE_PRIORITY = SK_RANK_PRIORITY

# The kernels' failure codes (sk_rank.h: the scheduler's SKIPPY_SCHED_INVALID / _NO_MEMORY).
cdef enum:
    _RANK_INVALID = 4
    _RANK_NO_MEMORY = 7

cdef object USIZE_MAX = (1 << 64) - 1


cdef Py_ssize_t _fill_tokens(object tokens, int32_t *dst, Py_ssize_t room) except -1:
    """Copies a prompt into dst (room tokens) after checking every value is an i32."""
    cdef Py_ssize_t i = 0, bad = 0
    cdef const int[::1] view
    if type(tokens) is list or type(tokens) is tuple:
        if len(tokens) <= room and scan_exact_ints(tokens, len(tokens), dst, INT32_MIN,
                                                   &bad) == SCAN_OK:
            return len(tokens)
        tokens = list(tokens)  # checked path on a private copy: reports the bad element
    if isinstance(tokens, (list, tuple)):
        for item in tokens:
            if i >= room:
                raise ValueError("prompt_tokens changed size while being read")
            item = as_int("prompt token", item)
            if item < INT32_MIN or item > INT32_MAX:
                raise ValueError(f"prompt token {item} is outside the i32 range")
            dst[i] = <int32_t>item
            i += 1
        return i
    try:
        view = tokens
    except (TypeError, ValueError, BufferError):
        return _fill_tokens(list(tokens), dst, room)
    if view.shape[0] > room:
        raise ValueError("prompt_tokens changed size while being read")
    if view.shape[0]:
        memcpy(dst, &view[0], view.shape[0] * sizeof(int32_t))
    return view.shape[0]


cdef uint64_t _deadline_key(object ttft_deadline) except? 0:
    """The kernel's key of a TTFT deadline in seconds (None = none; docs/behaviour.md §3.3a)."""
    from .cache_policy import ttft_deadline_key
    return ttft_deadline_key(ttft_deadline)


cdef int _check_kernel(int rc) except -1:
    """Errors of the one-shot kernel (sk_rank_order)."""
    if rc == _RANK_NO_MEMORY:
        raise MemoryError()
    if rc != 0:
        raise ValueError(f"ranking kernel rejected the input (code {rc})")
    return 0


cdef class PackedCandidates:
    """Validated native copy of a candidate list; `order()` ranks it, best first."""
    cdef sk_rank_item *items
    cdef int32_t *arena
    cdef size_t *out
    cdef sk_rank_ws *ws
    cdef Py_ssize_t n
    cdef list indices

    def __cinit__(self):
        self.items = NULL
        self.arena = NULL
        self.out = NULL
        self.ws = NULL
        self.n = 0

    def __init__(self, candidates):
        cdef list cands = list(candidates)
        cdef Py_ssize_t n = len(cands), i, total = 0, at = 0, got
        cdef list prompts = []
        cdef list indices = []
        cdef list deadlines = []
        from .cache_policy import CacheAffinity, ttft_deadline_key
        if self.items != NULL:
            raise RuntimeError("PackedCandidates is already initialised")
        for c in cands:
            indices.append(check_u64("index", c.index, USIZE_MAX))
            check_u64("priority", c.priority)
            check_u64("enqueued_turn", c.enqueued_turn)
            check_u64("order", c.order)
            if not isinstance(c.affinity, CacheAffinity):
                raise TypeError("affinity must be a CacheAffinity")
            p = c.prompt_tokens
            if isinstance(p, (str, bytes)) or not hasattr(p, "__len__"):
                raise TypeError("prompt_tokens must be a sequence of ints")
            prompts.append(p)
            deadlines.append(ttft_deadline_key(getattr(c, "ttft_deadline", None)))
            total += len(p)
        self.items = <sk_rank_item *>PyMem_Malloc((n if n else 1) * sizeof(sk_rank_item))
        self.arena = <int32_t *>PyMem_Malloc((total if total else 1) * sizeof(int32_t))
        self.out = <size_t *>PyMem_Malloc((n if n else 1) * sizeof(size_t))
        self.ws = sk_rank_ws_new()
        if not self.items or not self.arena or not self.out or not self.ws:
            raise MemoryError()
        for i in range(n):
            c = cands[i]
            got = _fill_tokens(prompts[i], self.arena + at, total - at)
            if got != len(prompts[i]):
                raise ValueError("prompt_tokens changed size while being read")
            self.items[i].priority = c.priority
            self.items[i].saved_cost = c.affinity.estimated_saved_cost()
            self.items[i].enqueued_turn = c.enqueued_turn
            self.items[i].order = c.order
            self.items[i].tokens = self.arena + at
            self.items[i].token_count = got
            self.items[i].deadline = deadlines[i]
            at += got
        self.n = n
        self.indices = indices

    def __dealloc__(self):
        PyMem_Free(self.items)
        PyMem_Free(self.arena)
        PyMem_Free(self.out)
        if self.ws:
            sk_rank_ws_free(self.ws)

    def __len__(self):
        return self.n

    cdef int _run(self, uint64_t turn, uint64_t aging, bint grouping, int mode) except -1:
        cdef int rc
        with nogil:
            rc = sk_rank_order(self.ws, self.items, <size_t>self.n, turn, aging, grouping, mode,
                               self.out)
        return _check_kernel(rc)

    def order(self, current_turn, aging_cost_per_turn, group_waiting_prefixes,
              int mode=MODE_CACHE_AWARE):
        """The candidates' `index` values, best first."""
        self._run(check_u64("current_turn", current_turn),
                  check_u64("aging_cost_per_turn", aging_cost_per_turn),
                  bool(group_waiting_prefixes), mode)
        cdef Py_ssize_t i
        cdef list idx = self.indices
        return [idx[self.out[i]] for i in range(self.n)]

    def positions(self, current_turn, aging_cost_per_turn, group_waiting_prefixes,
                  int mode=MODE_CACHE_AWARE):
        """Input positions (0..n-1), best first."""
        self._run(check_u64("current_turn", current_turn),
                  check_u64("aging_cost_per_turn", aging_cost_per_turn),
                  bool(group_waiting_prefixes), mode)
        cdef Py_ssize_t i
        return [self.out[i] for i in range(self.n)]

    def rank_only(self, uint64_t current_turn, uint64_t aging_cost_per_turn,
                  bint group_waiting_prefixes, int mode=MODE_CACHE_AWARE):
        """Runs the kernel and keeps the result native (for timing the kernel alone)."""
        self._run(current_turn, aging_cost_per_turn, group_waiting_prefixes, mode)


def order_candidates(candidates, current_turn, aging_cost_per_turn, group_waiting_prefixes,
                     int mode=MODE_CACHE_AWARE):
    """Validates, packs and ranks candidates; returns their `index` values best first."""
    turn = check_u64("current_turn", current_turn)
    aging = check_u64("aging_cost_per_turn", aging_cost_per_turn)
    return PackedCandidates(candidates).order(turn, aging, group_waiting_prefixes, mode)


cdef class RankSlots:
    """A growable native array of rank items, each owning its converted prompt.

    Used by queues that rank the same entries repeatedly: a prompt is validated and converted
    once, on `append`; `order()` then only crosses into the kernel.
    """
    cdef sk_rank_item *items
    cdef size_t *out
    cdef sk_rank_ws *ws
    cdef Py_ssize_t n
    cdef size_t cap, out_cap

    def __cinit__(self):
        self.items = NULL
        self.out = NULL
        self.n = 0
        self.cap = 0
        self.out_cap = 0
        self.ws = sk_rank_ws_new()
        if not self.ws:
            raise MemoryError()

    def __dealloc__(self):
        cdef Py_ssize_t i
        for i in range(self.n):
            PyMem_Free(<void *>self.items[i].tokens)
        free(self.items)
        free(self.out)
        sk_rank_ws_free(self.ws)

    def __len__(self):
        return self.n

    cdef int _reserve_one(self) except -1:
        """Room for one more item (and its entry in the kernel's output)."""
        if (sk_grow(<void **>&self.items, &self.cap, <size_t>self.n + 1, sizeof(sk_rank_item))
                or sk_grow(<void **>&self.out, &self.out_cap, self.cap, sizeof(size_t))):
            raise MemoryError()
        return 0

    def append(self, priority, saved_cost, enqueued_turn, order, prompt_tokens,
               ttft_deadline=None):
        """Validates everything, then appends one item at the end."""
        cdef uint64_t dl = _deadline_key(ttft_deadline)
        cdef uint64_t pr = check_u64("priority", priority)
        cdef uint64_t sv = check_u64("saved_cost", saved_cost)
        cdef uint64_t tu = check_u64("enqueued_turn", enqueued_turn)
        cdef uint64_t od = check_u64("order", order)
        if isinstance(prompt_tokens, (str, bytes)) or not hasattr(prompt_tokens, "__len__"):
            raise TypeError("prompt_tokens must be a sequence of ints")
        cdef Py_ssize_t length = len(prompt_tokens), got
        cdef int32_t *buf = <int32_t *>PyMem_Malloc((length if length else 1) * sizeof(int32_t))
        if not buf:
            raise MemoryError()
        try:
            got = _fill_tokens(prompt_tokens, buf, length)
            if got != length:
                raise ValueError("prompt_tokens changed size while being read")
            self._reserve_one()
        except BaseException:
            PyMem_Free(buf)
            raise
        self.items[self.n].priority = pr
        self.items[self.n].saved_cost = sv
        self.items[self.n].enqueued_turn = tu
        self.items[self.n].order = od
        self.items[self.n].tokens = buf
        self.items[self.n].token_count = <size_t>length
        self.items[self.n].deadline = dl
        self.n += 1

    def set_saved_cost(self, Py_ssize_t i, saved_cost):
        if i < 0 or i >= self.n:
            raise IndexError(i)
        self.items[i].saved_cost = check_u64("saved_cost", saved_cost)

    def pop(self):
        """Removes the last item."""
        if self.n == 0:
            raise IndexError("pop from empty RankSlots")
        self.n -= 1
        PyMem_Free(<void *>self.items[self.n].tokens)

    def reverse_to(self, list positions):
        """Reorders the items so that slot i holds the item at positions[n - 1 - i].

        positions must be a permutation of range(n), as order() returns."""
        cdef Py_ssize_t i, p
        cdef sk_rank_item *tmp
        if len(positions) != self.n:
            raise ValueError("positions must be a permutation of the slots")
        seen = bytearray(self.n)
        for p in positions:
            if p < 0 or p >= self.n or seen[p]:
                raise ValueError("positions must be a permutation of the slots")
            seen[p] = 1
        tmp = <sk_rank_item *>PyMem_Malloc((self.n if self.n else 1) * sizeof(sk_rank_item))
        if not tmp:
            raise MemoryError()
        for i in range(self.n):
            tmp[i] = self.items[<Py_ssize_t>positions[self.n - 1 - i]]
        memcpy(self.items, tmp, self.n * sizeof(sk_rank_item))
        PyMem_Free(tmp)

    def order(self, uint64_t current_turn, uint64_t aging_cost_per_turn,
              bint group_waiting_prefixes, int mode=MODE_CACHE_AWARE):
        """Slot positions, best first."""
        cdef int rc
        cdef Py_ssize_t i
        with nogil:
            rc = sk_rank_order(self.ws, self.items, <size_t>self.n, current_turn,
                               aging_cost_per_turn, group_waiting_prefixes, mode, self.out)
        _check_kernel(rc)
        return [self.out[i] for i in range(self.n)]


cdef int _check_rc(int rc) except -1:
    """Errors of the ranked set (sk_rank_set_*)."""
    if rc == _RANK_NO_MEMORY:
        raise MemoryError()
    if rc == _RANK_INVALID:
        raise ValueError("unknown handle or ranking mode")
    if rc != 0:
        raise RuntimeError(f"ranking kernel failed (code {rc})")
    return 0


cdef class RankSet:
    """Persistent ranked set (sk_rank_set): add/remove items, rank the live ones cheaply.

    `add` returns a handle; `order()` returns live handles best first, in the order
    `PackedCandidates` would give for the live items listed in the order they were added.
    """
    cdef sk_rank_set *s
    cdef dict buffers  # handle -> address of the int32 copy of its prompt
    cdef uint32_t *out
    cdef size_t out_cap

    def __cinit__(self):
        self.s = sk_rank_set_new()
        self.buffers = {}
        self.out = NULL
        self.out_cap = 0
        if not self.s:
            raise MemoryError()

    def __dealloc__(self):
        if self.s:
            sk_rank_set_free(self.s)
        if self.buffers:
            for address in self.buffers.values():
                PyMem_Free(<void *><size_t>address)
        free(self.out)

    def __len__(self):
        return sk_rank_set_size(self.s)

    def add(self, priority, saved_cost, enqueued_turn, order, prompt_tokens, ttft_deadline=None):
        cdef sk_rank_item item
        cdef uint32_t handle
        cdef int rc
        item.deadline = _deadline_key(ttft_deadline)
        item.priority = check_u64("priority", priority)
        item.saved_cost = check_u64("saved_cost", saved_cost)
        item.enqueued_turn = check_u64("enqueued_turn", enqueued_turn)
        item.order = check_u64("order", order)
        if isinstance(prompt_tokens, (str, bytes)) or not hasattr(prompt_tokens, "__len__"):
            raise TypeError("prompt_tokens must be a sequence of ints")
        cdef Py_ssize_t length = len(prompt_tokens)
        cdef int32_t *buf = <int32_t *>PyMem_Malloc((length if length else 1) * sizeof(int32_t))
        if not buf:
            raise MemoryError()
        try:
            if _fill_tokens(prompt_tokens, buf, length) != length:
                raise ValueError("prompt_tokens changed size while being read")
            item.tokens = buf
            item.token_count = <size_t>length
            with nogil:
                rc = sk_rank_set_add(self.s, &item, &handle)
            _check_rc(rc)
        except BaseException:
            PyMem_Free(buf)
            raise
        self.buffers[handle] = <size_t>buf
        return handle

    def remove(self, uint32_t handle):
        if handle not in self.buffers:
            raise KeyError(handle)
        _check_rc(sk_rank_set_remove(self.s, handle))
        PyMem_Free(<void *><size_t>self.buffers.pop(handle))

    def update(self, uint32_t handle, priority, saved_cost, enqueued_turn):
        if handle not in self.buffers:
            raise KeyError(handle)
        _check_rc(sk_rank_set_update(self.s, handle, check_u64("priority", priority),
                                     check_u64("saved_cost", saved_cost),
                                     check_u64("enqueued_turn", enqueued_turn)))

    cdef int _run(self, uint64_t turn, uint64_t aging, bint grouping, int mode) except -1:
        cdef int rc
        if sk_grow(<void **>&self.out, &self.out_cap, sk_rank_set_size(self.s), sizeof(uint32_t)):
            raise MemoryError()
        with nogil:
            rc = sk_rank_set_order(self.s, turn, aging, grouping, mode, self.out)
        return _check_rc(rc)

    def order(self, current_turn, aging_cost_per_turn, group_waiting_prefixes,
              int mode=MODE_CACHE_AWARE):
        """Live handles, best first."""
        self._run(check_u64("current_turn", current_turn),
                  check_u64("aging_cost_per_turn", aging_cost_per_turn),
                  bool(group_waiting_prefixes), mode)
        cdef Py_ssize_t i
        return [self.out[i] for i in range(sk_rank_set_size(self.s))]

    def rank_only(self, uint64_t current_turn, uint64_t aging_cost_per_turn,
                  bint group_waiting_prefixes, int mode=MODE_CACHE_AWARE):
        """Ranks and keeps the result native (for timing the kernel alone)."""
        self._run(current_turn, aging_cost_per_turn, group_waiting_prefixes, mode)
