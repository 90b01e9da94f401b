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
import textwrap
from types import ModuleType
from typing import Any, Callable, Iterator, NoReturn, Sequence, TypeVar

from .._validate import MAX_MS
from .vocabulary import add_flag

USAGE_ERROR = 2
GGUF_MAGIC = b"GGUF"
DEFAULT_THREADS = 2  # llama.cpp threads of run and serve (calibrate has its reason for 1)
LLAMA_MAX_SEQUENCES = 256  # llama.cpp's sequence ids


class CommandError(Exception):
    """A user-facing error: printed without a traceback, exit status 2."""


def _one_line(message: str) -> str:
    return " ".join(part.strip() for part in str(message).splitlines() if part.strip())


class _Formatter(argparse.HelpFormatter):
    """argparse's help layout, lines broken at spaces only: a flag's name (`--itl-target-ms`)
    or a path is never split at its hyphens."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        text = " ".join(text.split())
        return textwrap.wrap(text, width, break_on_hyphens=False, break_long_words=False)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        text = " ".join(text.split())
        return textwrap.fill(text, width, initial_indent=indent, subsequent_indent=indent,
                             break_on_hyphens=False, break_long_words=False)


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are the usage line plus one `prog: error: ...` line, and
    which reads an option only as it is spelled in full, as llama.cpp does: no prefixes
    (`--max-tokens` is not `--max-tokens-per-iteration`, `-n` is not `-np`) and no value glued
    to a short option (`-ctk` is not `-c tk`)."""

    # The top-level parser's subcommand parsers, by name (set by build_parser).
    commands: dict[str, "Parser"]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", _Formatter)
        super().__init__(*args, **kwargs)

    def _get_option_tuples(self, option_string: str) -> list[Any]:
        # argparse's guesses at what a string that is no option meant. allow_abbrev=False
        # stops them for `--` options only (Python < 3.12 still matches `-n` to `-np`), and no
        # version stops `-ctk` meaning `-c tk`: an unknown string stays unknown here.
        if not self.allow_abbrev:
            return []
        return super()._get_option_tuples(option_string)

    def fail(self, message: str) -> int:
        """Print a user error the way argparse does (usage, then the message); return 2."""
        # An unbounded width keeps the usage on one line, whatever the terminal.
        formatter = argparse.HelpFormatter(prog=self.prog, width=1 << 30)
        formatter.add_usage(self.usage, self._actions, self._mutually_exclusive_groups)
        sys.stderr.write(formatter.format_help())
        sys.stderr.write(f"{self.prog}: error: {_one_line(message)}\n")
        return USAGE_ERROR

    def error(self, message: str) -> NoReturn:  # argparse's hook for its own parse errors
        self.fail(message)
        sys.exit(USAGE_ERROR)


# -- argument types: argparse turns ArgumentTypeError into "argument --x: <message>" ----------


_N = TypeVar("_N", int, float)


def _number(text: str, kind: Callable[[str], _N]) -> _N:
    try:
        return kind(text)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None


#: The largest count a flag takes (tokens, requests, bytes, seeds): what the C core's 32-bit
#: counts hold, far beyond any real setting.
MAX_COUNT = (1 << 32) - 1


def _at_most(value: float, limit: float, text: str, unit: str = "") -> None:
    if value > limit:
        shown = f"{limit:g}" if isinstance(limit, float) else str(limit)
        raise argparse.ArgumentTypeError(f"expected at most {shown}{unit}, got {text}")


def positive_int(text: str) -> int:
    value = _number(text, int)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text}")
    _at_most(value, MAX_COUNT, text)
    return value


#: llama.cpp's GGML_MAX_N_THREADS: more threads fail to start (32768: libgomp cannot create
#: them) or crash it (65536).
LLAMA_MAX_THREADS = 512


def _positive_up_to(text: str, limit: int, why: str) -> int:
    """An integer in [1, limit]; above it, a usage error that says `why` it is the limit."""
    value = positive_int(text)
    if value > limit:
        raise argparse.ArgumentTypeError(f"expected at most {limit} ({why}), got {text}")
    return value


def thread_count(text: str) -> int:
    """-t/--threads: an integer in [1, LLAMA_MAX_THREADS]."""
    return _positive_up_to(text, LLAMA_MAX_THREADS, "llama.cpp's GGML_MAX_N_THREADS")


