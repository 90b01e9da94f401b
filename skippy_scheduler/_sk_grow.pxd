# Cython view of csrc/sk_grow.h: the core's one rule for growing an array.
cdef extern from "sk_grow.h" nogil:
    int sk_grow(void **ptr, size_t *cap, size_t need, size_t elem)
