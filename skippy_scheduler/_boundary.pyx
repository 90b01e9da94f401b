# cython: language_level=3, boundscheck=False, wraparound=False
"""Argument checks and token conversions shared by the extension modules.

The rules are those of `_validate.py` (the validators of the pure-Python types): an integer is
a Python or numpy integer and never a bool, a count is one in [0, limit], a token is one in
[0, 2**31 - 1]. This module implements them once for the compiled side: `as_int` and
`check_u64` raise the same errors as `_validate.as_int` and `_validate.check_uint`, and
`scan_exact_ints` is the one fast reader of int lists, used for scheduler tokens, ranking
prompts and radix keys alike (each caller decides what a failed scan means for it).
"""
from cpython.array cimport array, clone
from cpython.number cimport PyNumber_Index
from cpython.object cimport PyObject
from cpython.sequence cimport PySequence_Fast_ITEMS
from libc.stdint cimport int32_t, uint64_t

cdef extern from "Python.h":
    bint PyBool_Check(object o)

cdef extern from *:
    """
    /* Reads exact ints straight from their digits when they are compact, the common case for
       token ids; anything else takes the generic call. Stops at the first item that is not an
       exact int (returns 1) or is outside [lowest, INT32_MAX] (returns 2), with *bad = its
       index; returns 0 when all n items were written to dst (or only checked, dst NULL). */
    static int sk_scan_exact_ints(PyObject *const *items, Py_ssize_t n, int32_t *dst,
                                  long long lowest, Py_ssize_t *bad)
    {
        Py_ssize_t i;
        for (i = 0; i < n; i++) {
            PyObject *o = items[i];
            long long v;
            int overflow = 0;
            if (!PyLong_CheckExact(o)) {
                *bad = i;
                return 1;
            }
    #if PY_VERSION_HEX >= 0x030C0000
            if (PyUnstable_Long_IsCompact((PyLongObject *)o)) {
                v = (long long)PyUnstable_Long_CompactValue((PyLongObject *)o);
            } else {
                v = PyLong_AsLongLongAndOverflow(o, &overflow);
            }
    #else
            if (Py_SIZE(o) == 0) {
                v = 0;
            } else if (Py_SIZE(o) == 1) {
                v = (long long)((PyLongObject *)o)->ob_digit[0];
            } else if (Py_SIZE(o) == -1) {
                v = -(long long)((PyLongObject *)o)->ob_digit[0];
            } else {
                v = PyLong_AsLongLongAndOverflow(o, &overflow);
            }
    #endif
            if (overflow || v < lowest || v > INT32_MAX) {
                *bad = i;
                return 2;
            }
            if (dst) dst[i] = (int32_t)v;
        }
        return 0;
    }
    """
    int sk_scan_exact_ints(PyObject **items, Py_ssize_t n, int32_t *dst, long long lowest,
                           Py_ssize_t *bad)

cdef object U64_MAX = (1 << 64) - 1
cdef array _INT32_ARRAY = array("i")


cdef int scan_exact_ints(object items, Py_ssize_t n, int32_t *dst, long long lowest,
                         Py_ssize_t *bad) noexcept:
    """Converts the first n items of a list or tuple of exact ints into dst (NULL: only check).

    No Python code runs (the items are borrowed and only read), so the sequence cannot change
    underneath. Returns SCAN_OK, or SCAN_NOT_EXACT / SCAN_OUT_OF_RANGE with *bad = the index."""
    return sk_scan_exact_ints(PySequence_Fast_ITEMS(items), n, dst, lowest, bad)


cdef object as_int(str name, object value):
    """Python and numpy integers are ints here; bools (Python or numpy) are not."""
    if type(value) is int:
        return value
    if PyBool_Check(value) or type(value).__name__ == "bool_":
        raise TypeError(f"{name} must be an int, got bool")
    try:
        return PyNumber_Index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None


cdef uint64_t check_u64(str name, object value, object limit=U64_MAX) except? 0:
    """An int in [0, limit] (limit at most 2**64 - 1), as a C value."""
    value = as_int(name, value)
    if value < 0 or value > limit:
        raise ValueError(f"{name} must be in [0, {limit}], got {value}")
    return <uint64_t>value


cdef array token_array(object values):
    """Tokens as an int32 array when `values` is a list or tuple of exact ints in
    [0, 2**31 - 1]; None otherwise (the caller then runs the full checks, which raise the
    precise errors)."""
    cdef Py_ssize_t bad = 0
    cdef array out
    if type(values) is not list and type(values) is not tuple:
        return None
    out = clone(_INT32_ARRAY, len(values), False)
    if scan_exact_ints(values, len(values), <int32_t *>out.data.as_ints, 0, &bad) != SCAN_OK:
        return None
    return out


def check_tokens_fast(str name, values):
    """A fresh list of the tokens when `values` is a list or tuple of exact ints in
    [0, 2**31 - 1]; raises ValueError for an out-of-range one; returns None when some item is
    not an exact int (the general check then decides)."""
    cdef Py_ssize_t bad = 0
    cdef int found
    if type(values) is not list and type(values) is not tuple:
        return None
    found = scan_exact_ints(values, len(values), NULL, 0, &bad)
    if found == SCAN_NOT_EXACT:
        return None
    if found == SCAN_OUT_OF_RANGE:
        raise ValueError(f"{name}[{bad}] = {values[bad]} is outside the token range "
                         f"[0, 2147483647]")
    return list(values)
