"""Misuse of the public C API, in C through the public header alone: NULL for every pointer
argument of every entry point (a NULL handle, NULL out-params, a NULL id), the error object of
a failed create, last_code after calls that return bool (cancel's out-of-memory told apart from
an unknown id), a refused prefix-store insert that must leave the store as it was, a clock
that is not finite, a plan or preemption whose policy callback fails (what the last call
reported stays readable), and a plan that runs out of memory at any of its allocations. Each
case checks what skippy_scheduler.h documents ("NULL arguments").

The harness (api_misuse_harness.c) is linked from the core's sources with the allocator
wrapped, with AddressSanitizer and UndefinedBehaviorSanitizer when the compiler offers them, so
a NULL that is dereferenced fails its case even where it would not crash.
"""
import subprocess

import pytest
from harness_build import build_harness

CASES = [
    "null_scheduler",
    "null_init",
    "create_error_object",
    "null_out_params",
    "null_id",
    "stale_last_code",
    "step_cost_null",
    "clock_not_finite",
    "queue_full_counts",
    "null_prefix_store",
    "prefix_store_null_out",
    "failed_insert_changes_nothing",
    "failed_plan_keeps_retired",
    "failed_preempt_keeps_victims",
    "failed_plan_changes_nothing",
]


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    return build_harness(tmp_path_factory, "api_misuse_harness", "sk_api.c")


def test_every_case_is_run(harness):
    listed = subprocess.run([str(harness), "--list"], check=True, capture_output=True,
                            text=True).stdout.split()
    assert listed == CASES


@pytest.mark.parametrize("case", CASES)
def test_misuse_gets_the_documented_result(harness, case):
    run = subprocess.run([str(harness), case], capture_output=True, text=True,
                         env={"ASAN_OPTIONS": "detect_leaks=1"})
    assert run.returncode == 0, run.stdout + run.stderr[-4000:]
    assert run.stdout == f"ok {case}\n"
