"""The pure-Python reference implementation of skippy-scheduler (the oracle).

Everything here restates behaviour.md directly, for clarity rather than speed; the native
modules must agree with it on every input, and the differential tests, fuzzers and benchmarks
compare the two.

* `scheduler` owns `TwinScheduler`, the scheduler engine (§2 with the §0 decisions);
* `plan` owns `TwinPlan` and `TwinOutputs`, the engine's iteration plan and output block;
* `ordering` owns the cache-aware order of waiting work (§3): `reference_order`, the
  reference of the native ranking kernel behind `skippy_scheduler.order_cache_aware_candidates`;
* `radix` owns `RadixTwin`, a flat brute-force form of the unified radix cache (§8);
* `prefix_store` owns `PrefixStoreTwin`, the bounded prefix store (§8c).

`TwinScheduler` is also exported by `skippy_scheduler`.
"""
from .ordering import reference_order
from .plan import TwinOutputs, TwinPlan
from .prefix_store import PrefixStoreTwin
from .radix import RadixTwin
from .scheduler import TwinScheduler

__all__ = [
    "PrefixStoreTwin",
    "RadixTwin",
    "TwinOutputs",
    "TwinPlan",
    "TwinScheduler",
    "reference_order",
]
