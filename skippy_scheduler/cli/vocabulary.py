"""The command line's vocabulary: one flag per concept, one meaning per flag, in every subcommand.

A concept that more than one subcommand takes (the model file, the step's token budget, the
admission policy, ...) is declared once here, with the spellings users of llama.cpp and vLLM
already type, and every subcommand adds it with `add_flag(parser, concept, default=...)`, so
its names and the first part of its help are the same everywhere. A subcommand whose purpose
needs another default passes it, with the reason as `note` (it is printed in the help).

    add_flag(p, "model")                                   # -m/--model PATH
    add_flag(p, "max-active", default=8)                   # -np/--max-active N
    add_flag(p, "batch-tokens", default=2048, note="the lab models a larger accelerator")

Spellings of earlier releases (`Flag.old`) still parse, hidden from the help, and print one
deprecation line on stderr; they go in the next release. An option is read only as spelled in
full (`_common.Parser`), and a llama-server flag that a subcommand does not take is refused with
the reason (`LLAMA_SERVER_FLAGS`). `tests/cli/test_vocabulary.py` walks
every subcommand's help against its own table of concepts.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from ..selection import IMPLEMENTATIONS, OLD_POLICY_NAMES, POLICIES, policy_name


@dataclass(frozen=True)
class Flag:
    """One concept's option strings (as argparse shows them), its meaning and old spellings."""

    concept: str
    names: tuple[str, ...]
    meaning: str  # the help's first part, the same in every subcommand
    metavar: Optional[str] = None
    old: tuple[str, ...] = ()  # deprecated spellings with the same value

    @property
    def long(self) -> str:
        return next(n for n in self.names if n.startswith("--"))

    @property
    def dest(self) -> str:
        return self.long[2:].replace("-", "_")


_FLAGS = (
    Flag("model", ("-m", "--model"), "GGUF model file", "PATH"),
    Flag("threads", ("-t", "--threads"), "llama.cpp compute threads", "N"),
    Flag("ctx-size", ("-c", "--ctx-size"),
         "KV cells in total, split evenly between the sequences running at once (each "
         "lane holds ctx-size / max-active tokens; llama.cpp allocates its cells in "
         "multiples of 256)", "N"),
    Flag("max-active", ("-np", "--max-active"),
         "sequences running at once (on a model, one llama.cpp sequence each)", "N"),
    Flag("max-tokens", ("-n", "--max-tokens"), "tokens generated per request at most", "N"),
    Flag("batch-tokens", ("-b", "--max-num-batched-tokens"),
         "token budget of one step: prefill chunks and decode rows together (on a model, the "
         "llama.cpp batch size)", "N", old=("--batch-size", "--max-tokens-per-iteration")),
    Flag("prefill-chunk", ("--prefill-chunk",),
         "prompt tokens of one sequence per step at most", "N", old=("--chunk",)),
    Flag("mixed", ("--mixed", "--no-mixed"),
         "mixed planning: decode rows ride along with prefill chunks in one step"),
    Flag("max-consecutive-prefill", ("--max-consecutive-prefill",),
         "prefill-only steps in a row while running sequences wait to decode, 0 for no "
         "bound", "N"),
    Flag("policy", ("--policy",),
         "admission order of waiting requests: " + ", ".join(POLICIES), "NAME",
         old=("--admission",)),
    Flag("scheduler", ("--scheduler",),
         "scheduler implementation: native (the C core) or twin (the pure-Python twin, "
         "same plans)", "{" + ",".join(IMPLEMENTATIONS) + "}"),
    Flag("served-model-name", ("-a", "--served-model-name", "--alias"),
         "model id that /v1/models reports", "NAME", old=("--model-name",)),
    Flag("seed", ("--seed",), "random seed", "N"),
    Flag("json", ("--json",),
         "write the results as JSON to FILE (checked before the run starts)", "FILE"),
    Flag("prefix-cache-tokens", ("--prefix-cache-tokens",),
         "tokens of finished requests' KV kept as reusable prefixes (0: no reuse)", "N"),
    Flag("prefix-holders", ("--prefix-holders",),
         "sequence ids that hold resident prefixes, with reuse", "K"),
    Flag("planning-rule", ("--planning-rule",),
         "how a step is filled when prefill and decode both wait: slack (each step's prefill "
         "chunk sized to the tightest running stream's inter-token target, docs/behaviour.md "
         "§2.13) or reference (the reference's mixed-plan gate; --mixed and "
         "--max-consecutive-prefill apply to it only)", "{slack,reference}"),
    Flag("itl-target", ("--itl-target-ms",), "inter-token target in ms", "MS"),
    Flag("prefill-age-max", ("--prefill-age-max-ms",),
         "under the slack rule, > 0: prompts are prefilled shortest first, but one waiting "
         "this long since its arrival (with a first-token deadline: since the deadline) goes "
         "first; 0: in arrival order "
         "(docs/behaviour.md §2.13, docs/serving.md)",
         "MS"),
    Flag("inflight", ("--inflight",),
         "plans in flight: with 2, the next plan is made while the model runs the current one",
         "D"),
)
FLAGS: dict[str, Flag] = {f.concept: f for f in _FLAGS}

