# The argument checks and token conversions every extension module shares (_boundary.pyx).
from cpython.array cimport array
from libc.stdint cimport int32_t, uint64_t

# What scan_exact_ints found.
cdef enum:
    SCAN_OK = 0             # every item converted
    SCAN_NOT_EXACT = 1      # items[bad] is not an exact int: the caller takes its checked path
    SCAN_OUT_OF_RANGE = 2   # items[bad] is an exact int outside [lowest, 2**31 - 1]

cdef int scan_exact_ints(object items, Py_ssize_t n, int32_t *dst, long long lowest,
                         Py_ssize_t *bad) noexcept
cdef object as_int(str name, object value)
cdef uint64_t check_u64(str name, object value, object limit=*) except? 0
cdef array token_array(object values)
