"""Differential tests: the native implementation and its pure-Python twin (the oracle) must give
identical results on the same inputs: plans, telemetry, figures, traces, store states.

Gathered here: the scheduler on random operation sequences (test_scheduler.py), the cache-aware
ordering (test_ordering.py), the lab's drivers (test_lab.py), the prefix store step by step
(test_prefix_store.py) and the core's fast paths on random workloads (test_fast_paths.py).
Tests that run one implementation at a time (the `impl` fixture) stay with their subject.
"""
