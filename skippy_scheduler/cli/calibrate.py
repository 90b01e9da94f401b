"""`skippy-scheduler calibrate`: fit the lab's iteration cost model to a llama.cpp model.

Without `--model` it writes the tiny random-weight model to a temporary directory, so it works
offline. The printed cost model is what `skippy-scheduler lab --cost-model` accepts.
"""
from __future__ import annotations

import json
import sys

from ._common import (add_model_options, check_model, check_output_file, import_llama_host,
                      model_path, positive_int)


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "calibrate", help="fit the lab's iteration cost model to a llama.cpp model",
        usage="%(prog)s [--model GGUF] [--repeats N] [--clock {wall,cpu}] [--json FILE] "
              "[OPTIONS]",
        description="Time a few plan shapes on a llama.cpp model and print the cost model "
                    "(iteration_overhead_us=..,prefill_token_us=..,decode_batch_us=..,"
                    "decode_sequence_us=..) that the lab's --cost-model option accepts.")
    add_model_options(p)
    p.add_argument("--repeats", type=positive_int, default=7,
                   help="timed runs per plan shape; the median is fitted (7)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="time plans by elapsed time (default) or by process CPU time, "
                        "which load from other processes does not inflate")
    p.add_argument("--json", metavar="FILE", help="also write the shapes and timings here")
    p.set_defaults(func=run)


def run(args) -> int:
    check_model(args)
    check_output_file("--json", args.json)
    llama = import_llama_host()
    from ..hosts.calibrate import calibrate_host

    with model_path(args) as model:
        with llama.LlamaHost(
            model, n_ctx=8 * 512, n_seq_max=8, n_threads=args.threads, n_batch=512,
            kv_type=args.kv_type, flash_attn=args.flash_attn,
        ) as host:
            result = calibrate_host(host, repeats=args.repeats, clock=args.clock)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(dict(result.to_json(), model=args.model or "tiny-random-llama",
                           clock=args.clock), fh, indent=2)
            fh.write("\n")
    for p, d, us in result.samples:
        print(f"# prefill_tokens={p} decode_rows={d} median_us={us:.1f}", file=sys.stderr)
    print(f"# rms residual {result.residual_us:.1f} us", file=sys.stderr)
    print(result.model)
    return 0