def plans_in_flight_count(text: str) -> int:
    """--inflight: an integer in [1, 255], the plans a scheduler keeps live at once."""
    from ..types import MAX_INFLIGHT_PLANS

    return _positive_up_to(text, MAX_INFLIGHT_PLANS, "the plans a scheduler keeps live at once")


def non_negative_int(text: str) -> int:
    value = _number(text, int)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text}")
    _at_most(value, MAX_COUNT, text)
    return value


def positive_float(text: str) -> float:
    value = _number(text, float)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text}")
    return value


def fraction(text: str) -> float:
    """A number in [0, 1] (a share)."""
    value = _number(text, float)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text}")
    return value


def int_in(lo: int, hi: int) -> Callable[[str], int]:
    """An argument type: an integer in [lo, hi]."""
    def parse(text: str) -> int:
        value = _number(text, int)
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"expected an integer in [{lo}, {hi}], got {text}")
        return value

    return parse


def bound(text: str) -> int | None:
    """An argument type: an integer >= 0, where 0 means no bound (None)."""
    return non_negative_int(text) or None


def positive_ms(text: str) -> float:
    """A number of milliseconds in (0, MAX_MS] (a target such as --itl-target-ms)."""
    value = _number(text, float)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number of ms > 0, got {text}")
    _at_most(value, MAX_MS, text, " ms")
    return value


def non_negative_ms(text: str) -> float:
    """A number of milliseconds in [0, MAX_MS] (a bound such as --prefill-age-max-ms)."""
    value = _number(text, float)
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number of ms >= 0, got {text}")
    _at_most(value, MAX_MS, text, " ms")
    return value


# -- paths ----------------------------------------------------------------------------------


def _probe_file(option: str, path: str) -> None:
    """Open the file for writing as the run will (without truncating it), then undo that:
    permission bits do not say everything (root, /proc, /sys, read-only mounts)."""
    existed = os.path.exists(path)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | (0 if existed else os.O_CREAT | os.O_EXCL))
    except OSError as exc:
        raise CommandError(f"{option}: cannot write {path}: {exc.strerror}") from None
    os.close(fd)
    if not existed:
        os.unlink(path)


def check_output_file(option: str, path: str | None,
                      inputs: Sequence[tuple[str, Any]] = ()) -> None:
    """Refuse an output file that cannot be written: its directory must exist and be writable,
    and the file must open for writing; nor may it be one of the command's `inputs` ((option,
    path) pairs, a path None or not a file ignored), which writing it would destroy."""
    if path is None:
        return
    if not path:
        raise CommandError(f"{option}: empty path")
    if os.path.isdir(path):
        raise CommandError(f"{option}: {path} is a directory")
    for name, given in inputs:
        if not given or not isinstance(given, (str, os.PathLike)):
            continue
        try:
            same = os.path.exists(path) and os.path.samefile(path, given)
        except OSError:
            same = False
        if same:
            raise CommandError(f"{option}: {path} is the {name} file; writing it would "
                               "destroy it (give another path)")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        problem = "is not a directory" if os.path.exists(parent) else "does not exist"
        raise CommandError(f"{option}: cannot write {path}: {parent} {problem}")
    if os.path.exists(path):
        if not os.access(path, os.W_OK):
            raise CommandError(f"{option}: cannot write {path}: permission denied")
    elif not os.access(parent, os.W_OK | os.X_OK):
        raise CommandError(f"{option}: cannot write {path}: directory {parent} is not writable")
    _probe_file(option, path)


def check_distinct_outputs(*outputs: tuple[str, Any]) -> None:
    """Refuse two outputs of one command at the same path ((option, path) pairs, None paths
    ignored): the second written would replace the first, or fail after the whole run."""
    seen: dict[str, str] = {}
    for option, path in outputs:
        if not path:
            continue
        key = os.path.realpath(os.fspath(path))
        if key in seen:
            raise CommandError(f"{option}: {path} is also the {seen[key]} output (give another "
                               "path)")
        seen[key] = option


