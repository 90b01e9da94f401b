"""Tests of the per-step cost that time nothing (timings are benchmarks: bench/ and
`skippy-scheduler bench`, reported in BENCHMARKS.md as ratios).

They check what the benchmark figures rest on: a native step allocates nothing (alloc_probe.c),
plan memory and views are reused, a plan's size does not depend on the context length, and
the report's workloads do what their names say at small sizes (the bench/ scripts' tests are in
tests/bench_tools). They stay in the default test run because a regression here is a bug, not
a slower number.
"""
