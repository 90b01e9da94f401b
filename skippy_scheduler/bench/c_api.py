"""The C API rows of the overhead report: `bench/c_overhead.c`, the same decode loop with no
Python at all, compiled against the installed headers and static library.

The C source is not installed with the package: it is found in a source checkout (an editable
install, or `SKIPPY_BENCH_C=/path/to/c_overhead.c`), and without it the report says so and
skips the C rows.
"""
from __future__ import annotations

import os
import shutil
import subprocess

from .. import get_include, get_library_dir


def c_source() -> str | None:
    """bench/c_overhead.c: `SKIPPY_BENCH_C`, else the source checkout this package runs from."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for path in (os.environ.get("SKIPPY_BENCH_C"),
                 os.path.join(os.path.dirname(package), "bench", "c_overhead.c")):
        if path and os.path.exists(path):
            return path
    return None


def build_c(workdir: str, source: str | None = None) -> tuple[str | None, str]:
    """Compiles `source` (default: `c_source()`) with `cc -O2`; returns (executable or None,
    message)."""
    src = source if source is not None else c_source()
    if src is None or not os.path.exists(src):
        return None, ("C API rows skipped: bench/c_overhead.c is in the source tree, not the "
                      "installed package (set SKIPPY_BENCH_C to its path)")
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        return None, "no C compiler (cc) found: C API rows skipped"
    exe = os.path.join(workdir, "c_overhead")
    cmd = [cc, "-O2", "-I", get_include(), src, "-L", get_library_dir(),
           "-lskippy_scheduler_core", "-lm", "-o", exe]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        return None, f"compiling c_overhead.c failed: {r.stderr.strip()[:300]}"
    return exe, " ".join(cmd)


def run_c(exe: str, n: int, prompt: int, steps: int, warmup: int = 200) -> tuple[float, float, int]:
    r = subprocess.run([exe, str(n), str(prompt), str(warmup), str(steps)], capture_output=True,
                       text=True, check=True)
    fields = dict(kv.split("=") for kv in r.stdout.split())
    return float(fields["median_ns"]), float(fields["p99_ns"]), int(fields["steps"])


def callgrind_per_step(exe: str, n: int, prompt: int = 512, k: int = 100) -> int | None:
    """Instructions of one decode step: callgrind counts of 2k minus k measured steps, over k.

    Only `bench_steps` (the measured loop) is collected, so set-up and warm-up do not count.
    """
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        return None
    counts = []
    for steps in (k, 2 * k):
        r = subprocess.run([valgrind, "--tool=callgrind", "--callgrind-out-file=/dev/null",
                            "--toggle-collect=bench_steps", exe, str(n), str(prompt), str(n),
                            str(steps), "count"], capture_output=True, text=True)
        found = [line for line in r.stderr.splitlines() if "Collected :" in line]
        if r.returncode != 0 or not found:
            return None
        counts.append(int(found[-1].split(":")[-1].strip().replace(",", "")))
    return (counts[1] - counts[0]) // k
