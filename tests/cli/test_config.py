"""`skippy-scheduler config` and the installed pkg-config file name the installed core."""
from __future__ import annotations

import os
import pathlib
import shlex
import shutil
import subprocess

import pytest

import skippy_scheduler
from skippy_scheduler.cli import main

CFLAGS = f"-I{skippy_scheduler.get_include()}"
LIBS = f"-L{skippy_scheduler.get_library_dir()} -lskippy_scheduler_core -lm"


def _config(capsys, *flags):
    assert main(["config", *flags]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    return out


def test_cflags_and_libs(capsys):
    assert _config(capsys, "--cflags") == CFLAGS + "\n"
    assert _config(capsys, "--libs") == LIBS + "\n"
    # One line in compile-then-link order, whatever the order of the options.
    assert _config(capsys, "--cflags", "--libs") == f"{CFLAGS} {LIBS}\n"
    assert _config(capsys, "--libs", "--cflags") == f"{CFLAGS} {LIBS}\n"


def test_flags_name_the_installed_files(capsys):
    include = _config(capsys, "--cflags").strip()[2:]
    assert os.path.isfile(os.path.join(include, "skippy_scheduler.h"))
    lib_dir = _config(capsys, "--libs").split()[0][2:]
    assert os.path.isfile(os.path.join(lib_dir, "libskippy_scheduler_core.a"))


def test_pkgconfigdir(capsys):
    directory = _config(capsys, "--pkgconfigdir").strip()
    assert directory == os.path.join(skippy_scheduler.get_library_dir(), "pkgconfig")
    text = pathlib.Path(directory, "skippy-scheduler.pc").read_text(encoding="utf-8")
    assert f"\nVersion: {skippy_scheduler.__version__}\n" in text
    both = _config(capsys, "--cflags", "--pkgconfigdir").splitlines()
    assert both == [CFLAGS, directory]


def _dirs(flags: list[str], prefix: str) -> list[str]:
    return [os.path.realpath(f[2:]) for f in flags if f.startswith(prefix)]


def test_pkg_config_gives_the_same_flags(capsys):
    pkg_config = shutil.which("pkg-config")
    if pkg_config is None:
        pytest.skip("pkg-config is not installed")
    env = dict(os.environ, PKG_CONFIG_PATH=_config(capsys, "--pkgconfigdir").strip())
    run = subprocess.run([pkg_config, "--cflags", "--libs", "skippy-scheduler"],
                         capture_output=True, text=True, env=env)
    assert run.returncode == 0, run.stderr
    flags = shlex.split(run.stdout)
    ours = f"{CFLAGS} {LIBS}".split()
    # pkg-config spells the directories relative to the .pc file; they are the same ones.
    assert _dirs(flags, "-I") == _dirs(ours, "-I")
    assert _dirs(flags, "-L") == _dirs(ours, "-L")
    assert [f for f in flags if f.startswith("-l")] == ["-lskippy_scheduler_core", "-lm"]
    version = subprocess.run([pkg_config, "--modversion", "skippy-scheduler"],
                             capture_output=True, text=True, env=env, check=True)
    assert version.stdout.strip() == skippy_scheduler.__version__
