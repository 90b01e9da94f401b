"""The installed package type-checks as a library: mypy --strict passes on the README's API tour
and on the examples, the compiled modules' stubs match what the modules define at runtime, and
the stub types are the ones the API really returns.

mypy runs in a temporary directory, so it reads the installed package (its py.typed marker and
the .pyi stubs next to the extensions), not the source tree.
"""
import ast
import importlib
import importlib.machinery
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("mypy")

import skippy_scheduler  # noqa: E402
from skippy_scheduler import Scheduler, _core  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
EXAMPLES = ROOT / "examples"
PACKAGE_DIR = pathlib.Path(skippy_scheduler.__file__).resolve().parent
# The compiled modules and their stubs (the same folder unless the install is editable).
BUILT_DIR = pathlib.Path(_core.__file__).resolve().parent


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A directory with an empty mypy config (no user or project settings leak in) and one cache
    shared by every run of this module (numpy's stubs are analysed once)."""
    d = tmp_path_factory.mktemp("mypy")
    (d / "mypy.ini").write_text("[mypy]\n")
    return d


def run_mypy(workdir, *files):
    cmd = [sys.executable, "-m", "mypy", "--strict", "--config-file", str(workdir / "mypy.ini"),
           "--cache-dir", str(workdir / "cache"), *map(str, files)]
    r = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, timeout=600)
    return r.returncode, r.stdout + r.stderr


def write(workdir, name, source):
    path = workdir / name
    path.write_text(textwrap.dedent(source))
    return path


def readme_tour():
    """The README's python example (its first python block: "Embedding the scheduler")."""
    text = README.read_text()
    heading = re.search(r"^### Embedding the scheduler", text, re.M)
    assert heading, "README.md has no '### Embedding the scheduler' section"
    block = re.search(r"```python\n(.*?)```", text[heading.end():], re.S)
    assert block, "the README's embedding section has no python block"
    return block.group(1)


def compiled_modules():
    suffixes = tuple(importlib.machinery.EXTENSION_SUFFIXES)
    names = {p.name.split(".")[0] for p in BUILT_DIR.iterdir() if p.name.endswith(suffixes)}
    assert names, f"no compiled module in {BUILT_DIR}"
    return sorted(names)


def test_the_whole_package_passes_mypy_strict(workdir):
    """`mypy --strict -p skippy_scheduler` from outside the repository (an empty config, so
    only --strict applies): every module, extras included, not only the API tour."""
    cmd = [sys.executable, "-m", "mypy", "--strict", "--config-file", str(workdir / "mypy.ini"),
           "--cache-dir", str(workdir / "cache"), "--ignore-missing-imports", "-p",
           "skippy_scheduler"]
    r = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_package_ships_its_types():
    assert (PACKAGE_DIR / "py.typed").is_file()
    missing = [m for m in compiled_modules() if not (BUILT_DIR / f"{m}.pyi").is_file()]
    assert not missing, f"compiled modules without a stub next to them: {missing}"


def test_readme_tour_passes_mypy_strict(workdir):
    code, out = run_mypy(workdir, write(workdir, "readme_tour.py", readme_tour()))
    assert code == 0, out


def test_examples_pass_mypy_strict(workdir):
    files = sorted(EXAMPLES.rglob("*.py"))
    if not files:
        pytest.skip("examples/ holds no Python file")
    code, out = run_mypy(workdir, *files)
    assert code == 0, out


def test_plan_iteration_reveals_iteration_plan(workdir):
    snippet = write(workdir, "reveal_plan.py", """\
        from skippy_scheduler import Scheduler

        scheduler = Scheduler()
        reveal_type(scheduler.plan_iteration())
        """)
    code, out = run_mypy(workdir, snippet)
    assert code == 0, out
    assert 'Revealed type is "skippy_scheduler._core.IterationPlan"' in out, out


