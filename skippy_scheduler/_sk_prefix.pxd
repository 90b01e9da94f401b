# Cython view of csrc/sk_prefix.h: which scheduler a prefix store serves (one at a time).
from ._skippy_scheduler cimport skippy_prefix_store, skippy_scheduler

cdef extern from "sk_prefix.h" nogil:
    skippy_scheduler *sk_prefix_owner(const skippy_prefix_store *store)
