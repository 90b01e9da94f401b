"""`skippy-scheduler split`: cut a GGUF model into one model file per stage by layer range.

Writes `OUT/stage-0.gguf` ... `OUT/stage-{P-1}.gguf` (docs/stages.md). `--stages P` splits the
layers evenly; `--layers A-B,C-D,...` names the ranges (inclusive, contiguous from 0).
"""
from __future__ import annotations

import argparse
from typing import Any

import os

from ._common import CommandError, check_gguf, check_model_file, check_output_dir, positive_int
from .stage import require_stage_packages
from .vocabulary import add_flag


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "split", help="split a GGUF model into stage files by layer range",
        usage="%(prog)s -m GGUF (--stages P | --layers A-B,...) --out DIR",
        description="Split a GGUF model by layer range into DIR/stage-K.gguf files that stock "
                    "llama.cpp loads; `run --stages DIR` and `stage` serve them.")
    add_flag(p, "model", note="the model to split", required=True)
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--stages", type=positive_int, metavar="P",
                       help="stages of a split model; here how many to cut, the layers "
                            "divided evenly")
    group.add_argument("--layers", metavar="A-B,...",
                       help="explicit layer ranges, inclusive, e.g. 0-1,2-3")
    p.add_argument("--out", metavar="DIR", required=True, help="directory for the stage files")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    check_gguf("--model", args.model)
    check_output_dir("--out", args.out)
    require_stage_packages("split", "gguf")
    check_model_file("--model", args.model)
    from ..hosts.stages.split import SplitError, parse_ranges, read_layer_count, split_model

    try:
        if args.layers is not None:
            ranges = parse_ranges(args.layers, read_layer_count(args.model))
            paths = split_model(args.model, args.out, ranges)
        else:
            paths = split_model(args.model, args.out, args.stages)
    except SplitError as exc:
        raise CommandError(str(exc)) from None
    from ..hosts.stages.split import read_stage_info

    for path in paths:
        info = read_stage_info(path)
        print(f"{os.path.relpath(path)}\tlayers {info.layer_start}-{info.layer_end - 1}\t"
              f"{os.path.getsize(path)} bytes")
    return 0
