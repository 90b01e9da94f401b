# cython: language_level=3
"""Native scheduler binding (placeholder until the core lands)."""
cdef extern from "skippy_abi.h":
    enum: SKIPPY_PLAN_ABI_VERSION

PLAN_ABI_VERSION = SKIPPY_PLAN_ABI_VERSION
