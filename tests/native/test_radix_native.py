"""The radix cache's C core alone: invariants under random operations and allocation failures.

The harness (radix_harness.c) is compiled from the sources, with AddressSanitizer and
UndefinedBehaviorSanitizer when the compiler offers them.
"""
import pathlib
import re
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
HARNESS = ROOT / "tests" / "native" / "radix_harness.c"
BASE_FLAGS = ["-std=c99", "-O1", "-g", "-Wall", "-Wextra", "-Wno-unused-parameter", "-Werror",
              f"-I{ROOT / 'csrc'}"]
SANITIZE = ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined"]


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None or not (ROOT / "csrc" / "sk_radix.c").exists():
        pytest.skip("no C compiler or no source tree")
    exe = tmp_path_factory.mktemp("radix") / "radix_harness"
    for extra in (SANITIZE, []):
        build = subprocess.run([cc, str(HARNESS), *BASE_FLAGS, *extra, "-o", str(exe)],
                               capture_output=True, text=True)
        if build.returncode == 0:
            return exe
    pytest.fail(build.stderr)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_operations_keep_invariants_and_failed_allocations_change_nothing(harness, seed):
    run = subprocess.run([str(harness), str(seed), "12000"], capture_output=True, text=True,
                         env={"ASAN_OPTIONS": "detect_leaks=1"})
    assert run.returncode == 0, run.stdout + run.stderr
    fields = dict(re.findall(r"(\w+)=(\d+)", run.stdout))
    assert run.stdout.startswith("ok")
    assert int(fields["no_memory"]) > 0  # failure paths were exercised
    assert int(fields["compactions"]) > 0  # the token pool was compacted
