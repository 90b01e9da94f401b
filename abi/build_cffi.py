"""Generate the C source of the out-of-line cffi module ``skippy_scheduler._abi``.

Run by CMake at build time: ``python abi/build_cffi.py OUTPUT.c``. The declarations are read
verbatim from the directive-free files that the real headers include, so C, cffi and Cython
all see one definition of every shared struct.
"""
import pathlib
import sys

import cffi

HERE = pathlib.Path(__file__).resolve().parent


def make_ffi() -> cffi.FFI:
    ffi = cffi.FFI()
    ffi.cdef((HERE / "skippy_abi_decls.h").read_text())
    if (HERE.parent / "csrc" / "sk_sched.c").exists():
        ffi.cdef((HERE / "skippy_scheduler_decls.h").read_text())
    ffi.set_source("skippy_scheduler._abi", '#include "skippy_scheduler.h"\n')
    return ffi


if __name__ == "__main__":
    make_ffi().emit_c_code(sys.argv[1])
