"""The command line of a base install (`pip install .`, no `llama` extra): every subcommand
registers, `lab` runs, and a command that needs llama.cpp says so, instead of every command
failing to start on an import of llama_cpp (the README's first command runs on such an
install)."""
from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import sys
sys.modules["llama_cpp"] = None  # as if llama-cpp-python were not installed
from skippy_scheduler.cli import build_parser, main
build_parser()
code = main(["lab", "--list"])
assert code == 0, code
print("stage:", main(["stage", "-m", "x.gguf", "--listen", "tcp://127.0.0.1:1"]))
assert "llama_cpp" not in {k for k, v in sys.modules.items() if v is not None}
"""


def test_the_cli_starts_without_llama_cpp(tmp_path):
    r = subprocess.run([sys.executable, "-c", SCRIPT], cwd=tmp_path, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "stage: 2" in r.stdout, r.stdout + r.stderr  # refused cleanly, not a traceback
