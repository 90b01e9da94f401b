"""C-level check of the ranking kernels under AddressSanitizer/UBSan (built from csrc/)."""
import shutil
import subprocess
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
CSRC = HERE.parent.parent / "csrc"


@pytest.fixture(scope="module")
def fuzz_binary(tmp_path_factory):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None or not (CSRC / "sk_rank_set.c").exists():
        pytest.skip("needs a C compiler and the source tree")
    exe = tmp_path_factory.mktemp("rank") / "rank_fuzz"
    base = [cc, "-std=c99", "-O1", "-g", "-Wall", "-Wextra", "-Werror", "-Wno-unused-parameter",
            f"-I{CSRC}", str(HERE / "rank_fuzz.c"), str(CSRC / "sk_rank.c"),
            str(CSRC / "sk_rank_set.c"), "-o", str(exe)]
    sanitized = base + ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined"]
    if subprocess.run(sanitized, capture_output=True).returncode != 0:
        subprocess.run(base, check=True, capture_output=True)
    return exe


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_ranked_set_matches_one_shot_kernel_under_sanitizers(fuzz_binary, seed):
    run = subprocess.run([str(fuzz_binary), "60", "300", str(seed)], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.strip() == "ok"
