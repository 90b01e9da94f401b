"""The C host example builds against the installed package and drives the scheduler alone."""
import pathlib
import shutil
import subprocess

import pytest

import skippy_scheduler

HOST = pathlib.Path(__file__).resolve().parents[2] / "examples" / "c_host" / "host.c"

EXPECTED = """\
gamma finished: 5000
alpha finished: 16 17 18 19
beta finished: 102 103 104 105
iterations 5 finished 3 prefill 13 decode 7
"""


@pytest.fixture(scope="module")
def host_binary(tmp_path_factory):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    exe = tmp_path_factory.mktemp("c_host") / "host"
    # The README's command, with the package's own locations.
    subprocess.run(
        [cc, str(HOST), "-Wall", "-Wextra", "-Werror", f"-I{skippy_scheduler.get_include()}",
         f"-L{skippy_scheduler.get_library_dir()}", "-lskippy_scheduler_core", "-lm", "-o", str(exe)],
        check=True,
    )
    return exe


def test_c_host_runs_every_sequence_to_completion(host_binary):
    out = subprocess.run([str(host_binary)], check=True, capture_output=True, text=True).stdout
    assert out == EXPECTED


def test_c_host_is_clean_under_valgrind(host_binary):
    if shutil.which("valgrind") is None:
        pytest.skip("valgrind not installed")
    run = subprocess.run(
        ["valgrind", "--leak-check=full", "--show-leak-kinds=all", "--errors-for-leak-kinds=all",
         "--error-exitcode=3", "-q", str(host_binary)],
        capture_output=True, text=True,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout == EXPECTED
