"""`skippy-scheduler config`: compiler and linker flags for a C host, like `pkg-config`.

    cc host.c $(skippy-scheduler config --cflags --libs) -o host

The same flags are in the installed `skippy-scheduler.pc`, for build systems that use
pkg-config: `PKG_CONFIG_PATH=$(skippy-scheduler config --pkgconfigdir)`.
"""
from __future__ import annotations

import argparse
import os
from typing import Any

from .. import get_include, get_library_dir
from ._common import CommandError

HEADER = "skippy_scheduler.h"
LIBRARY = "skippy_scheduler_core"
PC_FILE = "skippy-scheduler.pc"


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "config", help="compiler and linker flags for a C host (like pkg-config)",
        description="Print the flags that build a C host against the installed core: "
                    "cc host.c $(skippy-scheduler config --cflags --libs) -o host")
    p.add_argument("--cflags", action="store_true", help="print the include flag (-I...)")
    p.add_argument("--libs", action="store_true",
                   help=f"print the linker flags (-L... -l{LIBRARY} -lm)")
    p.add_argument("--pkgconfigdir", action="store_true",
                   help=f"print the directory holding {PC_FILE} (for PKG_CONFIG_PATH)")
    p.set_defaults(func=run)


def _installed(path: str, what: str) -> str:
    if not os.path.exists(path):
        raise CommandError(f"{what} is not installed (no {path}); "
                           "reinstall skippy-scheduler with pip")
    return path


def cflags() -> str:
    include = get_include()
    _installed(os.path.join(include, HEADER), "the C header")
    return f"-I{include}"


def libs() -> str:
    lib = get_library_dir()
    _installed(os.path.join(lib, f"lib{LIBRARY}.a"), "the core library")
    # The core is a static library that uses libm, so a host must link it too.
    return f"-L{lib} -l{LIBRARY} -lm"


def pkgconfigdir() -> str:
    directory = os.path.join(get_library_dir(), "pkgconfig")
    _installed(os.path.join(directory, PC_FILE), PC_FILE)
    return directory


def run(args: argparse.Namespace) -> int:
    if not (args.cflags or args.libs or args.pkgconfigdir):
        raise CommandError("nothing to print: give --cflags, --libs and/or --pkgconfigdir")
    lines = []
    # Flags on one line, in compile-then-link order whatever the option order, as pkg-config.
    flags = ([cflags()] if args.cflags else []) + ([libs()] if args.libs else [])
    if flags:
        lines.append(" ".join(flags))
    if args.pkgconfigdir:
        lines.append(pkgconfigdir())
    print("\n".join(lines))
    return 0
