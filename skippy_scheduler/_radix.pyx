# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False
"""Binding of the native unified radix cache (csrc/sk_radix.*, behaviour.md §8).

The tree stores 64-bit handles; this module keeps the Python values alive in a dict keyed by
handle and drops them on removal, eviction or replacement. Arguments are validated here, then
each call crosses into C once. Token keys are either an int32 buffer (numpy int32 arrays,
array('i')), used without copying, or a sequence of ints converted into a reusable scratch.
"""
from cpython.buffer cimport (PyBUF_C_CONTIGUOUS, PyBUF_FORMAT, PyBuffer_Release,
                             PyObject_CheckBuffer, PyObject_GetBuffer)
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.sequence cimport PySequence_Fast, PySequence_Fast_GET_SIZE
from cpython.unicode cimport PyUnicode_AsUTF8AndSize, PyUnicode_DecodeUTF8
from libc.stdint cimport INT32_MIN, int32_t, uint32_t, uint64_t
from libc.stdlib cimport free

import sys

from ._boundary cimport SCAN_OUT_OF_RANGE, as_int, check_u64, scan_exact_ints
from ._sk_grow cimport sk_grow
from ._sk_radix cimport *

EMPTY_KEY_MESSAGE = "radix cache key must contain at least one token"
ACTIVE_MESSAGE = "cannot replace an active resident radix entry"
STATS_FIELDS = (
    "namespaces", "nodes", "token_edges", "splits",
    "resident_entries", "resident_tokens", "resident_logical_bytes", "resident_active_refs",
    "recurrent_entries", "recurrent_logical_bytes", "recurrent_active_refs",
    "resident_evictions", "recurrent_evictions",
)
cdef uint64_t U64_MAX = 0xFFFFFFFFFFFFFFFF
cdef bint _LITTLE_ENDIAN = sys.byteorder == "little"


