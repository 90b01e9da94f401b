"""Per-step scheduler overhead: the workloads of BENCHMARKS.md and the `skippy-scheduler bench`
report.

* `workloads`: engine set-ups brought to a steady state, each returning a `step()` closure
  (steady decode, plans in flight, mixed decode + prefill chunk, admission churn, ranking);
* `timing`: `measure()` and `measure_pairs()` keep every sample (medians and p99s);
* `c_api`: the same decode loop in C (`bench/c_overhead.c`, found in a source checkout);
* `report`: `collect()` runs them all, `format_table()` prints them.

The other benchmarks (ranking, radix, in-flight cost, prefix reuse, serving load, the soak)
are scripts in the source tree's `bench/` folder; they import the workloads from here.
"""
from .c_api import build_c, c_source, callgrind_per_step, run_c
from .report import collect, context_line, format_table, machine
from .timing import Result, measure, measure_pairs, measure_ranking, paired_medians_us
from .workloads import (IMPLEMENTATIONS, LONG_OUTPUT, BenchHost, admission_churn,
                        decoding_engine, first_plan_token_count, mixed_decode_prefill, ranking,
                        steady_decode, steady_decode_inflight, write_outputs)

__all__ = [
    "IMPLEMENTATIONS", "LONG_OUTPUT", "BenchHost", "Result", "admission_churn", "build_c",
    "c_source", "callgrind_per_step", "collect", "context_line", "decoding_engine",
    "first_plan_token_count", "format_table", "machine", "measure", "measure_pairs",
    "measure_ranking", "mixed_decode_prefill", "paired_medians_us", "ranking", "run_c", "steady_decode",
    "steady_decode_inflight", "write_outputs",
]
