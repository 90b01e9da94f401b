"""The core allocates nothing in steady state (C, counted through -Wl,--wrap=malloc etc.)."""
import pathlib
import shutil
import subprocess
import sys

import pytest

import skippy_scheduler

PROBE = pathlib.Path(__file__).resolve().parent / "alloc_probe.c"


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None or not sys.platform.startswith("linux"):
        pytest.skip("needs a C compiler and GNU ld's --wrap")
    exe = tmp_path_factory.mktemp("alloc") / "alloc_probe"
    subprocess.run(
        [cc, "-O2", "-Wall", "-Wextra", "-Werror", str(PROBE), f"-I{skippy_scheduler.get_include()}",
         f"-L{skippy_scheduler.get_library_dir()}", "-lskippy_scheduler_core", "-lm",
         "-Wl,--wrap=malloc,--wrap=calloc,--wrap=realloc", "-o", str(exe)],
        check=True,
    )
    return exe


def _run(exe, mode, n, steps):
    out = subprocess.run([str(exe), mode, str(n), str(steps)], check=True, capture_output=True,
                         text=True).stdout
    fields = dict(kv.split("=") for kv in out.split())
    return int(fields["allocations"]), int(fields["rows"])


@pytest.mark.parametrize("mode,n", [("decode", 64), ("decode", 1024), ("mixed", 64), ("churn", 64)])
def test_steady_steps_do_not_allocate(probe, mode, n):
    allocations, rows = _run(probe, mode, n, 300)
    assert rows >= 300 * n // 3  # the steps planned real work (churn: 1 decode step in 3)
    assert allocations == 0


def test_the_probe_sees_allocations(probe):
    # Histories outgrowing their first buffer (8192 tokens here) must reallocate: the counter works.
    allocations, _ = _run(probe, "decode", 4, 8000)
    assert allocations > 0
