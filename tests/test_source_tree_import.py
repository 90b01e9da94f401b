"""Importing an unbuilt source checkout by accident says so, instead of asking for a reinstall.

Python started in the repository root finds the `skippy_scheduler/` source folder before the
installed package; that folder has no compiled modules, and reinstalling would not change that.
"""
import os
import subprocess
import sys
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path

import pytest

import skippy_scheduler
from skippy_scheduler._native_check import (
    NativeBuildMismatch,
    SourceTreeImport,
    source_tree_message,
    source_tree_without_build,
)


def _repo_root():
    root = Path(__file__).resolve().parent.parent
    if (root / "pyproject.toml").is_file() and (root / "skippy_scheduler" / "__init__.py").is_file():
        return root
    return None


def _has_build(package_dir: Path) -> bool:
    return any((package_dir / f"_core{suffix}").exists() for suffix in EXTENSION_SUFFIXES)


def test_importing_the_source_tree_from_the_repository_root_names_it():
    root = _repo_root()
    if root is None:
        pytest.skip("the tests do not sit in a source checkout (an sdist, for one)")
    source = root / "skippy_scheduler"
    # PYTHONSAFEPATH would keep the working directory off sys.path, which is the whole point.
    env = {key: value for key, value in os.environ.items() if key != "PYTHONSAFEPATH"}
    result = subprocess.run(
        [sys.executable, "-c", "import skippy_scheduler"],
        cwd=root, env=env, capture_output=True, text=True, timeout=300,
    )
    if Path(skippy_scheduler.__file__).resolve().parent == source or _has_build(source):
        # An editable install or an in-place build makes the checkout importable: no false alarm.
        assert result.returncode == 0, result.stderr
        return
    assert result.returncode != 0
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith("skippy_scheduler._native_check.SourceTreeImport: "), result.stderr
    assert f"imported the source tree at {source}, which has no compiled modules" in last_line
    assert "run Python from another directory to use the installed package" in last_line
    assert "--force-reinstall" not in result.stderr


def _checkout(tmp_path: Path, *package_files: str) -> Path:
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    package = tmp_path / "skippy_scheduler"
    package.mkdir()
    for name in ("__init__.py", *package_files):
        (package / name).write_bytes(b"")
    return package


def test_an_unbuilt_checkout_is_recognised(tmp_path):
    package = _checkout(tmp_path)
    assert source_tree_without_build(str(package))
    message = source_tree_message(str(package))
    assert message.startswith(f"imported the source tree at {package}, which has no compiled modules;")
    assert f"`pip install -e .` in {tmp_path}" in message


@pytest.mark.parametrize("module", ["_core", "_abi", "_rank"])
def test_a_checkout_built_in_place_is_not_a_source_tree_import(tmp_path, module):
    # Its compiled modules exist; if they fail to import, that is a genuine build problem.
    package = _checkout(tmp_path, f"{module}{EXTENSION_SUFFIXES[0]}")
    assert not source_tree_without_build(str(package))


def test_an_installed_package_is_not_a_source_tree_import(tmp_path):
    package = tmp_path / "site-packages" / "skippy_scheduler"
    package.mkdir(parents=True)
    (package / "__init__.py").write_bytes(b"")
    assert not source_tree_without_build(str(package))


def test_both_failures_are_import_errors_of_their_own():
    assert issubclass(SourceTreeImport, ImportError) and issubclass(NativeBuildMismatch, ImportError)
    assert not issubclass(SourceTreeImport, NativeBuildMismatch)
