"""skippy-scheduler: iteration-level scheduling policy for LLM serving."""
from ._check import check_native as _check_native
from ._version import __version__
from .radix import RadixEntry, RadixMatch, RadixStats, UnifiedRadixCache, affinity_from_radix

_check_native()

__all__ = [
    "__version__",
    "RadixEntry",
    "RadixMatch",
    "RadixStats",
    "UnifiedRadixCache",
    "affinity_from_radix",
]
