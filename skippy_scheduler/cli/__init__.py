"""`skippy-scheduler` command line.

Each subcommand is a module of this package exposing `register(subparsers)`, which adds its
parser and sets `func` (a callable taking the parsed namespace and returning an exit code).
Subcommand modules parse, validate, call library functions and print; the work itself lives
in the library (`skippy_scheduler.lab`, `skippy_scheduler.hosts`, `skippy_scheduler.bench`).
A user error raises `CommandError` (or is an argparse error) and ends with exit status 2.
SIGINT and SIGTERM end a command with one line and status 130 / 143 after it saved what
finished (`interrupt.py`), except in a subcommand that sets `own_signals` (serve drains itself).
The flags every subcommand shares are declared once, in `vocabulary.py`.
When stdout goes away (piped into `head`), a command that was asked for files (`--json`,
`--iteration-trace`, `--requests-out`, `--plot`: lab, run, calibrate) runs on with its output
dropped and writes them; one that was not stops there. Either way the exit status is what it
would have been (0 for a command that finished).
"""
from __future__ import annotations

import importlib
import os
import sys

from typing import Any, Iterable, TextIO

from .._version import __version__
from ._common import USAGE_ERROR, CommandError, Parser
from .interrupt import Interrupted, interruptible
from .vocabulary import plain_defaults, unrecognized

# Module names; a module registers its subcommand under its own name (write_tiny_model:
# write-tiny-model).
SUBCOMMANDS: tuple[str, ...] = ("lab", "run", "serve", "calibrate", "bench", "config", "split",
                                 "stage", "write_tiny_model", "export_hf_tokenizer",
                                 "dynamo_worker")

__all__ = ["CommandError", "Interrupted", "build_parser", "main"]


# The options naming files a command writes after (or while) it prints: what stdout going away
# must not lose.
FILE_OUTPUTS = ("json", "iteration_trace", "requests_out", "plot")


def _stdout_to_devnull() -> None:
    """Point stdout at /dev/null so the interpreter's final flush does not complain again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass


class _Stdout:
    """sys.stdout while a command runs. When the reader goes away (BrokenPipeError), the rest
    of the output is dropped and, with `keep_going` (files were asked for), the command goes on
    to write them; without, the BrokenPipeError ends it (`main`: status 0)."""

    def __init__(self, stream: TextIO, keep_going: bool) -> None:
        self._stream = stream
        self.keep_going = keep_going
        self.lost = False

    def _lose(self, exc: BrokenPipeError) -> None:
        self.lost = True
        _stdout_to_devnull()
        if not self.keep_going:
            raise exc

    def write(self, text: str) -> int:
        if not self.lost:
            try:
                return self._stream.write(text)
            except BrokenPipeError as exc:
                self._lose(exc)
        return len(text)

    def writelines(self, lines: Iterable[str]) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        if not self.lost:
            try:
                self._stream.flush()
            except BrokenPipeError as exc:
                self._lose(exc)

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding, ...
        return getattr(self._stream, name)


def build_parser() -> Parser:
    parser = Parser(
        prog="skippy-scheduler",
        description="Iteration-level scheduler for LLM serving: tools and the scheduler lab.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in SUBCOMMANDS:
        importlib.import_module(f"{__name__}.{name}").register(subparsers)
    parser.commands = subparsers.choices
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        # parse_known_args so that an unknown flag is reported by the subcommand's parser,
        # with its usage, rather than by the top-level one.
        args, extras = parser.parse_known_args(argv)
    except SystemExit as exc:  # --help, --version, or a parse error already printed
        return exc.code if isinstance(exc.code, int) else USAGE_ERROR
    command = parser.commands[args.command]
    plain_defaults(args)
    if extras:
        return command.fail(unrecognized(extras))
    stdout = sys.stdout
    try:
        if getattr(args, "own_signals", False):
            return int(args.func(args) or 0)
        sys.stdout = _Stdout(stdout, any(getattr(args, name, None) for name in FILE_OUTPUTS))
        with interruptible():
            return int(args.func(args) or 0)
    except CommandError as exc:
        return command.fail(str(exc))
    except Interrupted as exc:
        print(f"{command.prog}: {exc.line()}", file=sys.stderr, flush=True)
        return exc.status
    except BrokenPipeError:  # e.g. piped into `head`, with no file to write
        _stdout_to_devnull()
        return 0
    finally:
        sys.stdout = stdout