def test_the_stubs_give_the_api_its_real_types(workdir):
    # Every assert_type is an error unless the stub's type is exactly this one; the dtypes are
    # the ones _core.pyx builds its views with (test_view_dtypes_are_the_stubbed_ones checks
    # them at runtime).
    snippet = write(workdir, "api_types.py", """\
        import numpy as np
        import numpy.typing as npt
        from _cffi_backend import FFI
        from typing_extensions import assert_type

        from skippy_scheduler import (
            IterationPlan, IterationTelemetry, PlanOutputs, Scheduler, SchedulerConfig,
            SchedulerMetrics, SchedulerSnapshot, Sequence,
        )
        from skippy_scheduler._abi import lib

        scheduler = Scheduler(SchedulerConfig())
        scheduler.submit(Sequence("a", [1, 2, 3], max_tokens=2))
        plan = scheduler.plan_iteration()
        assert_type(plan, IterationPlan)
        assert_type(plan.tokens, npt.NDArray[np.int32])
        assert_type(plan.positions, npt.NDArray[np.int32])
        assert_type(plan.row_offsets, npt.NDArray[np.uintp])
        assert_type(plan.sample_last, npt.NDArray[np.uint8])
        assert_type(plan.phases, npt.NDArray[np.uint8])
        assert_type(plan.slots, npt.NDArray[np.uint32])
        assert_type(plan.sample_rows, npt.NDArray[np.uintp])
        assert_type(plan.token_count, int)
        assert_type(plan.sequence_ids, list[str])
        assert_type(len(plan), int)
        out = plan.outputs
        assert_type(out, PlanOutputs)
        assert_type(out.request_indexes, npt.NDArray[np.uintp])
        assert_type(out.predicted_tokens, npt.NDArray[np.int32])
        out.count = 0
        assert_type(out.count, int)
        assert_type(plan.requests, FFI.CData)
        assert_type(scheduler.complete_iteration(plan), IterationTelemetry)
        assert_type(scheduler.metrics(), SchedulerMetrics)
        assert_type(scheduler.snapshot(), SchedulerSnapshot)
        snap = scheduler.sequence("a")
        assert snap is not None
        seq: Sequence = snap  # a read-only copy of a Sequence, its token lists tuples
        assert_type(snap.generated_tokens, tuple[int, ...])
        assert_type(scheduler.retired()[0].prompt_tokens, tuple[int, ...])
        assert_type(scheduler.preempt_for_component_pressure([0]), list[str])
        assert_type(scheduler.cancel("a"), bool)
        assert_type(scheduler.native, int)
        assert_type(lib.SKIPPY_PLAN_ABI_VERSION, int)
        """)
    code, out = run_mypy(workdir, snippet)
    assert code == 0, out


def test_view_dtypes_are_the_stubbed_ones():
    import numpy as np

    from skippy_scheduler import Sequence

    scheduler = Scheduler()
    scheduler.submit(Sequence("a", [1, 2, 3], max_tokens=2))
    plan = scheduler.plan_iteration()
    expected = {"tokens": np.int32, "positions": np.int32, "row_offsets": np.uintp,
                "sample_last": np.uint8, "phases": np.uint8, "slots": np.uint32,
                "sample_rows": np.uintp}
    for name, dtype in expected.items():
        assert getattr(plan, name).dtype == np.dtype(dtype), name
    assert plan.outputs.request_indexes.dtype == np.dtype(np.uintp)
    assert plan.outputs.predicted_tokens.dtype == np.dtype(np.int32)


def test_stubs_match_the_compiled_modules(workdir):
    allow = [
        # Cython's pickling helpers and doctest table: generated, not part of the API.
        r"skippy_scheduler\.\w+\.(\w+\.)?__(reduce|setstate)_cython__",
        r"skippy_scheduler\.\w+\.__test__",
        # The stub gives the cffi lib a class of its own constants and functions (checked
        # against dir(lib) below); at runtime it is a _cffi_backend.Lib.
        r"skippy_scheduler\._abi\.lib",
    ]
    if not hasattr(Scheduler, "retired"):
        # Stubbed ahead of the native method; stubtest flags the entry once it lands.
        allow.append(r"skippy_scheduler\._core\.Scheduler\.retired")
    allowlist = workdir / "stubtest-allowlist.txt"
    allowlist.write_text("\n".join(allow) + "\n")
    modules = [f"skippy_scheduler.{m}" for m in compiled_modules()]
    cmd = [sys.executable, "-m", "mypy.stubtest", "--mypy-config-file", str(workdir / "mypy.ini"),
           "--allowlist", str(allowlist), *modules]
    r = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr


def test_abi_stub_lists_exactly_the_lib_members():
    from skippy_scheduler._abi import lib

    tree = ast.parse((PACKAGE_DIR / "_abi.pyi").read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "_Lib"]
    constants = {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign)}
    functions = {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}
    runtime = {name for name in dir(lib) if not name.startswith("_")}
    assert constants | functions == runtime
    assert constants == {name for name in runtime if isinstance(getattr(lib, name), int)}