cdef class RadixMatch:
    """A prefix hit: `matched_tokens` of the query can be restored from the entry whose own
    key has `stored_tokens` tokens (resident entries may be longer than the match and are then
    sliced). `stored_key` is that entry's key (the key `release_*` takes)."""

    cdef readonly size_t matched_tokens
    cdef readonly size_t stored_tokens
    cdef readonly uint64_t logical_bytes
    cdef readonly uint32_t active_refs
    cdef readonly object value
    cdef bytes _key  # int32 native-endian, decoded on demand

    def __init__(self, matched_tokens, stored_tokens, logical_bytes, active_refs, value,
                 stored_key=()):
        self.matched_tokens = matched_tokens
        self.stored_tokens = stored_tokens
        self.logical_bytes = logical_bytes
        self.active_refs = active_refs
        self.value = value
        self._key = _pack_tokens(stored_key)

    @property
    def stored_key(self):
        return _tokens_tuple(<const int32_t *>PyBytes_AS_STRING(self._key),
                             <size_t>PyBytes_GET_SIZE(self._key) // 4)

    def _fields(self):
        return (self.matched_tokens, self.stored_tokens, self.logical_bytes, self.active_refs,
                self.value, self._key)

    def __eq__(self, other):
        if not isinstance(other, RadixMatch):
            return NotImplemented
        return self._fields() == (<RadixMatch>other)._fields()

    __hash__ = None

    def __repr__(self):
        return (f"RadixMatch(matched_tokens={self.matched_tokens}, "
                f"stored_tokens={self.stored_tokens}, logical_bytes={self.logical_bytes}, "
                f"active_refs={self.active_refs}, value={self.value!r})")


cdef class RadixEntry:
    """One stored entry as the LRU scan, eviction and `remove_*_where` report it."""

    cdef readonly str namespace
    cdef readonly tuple tokens
    cdef readonly uint64_t logical_bytes
    cdef readonly uint64_t last_used
    cdef readonly object value

    def __init__(self, str namespace, tokens, logical_bytes, last_used, value):
        self.namespace = namespace
        self.tokens = tuple(tokens)
        self.logical_bytes = logical_bytes
        self.last_used = last_used
        self.value = value

    def _fields(self):
        return (self.namespace, self.tokens, self.logical_bytes, self.last_used, self.value)

    def __eq__(self, other):
        if not isinstance(other, RadixEntry):
            return NotImplemented
        return self._fields() == (<RadixEntry>other)._fields()

    __hash__ = None

    def __repr__(self):
        return (f"RadixEntry(namespace={self.namespace!r}, tokens={self.tokens!r}, "
                f"logical_bytes={self.logical_bytes}, last_used={self.last_used}, "
                f"value={self.value!r})")


# ---------------------------------------------------------------------------------------------
# argument conversion

cdef struct _Key:
    const int32_t *p
    size_t n
    bint has_view
    Py_buffer view


cdef inline bint _is_i32_format(const char *f, Py_ssize_t itemsize):
    if itemsize != 4 or f == NULL:
        return False
    if f[0] == b'@' or f[0] == b'=' or (f[0] == b'<' and _LITTLE_ENDIAN):
        f += 1
    return (f[0] == b'i' or (f[0] == b'l' and sizeof(long) == 4)) and f[1] == 0


cdef inline const char *_ns_utf8(str namespace, Py_ssize_t *n) except NULL:
    return PyUnicode_AsUTF8AndSize(namespace, n)


cdef int _fill_exact(list_or_tuple, int32_t *dst, Py_ssize_t n) except -2:
    """Writes exact ints into dst; returns 0, or 1 when an item is not an exact int."""
    cdef Py_ssize_t bad = 0
    cdef int found = scan_exact_ints(list_or_tuple, n, dst, INT32_MIN, &bad)
    if found == SCAN_OUT_OF_RANGE:
        raise ValueError(f"radix token {list_or_tuple[bad]} is outside the int32 range")
    return found


cdef list _as_ints(seq):
    """Every item converted to an exact int, before any is written anywhere: __index__ may run
    Python code (even re-enter this cache)."""
    return [as_int("radix token", x) for x in seq]


cdef bytes _pack_tokens(tokens):
    """int32 native-endian bytes of a token sequence (validated like a key)."""
    seq = PySequence_Fast(tokens, "radix tokens must be a sequence of ints")
    cdef Py_ssize_t n = PySequence_Fast_GET_SIZE(seq)
    cdef bytes out = PyBytes_FromStringAndSize(NULL, n * 4)
    if _fill_exact(seq, <int32_t *>PyBytes_AS_STRING(out), n):
        _fill_exact(_as_ints(seq), <int32_t *>PyBytes_AS_STRING(out), n)
    return out


cdef tuple _tokens_tuple(const int32_t *p, size_t n):
    cdef list out = [None] * n
    cdef size_t i
    for i in range(n):
        out[i] = p[i]
    return tuple(out)


# ---------------------------------------------------------------------------------------------
# the cache

cdef class RadixCacheCore:
    """Native part of `UnifiedRadixCache` (see skippy_scheduler.radix for the documentation)."""

    cdef sk_radix *_r
    cdef dict _values          # handle -> value
    cdef uint64_t _next_handle
    cdef int32_t *_scratch     # converted keys; only written while no Python code can run
    cdef size_t _scratch_cap
    cdef object __weakref__

    def __cinit__(self):
        self._r = sk_radix_new()
        if self._r == NULL:
            raise MemoryError()
        self._values = {}
        self._next_handle = 1

    def __dealloc__(self):
        sk_radix_free(self._r)
        free(self._scratch)

    cdef int32_t *_reserve(self, Py_ssize_t n) except NULL:
        # At least one entry, so that an empty key still gets a valid pointer.
        if sk_grow(<void **>&self._scratch, &self._scratch_cap, <size_t>n if n else 1,
                   sizeof(int32_t)):
            raise MemoryError()
        return self._scratch

    cdef int _open(self, object tokens, _Key *key) except -1:
        cdef Py_ssize_t n
        cdef int32_t *dst
        key.has_view = False
        if PyObject_CheckBuffer(tokens):
            try:
                PyObject_GetBuffer(tokens, &key.view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT)
            except (BufferError, TypeError, ValueError):
                pass
            else:
                if key.view.ndim == 1 and _is_i32_format(key.view.format, key.view.itemsize):
                    key.has_view = True
                    key.p = <const int32_t *>key.view.buf
                    key.n = <size_t>(key.view.len // 4)
                    return 0
                PyBuffer_Release(&key.view)
        seq = PySequence_Fast(tokens, "radix tokens must be a sequence of ints")
        n = PySequence_Fast_GET_SIZE(seq)
        dst = self._reserve(n)
        if _fill_exact(seq, dst, n):
            seq = _as_ints(seq)
            dst = self._reserve(n)  # the conversion may have used (and grown) the scratch
            _fill_exact(seq, dst, n)
        key.p = dst
        key.n = <size_t>n
        return 0

    cdef inline void _close(self, _Key *key):
        if key.has_view:
            PyBuffer_Release(&key.view)
            key.has_view = False

    # NOTE: creating GC-tracked objects may run finalizers that re-enter this cache, so every
    # read of native state happens before the first such allocation.
    cdef RadixMatch _match(self, sk_radix_hit *hit):
        cdef bytes key = PyBytes_FromStringAndSize(NULL, hit.stored_tokens * 4)
        sk_radix_copy_key(self._r, hit.node, <int32_t *>PyBytes_AS_STRING(key))
        value = self._values[hit.handle]
        cdef RadixMatch m = RadixMatch.__new__(RadixMatch)
        m.matched_tokens = hit.matched_tokens
        m.stored_tokens = hit.stored_tokens
        m.logical_bytes = hit.logical_bytes
        m.active_refs = hit.active_refs
        m.value = value
        m._key = key
        return m

    cdef RadixEntry _entry(self, sk_radix_hit *hit):
        cdef size_t kn = 0, nl = 0
        cdef const char *name = sk_radix_ns_name(self._r, hit.ns_index, &nl)
        value = self._values[hit.handle]
        namespace = PyUnicode_DecodeUTF8(<char *>name, nl, NULL)
        kn = hit.stored_tokens
        cdef bytes key = PyBytes_FromStringAndSize(NULL, kn * 4)
        sk_radix_copy_key(self._r, hit.node, <int32_t *>PyBytes_AS_STRING(key))
        cdef RadixEntry e = RadixEntry.__new__(RadixEntry)
        e.namespace = namespace
        e.tokens = _tokens_tuple(<const int32_t *>PyBytes_AS_STRING(key), kn)
        e.logical_bytes = hit.logical_bytes
        e.last_used = hit.last_used
        e.value = value
        return e

    cdef object _insert(self, str namespace, object tokens, object logical_bytes, object value,
                        int kind, int if_vacant):
        cdef Py_ssize_t nl = 0
        cdef const char *ns = PyUnicode_AsUTF8AndSize(namespace, &nl)
        cdef uint64_t nbytes = check_u64("logical_bytes", logical_bytes)
        cdef uint64_t handle = self._next_handle
        cdef uint64_t prev = 0
        cdef _Key key
        cdef int st
        if handle == U64_MAX:
            raise OverflowError("radix cache handle space exhausted")
        self._open(tokens, &key)
        try:
            if key.n == 0:
                raise ValueError(EMPTY_KEY_MESSAGE)
            # registered first so that nothing can fail once the tree holds the handle
            self._values[handle] = value
            st = sk_radix_insert(self._r, kind, if_vacant, ns, nl, key.p, key.n, nbytes, handle,
                                 &prev)
        finally:
            self._close(&key)
        if st == SK_RADIX_OK or st == SK_RADIX_REPLACED:
            self._next_handle += 1
            return self._values.pop(prev) if st == SK_RADIX_REPLACED else None
        del self._values[handle]
        if st == SK_RADIX_OCCUPIED:
            return value
        if st == SK_RADIX_ACTIVE:
            raise ValueError(ACTIVE_MESSAGE)
        if st == SK_RADIX_EMPTY_KEY:
            raise ValueError(EMPTY_KEY_MESSAGE)
        raise MemoryError()

    def insert_resident(self, str namespace not None, tokens, logical_bytes, value):
        return self._insert(namespace, tokens, logical_bytes, value, SK_RADIX_RESIDENT, 0)

    def insert_resident_if_vacant(self, str namespace not None, tokens, logical_bytes, value):
        return self._insert(namespace, tokens, logical_bytes, value, SK_RADIX_RESIDENT, 1)

    def insert_recurrent(self, str namespace not None, tokens, logical_bytes, value):
        return self._insert(namespace, tokens, logical_bytes, value, SK_RADIX_RECURRENT, 0)

    cdef object _probe(self, str namespace, object tokens, int kind, int mode):
        cdef Py_ssize_t nl = 0
        cdef const char *ns = PyUnicode_AsUTF8AndSize(namespace, &nl)
        cdef sk_radix_hit hit
        cdef _Key key
        cdef int st
        self._open(tokens, &key)
        st = sk_radix_probe(self._r, kind, mode, ns, nl, key.p, key.n, &hit)
        self._close(&key)
        return self._match(&hit) if st == SK_RADIX_OK else None

    def peek_resident(self, str namespace not None, tokens):
        return self._probe(namespace, tokens, SK_RADIX_RESIDENT, SK_RADIX_PEEK)

    def peek_recurrent(self, str namespace not None, tokens):
        return self._probe(namespace, tokens, SK_RADIX_RECURRENT, SK_RADIX_PEEK)

    def lookup_resident(self, str namespace not None, tokens):
        return self._probe(namespace, tokens, SK_RADIX_RESIDENT, SK_RADIX_LOOKUP)

    def lookup_recurrent(self, str namespace not None, tokens):
        return self._probe(namespace, tokens, SK_RADIX_RECURRENT, SK_RADIX_LOOKUP)

    def acquire_resident(self, str namespace not None, tokens):
        return self._probe(namespace, tokens, SK_RADIX_RESIDENT, SK_RADIX_ACQUIRE)

    def acquire_recurrent(self, str namespace not None, tokens):
        return self._probe(namespace, tokens, SK_RADIX_RECURRENT, SK_RADIX_ACQUIRE)

    cdef object _exact(self, str namespace, object tokens, int kind):
        cdef Py_ssize_t nl = 0
        cdef const char *ns = PyUnicode_AsUTF8AndSize(namespace, &nl)
        cdef sk_radix_hit hit
        cdef _Key key
        cdef int st
        self._open(tokens, &key)
        st = sk_radix_exact(self._r, kind, 1, ns, nl, key.p, key.n, &hit)
        self._close(&key)
        return self._values[hit.handle] if st == SK_RADIX_OK else None

    def resident_exact(self, str namespace not None, tokens):
        return self._exact(namespace, tokens, SK_RADIX_RESIDENT)

    def recurrent_exact(self, str namespace not None, tokens):
        return self._exact(namespace, tokens, SK_RADIX_RECURRENT)

    cdef bint _release(self, str namespace, object tokens, int kind) except -1:
        cdef Py_ssize_t nl = 0
        cdef const char *ns = PyUnicode_AsUTF8AndSize(namespace, &nl)
        cdef _Key key
        cdef int st
        self._open(tokens, &key)
        st = sk_radix_release(self._r, kind, ns, nl, key.p, key.n)
        self._close(&key)
        return st == SK_RADIX_OK

    def release_resident(self, str namespace not None, tokens):
        return self._release(namespace, tokens, SK_RADIX_RESIDENT)

    def release_recurrent(self, str namespace not None, tokens):
        return self._release(namespace, tokens, SK_RADIX_RECURRENT)

    cdef object _remove(self, str namespace, object tokens, int kind):
        cdef Py_ssize_t nl = 0
        cdef const char *ns = PyUnicode_AsUTF8AndSize(namespace, &nl)
        cdef uint64_t handle = 0
        cdef _Key key
        cdef int st
        self._open(tokens, &key)
        st = sk_radix_remove(self._r, kind, ns, nl, key.p, key.n, &handle)
        self._close(&key)
        if st == SK_RADIX_NO_MEMORY:
            raise MemoryError()
        return self._values.pop(handle) if st == SK_RADIX_OK else None

    def remove_resident(self, str namespace not None, tokens):
        return self._remove(namespace, tokens, SK_RADIX_RESIDENT)

    def remove_recurrent(self, str namespace not None, tokens):
        return self._remove(namespace, tokens, SK_RADIX_RECURRENT)

    cdef object _lru(self, int kind, bint evict):
        cdef sk_radix_hit hit
        cdef uint64_t handle = 0
        if sk_radix_lru(self._r, kind, &hit) != SK_RADIX_OK:
            return None
        cdef uint64_t version = sk_radix_version(self._r)
        entry = self._entry(&hit)
        if evict:
            if sk_radix_version(self._r) != version:
                raise RuntimeError("radix cache changed while its LRU victim was read")
            if sk_radix_remove_hit(self._r, kind, &hit, 1, &handle) != SK_RADIX_OK:
                raise MemoryError()
            del self._values[handle]
        return entry

    def lru_resident_candidate(self):
        return self._lru(SK_RADIX_RESIDENT, False)

    def lru_recurrent_candidate(self):
        return self._lru(SK_RADIX_RECURRENT, False)

    def evict_lru_resident(self):
        return self._lru(SK_RADIX_RESIDENT, True)

    def evict_lru_recurrent(self):
        return self._lru(SK_RADIX_RECURRENT, True)

    def _entries(self, bint recurrent):
        """All entries of one kind in (namespace bytes, key) order."""
        cdef int kind = SK_RADIX_RECURRENT if recurrent else SK_RADIX_RESIDENT
        cdef size_t ns_index = 0
        cdef int32_t node = -1
        cdef sk_radix_hit hit
        cdef list out = []
        cdef uint64_t version = sk_radix_version(self._r)
        while sk_radix_next(self._r, kind, &ns_index, &node, &hit) == SK_RADIX_OK:
            out.append(self._entry(&hit))
            if sk_radix_version(self._r) != version:
                raise RuntimeError("radix cache changed during iteration")
        return out

    def epoch(self):
        return sk_radix_epoch(self._r)

    def _set_epoch(self, clock):
        """Continues the clock from a saved epoch (snapshot restore; tests of saturation)."""
        sk_radix_set_epoch(self._r, check_u64("clock", clock))

    def _stats_tuple(self):
        cdef sk_radix_stats s
        sk_radix_get_stats(self._r, &s)
        return (s.namespaces, s.nodes, s.token_edges, s.splits, s.resident_entries,
                s.resident_tokens, s.resident_logical_bytes, s.resident_active_refs,
                s.recurrent_entries, s.recurrent_logical_bytes, s.recurrent_active_refs,
                s.resident_evictions, s.recurrent_evictions)
