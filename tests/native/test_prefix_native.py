"""The prefix store attached to a scheduler, in C through the public API alone: scripted stale
refreshes, pins and refused inserts, then a random run that checks after every plan that each
waiting sequence's restore is what the store matches now, that stale_refreshes rose by exactly
the waiting sequences whose restore changed, and that each entry is pinned once per active
sequence admitted with it; part of the run overflows the store's change journal, and one
variant injects allocation failures into store inserts.

The harness (prefix_harness.c) is linked from the core's sources with the allocator wrapped,
with AddressSanitizer and UndefinedBehaviorSanitizer when the compiler offers them.
"""
import re
import subprocess

import pytest
from harness_build import build_harness


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    return build_harness(tmp_path_factory, "prefix_harness", "sk_prefix.c")


def _run(harness, seed, steps, inject):
    run = subprocess.run([str(harness), str(seed), str(steps), str(inject)],
                         capture_output=True, text=True, env={"ASAN_OPTIONS": "detect_leaks=1"})
    assert run.returncode == 0, run.stdout + run.stderr[-4000:]
    assert run.stdout.startswith("ok")
    return {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", run.stdout)}


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_refresh_finds_every_changed_waiting_sequence_and_pins_follow_admission(harness, seed):
    fields = _run(harness, seed, 3000, 0)
    assert fields["plans"] > 700
    assert fields["stale_refreshes"] > 50 and fields["restored_tokens"] > 100
    assert fields["preempted"] > 0


@pytest.mark.parametrize("seed", [4, 5])
def test_a_store_insert_that_runs_out_of_memory_changes_nothing(harness, seed):
    fields = _run(harness, seed, 3000, 1)
    assert fields["no_memory_unchanged"] > 0  # the failure paths were taken
    assert fields["made_despite_failures"] > 0
