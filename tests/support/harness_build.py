"""Building the C harnesses of tests/native (imported by their test modules).

A harness is compiled with AddressSanitizer and UndefinedBehaviorSanitizer when the compiler
offers them, else plainly. Harnesses of the scheduler core are linked from the core's sources
with the allocator wrapped (harness.h injects failures through the wrap); the radix harness
includes what it tests itself.
"""
from __future__ import annotations

import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
NATIVE = ROOT / "tests" / "native"
BASE_FLAGS = ["-std=c99", "-O1", "-g", "-Wall", "-Wextra", "-Wno-unused-parameter", "-Werror",
              f"-I{ROOT / 'csrc'}", f"-I{ROOT / 'abi'}", f"-I{NATIVE}"]
WRAP = ["-Wl,--wrap=malloc,--wrap=calloc,--wrap=realloc", "-lm"]
SANITIZE = ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined"]


def build_harness(tmp_path_factory, name: str, needs: str, *, link_core: bool = True):
    """The executable of tests/native/<name>.c; skips without a compiler or a source tree
    (`needs` names a core source the harness cannot do without)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None or not (ROOT / "csrc" / needs).exists():
        pytest.skip("no C compiler or no source tree")
    exe = tmp_path_factory.mktemp(name) / name
    sources = [str(p) for p in sorted((ROOT / "csrc").glob("*.c"))] if link_core else []
    link = WRAP if link_core else []
    for extra in (SANITIZE, []):
        build = subprocess.run([cc, str(NATIVE / f"{name}.c"), *sources, *BASE_FLAGS, *extra,
                                "-o", str(exe), *link], capture_output=True, text=True)
        if build.returncode == 0:
            return exe
    pytest.fail(build.stderr)