# llama-server's flags that a subcommand does not take, and why: a user who types one gets the
# reason and what to type here instead, not "unrecognized arguments". (Those that mean here what
# they mean there are options of the commands that take them: -m, -t, -c, -np, -b, -n, -a above,
# -fa, -kvu on run, and the offload flags of offload.py.)
_PREDICT = ("is llama-server's tokens to generate: run takes it (-n/--max-tokens); serve "
            "generates what each request's max_tokens (or n_predict) asks, with no server-wide "
            "setting; the lab's requests carry their own")
LLAMA_SERVER_FLAGS: dict[str, str] = {
    "-n": _PREDICT,
    "--predict": _PREDICT,
    "--n-predict": _PREDICT,
    "--max-tokens": "is the tokens generated per request, which run takes (-n/--max-tokens); "
                    "serve generates what each request's max_tokens asks, with no server-wide "
                    "setting",
    "-s": "is llama-server's sampling seed: here each request's seed field seeds its sampling, "
          "and --seed draws the tiny default model's weights",
    "-fa": "is llama-server's flash attention, which run, serve and calibrate take "
           "(-fa/--flash-attn on|off|auto)",
    "-ctk": "is llama-server's K cache type: here --kv-type f32|f16 sets K and V together",
    "-ctv": "is llama-server's V cache type: here --kv-type f32|f16 sets K and V together",
    "--cache-type-k": "is llama-server's K cache type: here --kv-type f32|f16 sets K and V "
                      "together",
    "--cache-type-v": "is llama-server's V cache type: here --kv-type f32|f16 sets K and V "
                      "together",
    "-ub": "is llama-server's physical batch, which follows the device here: the logical "
           "batch (-b/--max-num-batched-tokens) on the CPU, 512 with layers on a GPU",
    "-tb": "is llama-server's batch threads: here -t/--threads sets both",
    "-cb": "is llama-server's continuous batching, which is always on here",
    "-nocb": "turns off llama-server's continuous batching, which is always on here",
    "-kvu": "is llama-server's unified KV cache: run takes it as --kv-unified; serve gives each "
            "lane and prefix holder a KV stream of its own",
    "-no-kvu": "is llama-server's KV stream per slot, which serve always uses (run: without "
               "--kv-unified)",
    "--parallel": "is llama-server's slot count: here -np/--max-active",
    "-to": "is llama-server's read/write timeout: serve takes --header-timeout and "
           "--body-timeout",
    "-hf": "downloads a model from Hugging Face in llama-server: here -m/--model takes a local "
           "GGUF file",
    "-v": "is llama-server's verbose log: serve takes --log-level debug",
    "-lv": "is llama-server's log verbosity: serve takes --log-level",
    "--no-webui": "turns off llama-server's web UI: serve has none",
}


def unrecognized(extras: Sequence[str]) -> str:
    """The error for arguments a subcommand did not take: the reason for the first llama-server
    flag among them (LLAMA_SERVER_FLAGS), else argparse's "unrecognized arguments"."""
    for text in extras:
        flag = text.split("=", 1)[0]
        if flag in LLAMA_SERVER_FLAGS:
            return f"{flag} {LLAMA_SERVER_FLAGS[flag]}"
    return f"unrecognized arguments: {' '.join(extras)}"


def warn_old(prog: str, old: str, new: str) -> None:
    """The one line an old spelling prints (stderr; not a Python warning)."""
    print(f"{prog}: warning: {old} is deprecated and goes in the next release; use {new}",
          file=sys.stderr, flush=True)


class _OldSpelling(argparse.Action):
    """A hidden old spelling: stores like the current flag and says it is deprecated."""

    def __init__(self, option_strings: Sequence[str], dest: str, *, new: str,
                 const: Any = None, nargs: Any = None, **kwargs: Any) -> None:
        self.new = new
        super().__init__(option_strings, dest, nargs=nargs, const=const, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: Optional[str] = None) -> None:
        warn_old(parser.prog, option_string or self.option_strings[0], self.new)
        setattr(namespace, self.dest, self.const if self.nargs == 0 else values)


