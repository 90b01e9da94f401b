"""The radix cache's C core alone: invariants under random operations and allocation failures.

The harness (radix_harness.c) is compiled from the sources, with AddressSanitizer and
UndefinedBehaviorSanitizer when the compiler offers them.
"""
import re
import subprocess

import pytest
from harness_build import build_harness


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    return build_harness(tmp_path_factory, "radix_harness", "sk_radix.c", link_core=False)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_operations_keep_invariants_and_failed_allocations_change_nothing(harness, seed):
    run = subprocess.run([str(harness), str(seed), "12000"], capture_output=True, text=True,
                         env={"ASAN_OPTIONS": "detect_leaks=1"})
    assert run.returncode == 0, run.stdout + run.stderr
    fields = dict(re.findall(r"(\w+)=(\d+)", run.stdout))
    assert run.stdout.startswith("ok")
    assert int(fields["no_memory"]) > 0  # failure paths were exercised
    assert int(fields["compactions"]) > 0  # the token pool was compacted
