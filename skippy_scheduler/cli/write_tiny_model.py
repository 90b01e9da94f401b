"""`skippy-scheduler write-tiny-model PATH`: write the built-in tiny random-weight model.

It is the model `run`, `serve` and `calibrate` write to a temporary directory when no `--model`
is given (the same `--seed` gives the same bytes), kept in a file so that commands which need a
GGUF file, such as `split`, can be tried without downloading one. Needs the `gguf` package
(the `llama` extra).
"""
from __future__ import annotations

import argparse
import os
from typing import Any

from ._common import CommandError, check_output_file, non_negative_int
from .vocabulary import add_flag


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "write-tiny-model", help="write the built-in tiny random-weight model to a GGUF file",
        usage="%(prog)s PATH [--seed N]",
        description="Write the tiny random-weight LLaMA model (2 layers, f32; its words are "
                    "noise) that run, serve and calibrate use without --model, to PATH, so that "
                    "split and the other commands can be tried on a file.")
    p.add_argument("path", metavar="PATH", help="GGUF file to write (replaced if it exists)")
    add_flag(p, "seed", type=non_negative_int, default=0,
             note="it draws the weights, as run's and serve's --seed does")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    check_output_file("PATH", args.path)
    try:
        import gguf  # noqa: F401
    except ImportError as exc:
        raise CommandError(f"writing a GGUF file needs the gguf package ({exc}); install it "
                           "from the checkout with: pip install '.[llama]'") from None
    from ..hosts.tiny_model import TinyModelShape, parameter_count, write_tiny_llama

    path = write_tiny_llama(args.path, seed=args.seed)
    shape = TinyModelShape()
    print(f"{os.path.relpath(path)}\t{parameter_count(shape)} parameters, {shape.n_layer} "
          f"layers, f32\t{os.path.getsize(path)} bytes")
    return 0
