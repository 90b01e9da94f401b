"""`skippy-scheduler split`: cut a GGUF model into one model file per stage by layer range.

Writes `OUT/stage-0.gguf` ... `OUT/stage-{P-1}.gguf` (docs/stages.md). `--stages P` splits the
layers evenly; `--layers A-B,C-D,...` names the ranges (inclusive, contiguous from 0). A
stage-K.gguf in OUT with K >= P, left from an earlier split into more stages, is removed (and
named on stderr): a directory of stages is read as every stage-K.gguf in it.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from ._common import (CommandError, check_gguf, check_model_file, check_output_dir,
                      positive_int)
from .stage import require_stage_packages
from .vocabulary import add_flag


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "split", help="split a GGUF model into stage files by layer range",
        usage="%(prog)s -m GGUF (--stages P | --layers A-B,...) --out DIR",
        description="Split a GGUF model by layer range into DIR/stage-K.gguf files that stock "
                    "llama.cpp loads; `run --stages DIR` and `stage` serve them. Stage files "
                    "in DIR left from an earlier split into more stages are removed.")
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
    check_model_file("--model", args.model, allow_stage=False)
    from ..hosts.stages.split import (SplitError, parse_ranges, read_layer_count, read_stage_info,
                                      split_model, stale_stage_paths)

    try:
        if args.layers is not None:
            ranges = parse_ranges(args.layers, read_layer_count(args.model))
            stale = stale_stage_paths(args.out, len(ranges))
            paths = split_model(args.model, args.out, ranges)
        else:
            stale = stale_stage_paths(args.out, args.stages)
            paths = split_model(args.model, args.out, args.stages)
    except SplitError as exc:
        raise CommandError(str(exc)) from None
    except OSError as exc:
        where = f" {exc.filename}" if exc.filename else ""
        raise CommandError(f"--out: cannot write{where}: {exc.strerror or exc}") from None
    for path in stale:
        print(f"skippy-scheduler split: removed {os.path.relpath(path)}, left from an earlier "
              f"split into more stages", file=sys.stderr)
    for path in paths:
        info = read_stage_info(path)
        print(f"{os.path.relpath(path)}\tlayers {info.layer_start}-{info.layer_end - 1}\t"
              f"{os.path.getsize(path)} bytes")
    return 0
