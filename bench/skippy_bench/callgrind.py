"""Instruction counts under valgrind's callgrind: a child process measured as it runs
(`step_callgrind.py`, `slack_callgrind.py`)."""
from __future__ import annotations

import gc
import os
import shutil
import subprocess
from typing import Callable


def callgrind(python: str, script: str, child_args: list[str], out: str) -> None:
    """Run `python script --child ARGS` under callgrind, writing its counts to `out`."""
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        raise SystemExit("valgrind not found")
    # The same dict and set layouts every run; no BLAS worker threads (numpy's OpenBLAS
    # starts them at import, and their spinning adds counts that vary from run to run).
    env = dict(os.environ, PYTHONHASHSEED="0", OPENBLAS_NUM_THREADS="1",
               OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    subprocess.run([valgrind, "--tool=callgrind", f"--callgrind-out-file={out}", python,
                    os.path.abspath(script), "--child", *child_args], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                   cwd=os.path.dirname(out))


def counted_steps(step: Callable[[], object], steps: int) -> None:
    """The measured child's run: 20 warm-up steps, then `steps` steps."""
    for _ in range(20):
        step()
    # The set-up's objects leave the collector's generations: a full collection would walk
    # them at points that differ between the short and the long run.
    gc.collect()
    gc.freeze()
    for _ in range(steps):
        step()
