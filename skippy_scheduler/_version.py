__version__ = "0.1.0"
# Plan ABI this Python package was written against (abi/skippy_abi_decls.h).
PLAN_ABI_VERSION = 4
