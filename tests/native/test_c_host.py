"""The C host example builds against the installed package and drives the scheduler alone."""
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
HOST = ROOT / "examples" / "c_host" / "host.c"

EXPECTED = """\
gamma finished: 5000
alpha finished: 16 17 18 19
beta finished: 102 103 104 105
iterations 5 finished 3 prefill 13 decode 7
"""


def _compiler() -> str:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    return cc


def _config_flags() -> list[str]:
    """`skippy-scheduler config --cflags --libs`, run as the README's build command runs it."""
    script = os.path.join(os.path.dirname(sys.executable), "skippy-scheduler")
    command = [script] if os.path.exists(script) else [sys.executable, "-m", "skippy_scheduler.cli"]
    out = subprocess.run([*command, "config", "--cflags", "--libs"], check=True,
                         capture_output=True, text=True, cwd=os.path.dirname(sys.executable))
    return shlex.split(out.stdout)


def _build(directory: pathlib.Path, flags: list[str]) -> pathlib.Path:
    exe = directory / "host"
    # The README's command (cc host.c <flags> -o host), with warnings as errors.
    subprocess.run([_compiler(), str(HOST), "-Wall", "-Wextra", "-Werror", *flags, "-o", str(exe)],
                   check=True)
    return exe


@pytest.fixture(scope="module")
def host_binary(tmp_path_factory):
    return _build(tmp_path_factory.mktemp("c_host"), _config_flags())


def test_c_host_runs_every_sequence_to_completion(host_binary):
    out = subprocess.run([str(host_binary)], check=True, capture_output=True, text=True).stdout
    assert out == EXPECTED


def test_readme_build_command_runs_as_printed(tmp_path):
    _compiler()
    if shutil.which("bash") is None:
        pytest.skip("no bash")
    readme = (ROOT / "README.md").read_text()
    command = next(block for block in re.findall(r"```bash\n(.*?)\n```", readme, re.S)
                   if "skippy-scheduler config" in block)
    assert command.startswith("cc examples/c_host/host.c")
    # Run from a directory laid out like the repository root, so `host` is not left in the tree;
    # the console script is found on PATH as after `pip install` into this environment.
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    run = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True,
                         text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout == EXPECTED


def test_c_host_builds_with_pkg_config(tmp_path):
    pkg_config = shutil.which("pkg-config")
    if pkg_config is None:
        pytest.skip("pkg-config is not installed")
    import skippy_scheduler

    env = dict(os.environ, PKG_CONFIG_PATH=os.path.join(skippy_scheduler.get_library_dir(),
                                                        "pkgconfig"))
    flags = subprocess.run([pkg_config, "--cflags", "--libs", "skippy-scheduler"], check=True,
                           capture_output=True, text=True, env=env).stdout
    exe = _build(tmp_path, shlex.split(flags))
    assert subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout == EXPECTED


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


PIPELINED = ROOT / "examples" / "c_host" / "pipelined_host.c"


@pytest.fixture(scope="module")
def pipelined_binary(tmp_path_factory):
    exe = tmp_path_factory.mktemp("c_pipelined") / "pipelined"
    subprocess.run([_compiler(), str(PIPELINED), "-Wall", "-Wextra", "-Werror", *_config_flags(),
                    "-o", str(exe)], check=True)
    return exe


