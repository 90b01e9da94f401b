"""What every subcommand shares: the user-error type, the parser, argument types, path checks.

A user error (a bad flag or value, a missing or unusable file) ends the command with one line on
stderr that names the problem, after the subcommand's usage line, and exit status 2. Paths a
command writes are checked before it starts working, so a long run cannot end in an error that
loses its results.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile

USAGE_ERROR = 2
GGUF_MAGIC = b"GGUF"


class CommandError(Exception):
    """A user-facing error: printed without a traceback, exit status 2."""


def _one_line(message: str) -> str:
    return " ".join(part.strip() for part in str(message).splitlines() if part.strip())


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are the usage line plus one `prog: error: ...` line."""

    commands: dict  # the top-level parser's subcommand parsers, by name (set by build_parser)

    def fail(self, message: str) -> int:
        """Print a user error the way argparse does (usage, then the message); return 2."""
        # An unbounded width keeps the usage on one line, whatever the terminal.
        formatter = argparse.HelpFormatter(prog=self.prog, width=1 << 30)
        formatter.add_usage(self.usage, self._actions, self._mutually_exclusive_groups)
        sys.stderr.write(formatter.format_help())
        sys.stderr.write(f"{self.prog}: error: {_one_line(message)}\n")
        return USAGE_ERROR

    def error(self, message: str):  # argparse's hook for its own parse errors
        self.fail(message)
        sys.exit(USAGE_ERROR)


# -- argument types: argparse turns ArgumentTypeError into "argument --x: <message>" ----------


def _number(text: str, kind):
    try:
        return kind(text)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None


def positive_int(text: str) -> int:
    value = _number(text, int)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text}")
    return value


def non_negative_int(text: str) -> int:
    value = _number(text, int)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text}")
    return value


def non_negative_float(text: str) -> float:
    value = _number(text, float)
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text}")
    return value


# -- paths ----------------------------------------------------------------------------------


def check_output_file(option: str, path: str | None) -> None:
    """Refuse an output file that cannot be written: its directory must exist and be writable."""
    if path is None:
        return
    if not path:
        raise CommandError(f"{option}: empty path")
    if os.path.isdir(path):
        raise CommandError(f"{option}: {path} is a directory")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        problem = "is not a directory" if os.path.exists(parent) else "does not exist"
        raise CommandError(f"{option}: cannot write {path}: {parent} {problem}")
    if os.path.exists(path):
        if not os.access(path, os.W_OK):
            raise CommandError(f"{option}: cannot write {path}: permission denied")
    elif not os.access(parent, os.W_OK | os.X_OK):
        raise CommandError(f"{option}: cannot write {path}: directory {parent} is not writable")


def check_output_dir(option: str, path: str | None) -> None:
    """Refuse an output directory that cannot be created or written (missing parents are made)."""
    if path is None:
        return
    if not path:
        raise CommandError(f"{option}: empty path")
    if os.path.exists(path):
        if not os.path.isdir(path):
            raise CommandError(f"{option}: {path} is not a directory")
        if not os.access(path, os.W_OK | os.X_OK):
            raise CommandError(f"{option}: directory {path} is not writable")
        return
    ancestor = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(ancestor):
        ancestor = os.path.dirname(ancestor)
    if not os.path.isdir(ancestor):
        raise CommandError(f"{option}: cannot create {path}: {ancestor} is not a directory")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise CommandError(f"{option}: cannot create {path}: directory {ancestor} is not writable")


def check_gguf(option: str, path: str) -> None:
    """Refuse a model path that is not a readable GGUF file (checked by its 4-byte magic)."""
    if not os.path.exists(path):
        raise CommandError(f"{option}: model file not found: {path}")
    if os.path.isdir(path):
        raise CommandError(f"{option}: {path} is a directory, not a GGUF model file")
    try:
        with open(path, "rb") as fh:
            magic = fh.read(len(GGUF_MAGIC))
    except OSError as exc:
        raise CommandError(f"{option}: cannot read {path}: {exc.strerror}") from None
    if magic != GGUF_MAGIC:
        raise CommandError(f"{option}: {path} is not a GGUF model file "
                           f"(it does not start with the GGUF magic)")


# -- the llama.cpp model (run, calibrate) ---------------------------------------------------


def add_model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", metavar="PATH",
                   help="GGUF model (default: a tiny random-weight model written to a temp dir)")
    p.add_argument("--seed", type=int, default=0, help="seed of the tiny default model (0)")
    p.add_argument("--threads", type=positive_int, default=2, help="llama.cpp threads (2)")
    p.add_argument("--kv-type", choices=("f32", "f16"), default="f32",
                   help="KV cache type; f32 (default) keeps batched and alone runs identical")
    p.add_argument("--flash-attn", action="store_true",
                   help="enable flash attention (faster, gives up batch-invariant tokens)")


def import_llama_host():
    """`skippy_scheduler.hosts.llama`, imported only when a command needs it (the `llama` extra)."""
    try:
        from ..hosts import llama
    except ImportError as exc:
        raise CommandError(
            f"llama.cpp is not available ({exc}); "
            "install it with: pip install 'skippy-scheduler[llama]'") from None
    return llama


def check_model(args) -> None:
    """--model must be a GGUF file; without it the tiny model is written, which needs gguf."""
    if args.model is not None:
        check_gguf("--model", args.model)
        return
    try:
        import gguf  # noqa: F401
    except ImportError as exc:
        raise CommandError(
            f"the default tiny model needs the gguf package ({exc}); pass --model or "
            "install it with: pip install 'skippy-scheduler[llama]'") from None


@contextlib.contextmanager
def model_path(args):
    """The --model path, or a tiny random-weight model in a temp dir for the command's duration."""
    if args.model:
        yield args.model
        return
    from ..hosts.tiny_model import write_tiny_llama

    with tempfile.TemporaryDirectory(prefix="skippy-tiny-") as tmp:
        yield write_tiny_llama(os.path.join(tmp, "tiny-llama-f32.gguf"), seed=args.seed)