def add_old(p: argparse.ArgumentParser | Any, old: str, new: str, dest: str, *,
            const: Any = None, flag: bool = False, repeat: bool = False,
            **kwargs: Any) -> None:
    """Accept `old` (hidden) for `new`: `flag=True` for a switch that stores `const`,
    `repeat=True` for a repeatable option (each use appends)."""
    if repeat:
        p.add_argument(old, dest=dest, action=_OldAppend, new=new, help=argparse.SUPPRESS,
                       default=argparse.SUPPRESS, **kwargs)
        return
    p.add_argument(old, dest=dest, action=_OldSpelling, new=new, help=argparse.SUPPRESS,
                   default=argparse.SUPPRESS, const=const, nargs=0 if flag else None, **kwargs)


def policy_arg(text: str) -> str:
    """`--policy`'s type: a policy name (an old spelling is translated, with a warning)."""
    try:
        name = policy_name(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if text in OLD_POLICY_NAMES:
        warn_old("skippy-scheduler", f"policy name {text!r}", repr(name))
    return name


def _default_text(default: Any) -> str:
    if isinstance(default, bool):
        return "on" if default else "off"
    if isinstance(default, float) and default.is_integer():
        return str(int(default))  # 150, as the docs write it, not 150.0
    return str(default)


def add_flag(p: argparse.ArgumentParser | Any, concept: str, *, default: Any = None,
             note: Optional[str] = None, default_text: Optional[str] = None,
             type: Optional[Callable[[str], Any]] = None, **kwargs: Any) -> argparse.Action:
    """Add `concept`'s flag (and its hidden old spellings) to parser or argument group `p`.

    The help is the concept's meaning, then `note` (why this subcommand differs, or what it adds),
    then the default (`default_text` when the value alone does not say it). Other keyword
    arguments go to `add_argument` (`action`, `choices`, `nargs`, ...).
    """
    f = FLAGS[concept]
    shown = default_text if default_text is not None else _default_text(default)
    if f.old and kwargs.get("action") != "append" and \
            not isinstance(p, argparse._MutuallyExclusiveGroup):
        # The flag and its old spellings are one mutually exclusive group: given under two
        # names, one value would silently replace the other.
        p = p.add_mutually_exclusive_group()
    if isinstance(p, argparse._MutuallyExclusiveGroup):
        # argparse counts a member as given when its value is not the default object, and a
        # small number or a short name typed on the command line can be that very object
        # (both are shared by the interpreter), so such a default becomes one of its own.
        if isinstance(default, int) and not isinstance(default, bool):
            default = _OwnDefault(default)
        elif isinstance(default, str):
            default = _OwnText(default)
    help_text = f.meaning + (f"; {note}" if note else "") + (f" (default: {shown})"
                                                             if shown != "None" else "")
    if concept == "mixed":
        kwargs.setdefault("action", argparse.BooleanOptionalAction)
        action = p.add_argument(f.long, dest=f.dest, default=default, help=help_text, **kwargs)
    else:
        if concept == "policy" and type is None:
            type = policy_arg
        if concept == "scheduler":
            kwargs.setdefault("choices", IMPLEMENTATIONS)
        if kwargs.get("action") not in ("store_true", "store_false"):
            kwargs.setdefault("metavar", f.metavar)
        if type is not None:
            kwargs["type"] = type
        action = p.add_argument(*f.names, dest=f.dest, default=default, help=help_text,
                                **kwargs)
    repeat = kwargs.get("action") == "append"
    for old in f.old:
        add_old(p, old, f.long, f.dest, repeat=repeat, type=type)
    return action


class _OwnDefault(int):
    """A flag's default number as an object of its own (see `add_flag`)."""


class _OwnText(str):
    """A flag's default text as an object of its own (see `add_flag`)."""


def plain_defaults(args: argparse.Namespace) -> None:
    """Give the parsed arguments their defaults back as plain ints and strings (after
    `add_flag`'s mutually exclusive groups have been checked)."""
    for name, value in vars(args).items():
        if type(value) is _OwnDefault:
            setattr(args, name, int(value))
        elif type(value) is _OwnText:
            setattr(args, name, str(value))


class _OldAppend(argparse.Action):
    """A hidden old spelling of a repeatable flag."""

    def __init__(self, option_strings: Sequence[str], dest: str, *, new: str,
                 **kwargs: Any) -> None:
        self.new = new
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: Optional[str] = None) -> None:
        warn_old(parser.prog, option_string or self.option_strings[0], self.new)
        setattr(namespace, self.dest, list(getattr(namespace, self.dest, None) or []) + [values])


__all__ = ["FLAGS", "Flag", "LLAMA_SERVER_FLAGS", "add_flag", "add_old", "plain_defaults",
           "policy_arg", "unrecognized", "warn_old"]
