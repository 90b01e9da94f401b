# cython: language_level=3, boundscheck=False, wraparound=False
"""Fast paths for argument checks that would otherwise cost a Python call per token."""
from cpython.list cimport PyList_GET_ITEM, PyList_GET_SIZE
from cpython.long cimport PyLong_CheckExact
from cpython.tuple cimport PyTuple_GET_ITEM, PyTuple_GET_SIZE


cdef extern from "Python.h":
    long PyLong_AsLongAndOverflow(object o, int *overflow) except? -1


cdef inline int _scan(object item, Py_ssize_t position, str name) except -2:
    """1 = valid token, 0 = not an exact int (let the general check decide)."""
    cdef int overflow = 0
    cdef long v
    if not PyLong_CheckExact(item):
        return 0
    v = PyLong_AsLongAndOverflow(item, &overflow)
    if overflow != 0 or v < 0 or v > 2147483647:
        raise ValueError(f"{name}[{position}] = {item} is outside the token range [0, 2147483647]")
    return 1


def check_tokens_fast(str name, values):
    """A fresh list of the tokens when `values` is a list or tuple of exact ints in
    [0, 2**31 - 1]; raises ValueError for an out-of-range one; returns None when some item is
    not an exact int (the general check then decides)."""
    cdef Py_ssize_t i, n
    if type(values) is list:
        n = PyList_GET_SIZE(values)
        for i in range(n):
            if not _scan(<object>PyList_GET_ITEM(values, i), i, name):
                return None
        return list(values)
    if type(values) is tuple:
        n = PyTuple_GET_SIZE(values)
        for i in range(n):
            if not _scan(<object>PyTuple_GET_ITEM(values, i), i, name):
                return None
        return list(values)
    return None
