"""`skippy-scheduler` command line.

Each subcommand lives in its own module exposing `register(subparsers)`, which adds an
argparse parser and sets `func` (a callable taking the parsed namespace and returning an exit
code). Add a module path to `SUBCOMMANDS` to register another one.
"""
from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS: list[str] = [
    "skippy_scheduler.lab.cli",
    "skippy_scheduler.hosts.cli_run",
    "skippy_scheduler.bench",
]


class CommandError(Exception):
    """A user-facing error: printed without a traceback, exit status 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="skippy-scheduler",
        description="Iteration-level scheduler for LLM serving: tools and the scheduler lab.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in SUBCOMMANDS:
        importlib.import_module(module).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except CommandError as exc:
        print(f"{parser.prog} {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # e.g. piped into `head`
        return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
