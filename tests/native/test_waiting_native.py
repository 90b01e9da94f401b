"""The scheduler's waiting-queue ranking in C: every dirty plan against the one-shot kernel over
the queue (the grouped cache-aware policy ranks through the persistent set), and injected
allocation failures that must leave the scheduler unchanged (under fair share, its counters
too).

The harness (waiting_harness.c) is linked from the core's sources with the allocator wrapped,
with AddressSanitizer and UndefinedBehaviorSanitizer when the compiler offers them.
"""
import re
import subprocess

import pytest
from harness_build import build_harness


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    return build_harness(tmp_path_factory, "waiting_harness", "sk_waiting.c")


@pytest.mark.parametrize("policy", [0, 1, 2, 4], ids=["cache_aware", "fcfs", "priority",
                                                     "fair_share"])
@pytest.mark.parametrize("grouping", [1, 0], ids=["grouping", "no_grouping"])
@pytest.mark.parametrize("seed", [1, 2])
def test_ranked_set_matches_one_shot_order_and_failed_allocations_change_nothing(
        harness, policy, grouping, seed):
    run = subprocess.run([str(harness), str(seed), "5000", str(policy), str(grouping)],
                         capture_output=True, text=True, env={"ASAN_OPTIONS": "detect_leaks=1"})
    assert run.returncode == 0, run.stdout + run.stderr[-4000:]
    assert run.stdout.startswith("ok")
    fields = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", run.stdout)}
    assert fields["no_memory_submit"] > 0  # failure paths were exercised
    assert fields["peak_waiting"] >= 50  # the queue grew well past a handful