def test_pipelined_c_host_gives_the_same_tokens_at_depth_two(pipelined_binary):
    # The program runs the workload at depth 1 and 2 and exits non-zero if any token differs,
    # if depth 2 deferred nothing, or if a deferred input names another plan than the previous.
    run = subprocess.run([str(pipelined_binary)], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    deferred = re.search(r"deferred inputs: (\d+) at depth 1, (\d+) at depth 2", run.stdout)
    assert deferred and deferred.group(1) == "0" and int(deferred.group(2)) > 10
    assert "depth 2: iterations" in run.stdout and "discarded rows" in run.stdout


def test_pipelined_c_host_is_clean_under_valgrind(pipelined_binary):
    if shutil.which("valgrind") is None:
        pytest.skip("valgrind not installed")
    run = subprocess.run(
        ["valgrind", "--leak-check=full", "--show-leak-kinds=all", "--errors-for-leak-kinds=all",
         "--error-exitcode=3", "-q", str(pipelined_binary)],
        capture_output=True, text=True,
    )
    assert run.returncode == 0, run.stderr


RUNTIME_AND_HOST = r"""
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "skippy_scheduler.h"

/* A stand-in runtime's own error helpers (the Skippy runtime defines skippy_error_free). */
static int runtime_frees;
void skippy_error_free(struct skippy_error *error)
{
    runtime_frees++;
    free((void *)error->message);
    free(error);
}
static struct skippy_error *runtime_error(void)
{
    struct skippy_error *e = malloc(sizeof *e);
    e->status = SKIPPY_STATUS_RUNTIME_ERROR;
    e->message = strdup("decode failed");
    return e;
}

int main(void)
{
    skippy_scheduler *s = NULL;
    skippy_error *err = NULL;
    if (skippy_scheduler_create(NULL, &s, &err) != SKIPPY_STATUS_INVALID_ARGUMENT || !err)
        return 1;
    skippy_scheduler_error_free(err);  /* the scheduler's error, freed by the scheduler */
    skippy_error_free(runtime_error());  /* the runtime's, by the runtime */
    printf("runtime frees %d\n", runtime_frees);
    return 0;
}
"""


def test_a_host_links_the_core_beside_a_runtime_that_defines_skippy_error_free(tmp_path):
    """The core defines no symbol of the runtime's: a host linking both (statically here) has
    one `skippy_error_free`, the runtime's, and frees the scheduler's errors with
    `skippy_scheduler_error_free`."""
    source = tmp_path / "both.c"
    source.write_text(RUNTIME_AND_HOST)
    exe = tmp_path / "both"
    subprocess.run([_compiler(), str(source), "-Wall", "-Wextra", "-Werror", *_config_flags(),
                    "-o", str(exe)], check=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    assert out == "runtime frees 1\n"


# Makes the host's third `skippy_scheduler_complete` name a plan that does not exist, so the
# scheduler refuses it with its own error (linked with -Wl,--wrap=skippy_scheduler_complete).
FAIL_THIRD_COMPLETE = r"""
#include "skippy_scheduler.h"
skippy_status __real_skippy_scheduler_complete(skippy_scheduler *, uint64_t,
                                               skippy_iteration_telemetry *, skippy_error **);
static int calls;
skippy_status __wrap_skippy_scheduler_complete(skippy_scheduler *s, uint64_t serial,
                                               skippy_iteration_telemetry *t, skippy_error **e)
{
    return __real_skippy_scheduler_complete(s, ++calls == 3 ? serial + 1000 : serial, t, e);
}
"""


@pytest.mark.parametrize("example", [HOST, PIPELINED], ids=["host", "pipelined_host"])
def test_an_example_host_reports_the_schedulers_error_and_frees_everything(tmp_path, example):
    """A failing call prints the scheduler's message (not "?": the error is read after the
    call that sets it), and the error and the scheduler are freed on the way out."""
    if sys.platform != "linux":
        pytest.skip("-Wl,--wrap is GNU ld's")
    wrap = tmp_path / "wrap.c"
    wrap.write_text(FAIL_THIRD_COMPLETE)
    exe = tmp_path / "host"
    subprocess.run([_compiler(), str(example), str(wrap), "-Wall", "-Wextra", "-Werror",
                    *_config_flags(), "-Wl,--wrap=skippy_scheduler_complete", "-o", str(exe)],
                   check=True)
    command = [str(exe)]
    if shutil.which("valgrind"):
        command = ["valgrind", "--leak-check=full", "--show-leak-kinds=all",
                   "--errors-for-leak-kinds=all", "--error-exitcode=3", "-q", *command]
    run = subprocess.run(command, capture_output=True, text=True)
    assert run.returncode == 1, run.stderr
    failed = [line for line in run.stderr.splitlines() if line.startswith("complete failed: ")]
    assert len(failed) == 1 and failed[0] != "complete failed: ?", run.stderr
    assert "plan" in failed[0], run.stderr  # the scheduler's message names the unknown plan
