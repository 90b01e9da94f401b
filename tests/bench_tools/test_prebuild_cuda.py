"""bench/gpu/prebuild_cuda.sh without nvcc: it builds nothing and says so with its own exit
status (3), which make_kit.sh reads as "the GPU machine builds llama.cpp itself"."""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "bench", "gpu", "prebuild_cuda.sh")


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_without_nvcc_nothing_is_built_and_the_status_says_so(tmp_path):
    src = tmp_path / "llama.cpp"
    src.mkdir()
    out = tmp_path / "prebuilt.tar.xz"
    env = {**os.environ, "NVCC": str(tmp_path / "no-nvcc"), "PREBUILD_DIR": str(tmp_path / "c")}
    proc = subprocess.run(["bash", SCRIPT, str(src), str(out)], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 3, proc.stderr
    assert "no nvcc" in proc.stdout + proc.stderr
    assert not out.exists() and not (tmp_path / "c").exists()