def _probe_dir(option: str, path: str) -> None:
    """Make the directory (and missing parents) and a file in it, then remove what was made."""
    made: list[str] = []
    here = os.path.abspath(path)
    while not os.path.exists(here):
        made.append(here)
        here = os.path.dirname(here)
    try:
        for directory in reversed(made):
            os.mkdir(directory)
        fd, probe = tempfile.mkstemp(prefix=".skippy-probe-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        verb = "create" if made else "write into"
        raise CommandError(f"{option}: cannot {verb} {path}: {exc.strerror}") from None
    finally:
        for directory in made:
            with contextlib.suppress(OSError):
                os.rmdir(directory)


def check_output_dir(option: str, path: str | None) -> None:
    """Refuse an output directory that cannot be created or written (missing parents are made
    when the results are written)."""
    if path is None:
        return
    if not path:
        raise CommandError(f"{option}: empty path")
    if os.path.exists(path):
        if not os.path.isdir(path):
            raise CommandError(f"{option}: {path} is not a directory")
        if not os.access(path, os.W_OK | os.X_OK):
            raise CommandError(f"{option}: directory {path} is not writable")
    else:
        ancestor = os.path.dirname(os.path.abspath(path))
        while not os.path.exists(ancestor):
            ancestor = os.path.dirname(ancestor)
        if not os.path.isdir(ancestor):
            raise CommandError(f"{option}: cannot create {path}: {ancestor} is not a directory")
        if not os.access(ancestor, os.W_OK | os.X_OK):
            raise CommandError(f"{option}: cannot create {path}: directory {ancestor} is not "
                               "writable")
    _probe_dir(option, path)


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


def check_model_file(option: str, path: str, *, allow_stage: bool = True) -> None:
    """Refuse a GGUF file that is not a whole model (truncated, damaged; with `allow_stage`
    False, a stage file from `split` too) with one line: its header and its tensors' extent
    are read, no weights (needs gguf; without it llama.cpp's own load says what is wrong)."""
    check_gguf(option, path)
    try:
        import gguf  # noqa: F401
    except ImportError:
        return
    from ..hosts.offload import ModelFileError, footprint_from_gguf

    try:
        footprint_from_gguf(path, allow_stage=allow_stage)
    except ModelFileError as exc:
        raise CommandError(f"{option}: {exc}") from None


# -- the llama.cpp model (run, calibrate) ---------------------------------------------------


def add_model_options(p: argparse.ArgumentParser, *, threads: int | None = DEFAULT_THREADS,
                      threads_note: str | None = None, stages: bool = False,
                      backend_sampling: bool = False, stage_ahead: bool = False) -> None:
    """The llama.cpp model options every model command takes (run, serve, calibrate).
    `stages`: the command also runs local stage workers, whose threads default to the cores
    divided among them (the flag's default is then None: the command decides).
    `backend_sampling`: the command passes -bs/--backend-sampling to its `LlamaHost` (a command
    that would ignore it does not take it). `stage_ahead`: the same for --stage-ahead."""
    from .offload import add_offload_options, device_names

    add_flag(p, "model", default_text="a tiny random-weight model written to a temporary "
                                      "directory")
    add_flag(p, "seed", type=non_negative_int, default=0, note="it draws the tiny default model's weights")
    if stages:
        add_flag(p, "threads", type=thread_count, default=None,
                 default_text=f"{DEFAULT_THREADS}; with --stages, each local stage worker gets "
                              "the cores divided among the stages", note=threads_note)
        p.add_argument("--stage-devices", type=device_names, default=(), metavar="DEV,DEV,...",
                       help="with --stages: the device of each local stage worker, stage 0 "
                            "first, e.g. CUDA0,CUDA1 (each worker gets -dev DEV; default: the "
                            "offload flags as given, for every stage)")
    else:
        add_flag(p, "threads", type=thread_count, default=threads, note=threads_note)
    p.add_argument("--kv-type", choices=("f32", "f16"), default=None,
                   help="KV cache type (docs/hosts.md, 'When the tokens are the same') "
                        "(default: "
                        "f32 on the CPU, f16 with layers on a GPU)")
    p.add_argument("-fa", "--flash-attn", nargs="?", const="on", choices=("on", "off", "auto"),
                   default=None,
                   help="flash attention: faster, gives up batch-invariant tokens; the flag "
                        "alone means on (default: off on the CPU, auto with layers on a GPU)")
    if backend_sampling:
        add_backend_sampling_option(p)
    if stage_ahead:
        p.add_argument("--stage-ahead", nargs="?", const="on", choices=("on", "off", "auto"),
                       default="auto",
                       help="with plans in flight, stage the next plan's batch while the "
                            "device runs the current one, so that the device waits only for "
                            "the sampling between two steps; the flag alone means on "
                            "(default: auto, on with layers on a GPU, where llama_decode "
                            "returns before the step is done; only auto with --stages)")
    add_offload_options(p)


def add_backend_sampling_option(p: argparse.ArgumentParser) -> None:
    """-bs/--backend-sampling [on|off|auto] (llama-server's flag): `LlamaHost(backend_sampling=
    args.backend_sampling)`."""
    p.add_argument("-bs", "--backend-sampling", nargs="?", const="on",
                   choices=("on", "off", "auto"), default="auto",
                   help="sample on the device (llama.cpp's backend samplers, experimental): "
                        "greedy, temperature, top-k/p, min-p, seeds, penalties and logit bias "
                        "run inside the decode, which hands back the tokens; requests with log-probabilities or a grammar keep the host path; the "
                        "flag alone means on (default: auto, on with layers on a GPU)")


def refuse_rpc_with_stages(args: argparse.Namespace) -> None:
    """--rpc registers RPC servers in this process, which loads no layer with --stages or
    --stage-addresses (the stage workers do), and an RPC server serves one process at a time.
    So are the llama.cpp host's -bs/--backend-sampling and --stage-ahead other than auto,
    which the stage workers would ignore."""
    if getattr(args, "rpc", ()) and (getattr(args, "stages", None)
                                     or getattr(args, "stage_addresses", None)):
        flag = "--stages" if getattr(args, "stages", None) else "--stage-addresses"
        raise CommandError(f"--rpc with {flag}: the stage workers load the layers, and an RPC "
                           "server serves one process at a time; give each `skippy-scheduler "
                           "stage` its own --rpc HOST:PORT (docs/gpu.md)")
    if (getattr(args, "stages", None) or getattr(args, "stage_addresses", None)) and (
            getattr(args, "backend_sampling", "auto"), getattr(args, "stage_ahead", "auto")
    ) != ("auto", "auto"):
        raise CommandError("--backend-sampling and --stage-ahead are the llama.cpp host's; the "
                           "stage workers sample on the last stage and do not stage ahead: "
                           "leave them at auto with --stages or --stage-addresses")


def stage_worker_args(args: argparse.Namespace, stages: int) -> list[list[str]]:
    """The offload flags of each local stage worker: the command's own, with
    `--stage-devices` giving each its device."""
    from .offload import offload_argv

    base = offload_argv(args)
    devices = tuple(getattr(args, "stage_devices", ()) or ())
    if devices and len(devices) != stages:
        raise CommandError(f"--stage-devices names {len(devices)} device(s) for {stages} "
                           "stages")
    if not devices:
        return [base] * stages
    if "-dev" in base:
        i = base.index("-dev")
        base = base[:i] + base[i + 2:]
    return [base + ["-dev", d] for d in devices]


def import_llama_host() -> ModuleType:
    """`skippy_scheduler.hosts.llama`, imported only when a command needs it (the `llama` extra)."""
    try:
        from ..hosts import llama
    except ImportError as exc:
        raise CommandError(
            f"llama.cpp is not available ({exc}); "
            "install it from the checkout with: pip install '.[llama]'") from None
    return llama


def check_model(args: argparse.Namespace) -> None:
    """--model must be a GGUF file; without it the tiny model is written, which needs gguf."""
    if args.model is not None:
        check_gguf("--model", args.model)
        return
    try:
        import gguf  # noqa: F401
    except ImportError as exc:
        raise CommandError(
            f"the default tiny model needs the gguf package ({exc}); pass --model or "
            "install it from the checkout with: pip install '.[llama]'") from None


@contextlib.contextmanager
def model_path(args: argparse.Namespace) -> Iterator[str]:
    """The --model path, or a tiny random-weight model in a temp dir for the command's duration."""
    if args.model:
        yield str(args.model)
        return
    from ..hosts.tiny_model import write_tiny_llama

    with tempfile.TemporaryDirectory(prefix="skippy-tiny-") as tmp:
        yield str(write_tiny_llama(os.path.join(tmp, "tiny-llama-f32.gguf"), seed=args.seed))
