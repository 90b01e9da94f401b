"""`skippy-scheduler calibrate`: fit the lab's iteration cost model to a llama.cpp model.

Without `--model` it writes the tiny random-weight model to a temporary directory, so it works
offline. The printed cost model is what `skippy-scheduler lab --cost-model` accepts.

The defaults are the settings that give the same fit run after run on a small shared machine:
one llama.cpp thread (with several, a thread that the OS deschedules stalls the others at every
barrier, and a plan's time swings by tens of milliseconds) and the process's CPU time as the
clock, which other processes' load does not inflate. A fit that does not explain the timings is
still printed, with warnings on stderr that say what is wrong and what to change, and the exit
status is 1 so that a script does not carry the numbers on unnoticed.
"""
from __future__ import annotations

import json
import sys

from ._common import (add_model_options, check_model, check_output_file, import_llama_host,
                      model_path, non_negative_int, positive_int)

DEFAULT_THREADS = 1
UNTRUSTWORTHY_FIT = 1  # exit status: the model was printed but failed its plausibility checks


def register(subparsers) -> None:
    from ..hosts.calibrate import DEFAULT_PASSES, DEFAULT_REPEATS, DEFAULT_WARMUP

    p = subparsers.add_parser(
        "calibrate", help="fit the lab's iteration cost model to a llama.cpp model",
        usage="%(prog)s [--model GGUF] [--repeats N] [--warmup N] [--clock {auto,cpu,wall}] "
              "[--json FILE] [OPTIONS]",
        description="Run a few plan shapes through the scheduler on a llama.cpp model and print "
                    "the cost model (iteration_overhead_us=..,prefill_token_us=..,"
                    "decode_batch_us=..,decode_sequence_us=..) that the lab's --cost-model "
                    "option accepts. When the fit does not explain the timings it says so on "
                    "stderr and exits with status 1 (the model is still printed).")
    add_model_options(p)
    # The shared option defaults to what serving wants (2 threads); calibration needs one.
    threads = p._option_string_actions["--threads"]
    threads.default = DEFAULT_THREADS
    threads.help = ("llama.cpp threads (1: with more, timings on a busy machine swing by tens "
                    "of ms)")
    p.add_argument("--repeats", type=positive_int, default=DEFAULT_REPEATS,
                   help=f"timed iterations per plan shape, over {DEFAULT_PASSES} passes through "
                        f"the shapes; the fastest is fitted ({DEFAULT_REPEATS})")
    p.add_argument("--warmup", type=non_negative_int, default=DEFAULT_WARMUP,
                   help=f"untimed iterations of a shape before each pass times it "
                        f"({DEFAULT_WARMUP})")
    p.add_argument("--clock", choices=("auto", "cpu", "wall"), default="auto",
                   help="charge each plan the process's CPU time, which load from other "
                        "processes does not inflate, or the elapsed time; auto (default) is "
                        "cpu with one thread and wall with several, since CPU time adds up "
                        "every thread")
    p.add_argument("--json", metavar="FILE", help="also write the shapes and timings here")
    p.set_defaults(func=run)


def _warn(message: str) -> None:
    print(f"skippy-scheduler calibrate: warning: {message}", file=sys.stderr)


def run(args) -> int:
    check_model(args)
    check_output_file("--json", args.json)
    llama = import_llama_host()
    from ..hosts.calibrate import calibrate_host

    clock = args.clock
    if clock == "auto":
        clock = "cpu" if args.threads == 1 else "wall"
    elif clock == "cpu" and args.threads > 1:
        _warn(f"--clock cpu with --threads {args.threads} charges each plan the CPU time of "
              "every thread, spinning included, which is more than the plan lasted; "
              "use --clock wall to time several threads")
    with model_path(args) as model:
        with llama.LlamaHost(
            model, n_ctx=8 * 512, n_seq_max=8, n_threads=args.threads, n_batch=512,
            kv_type=args.kv_type, flash_attn=args.flash_attn,
        ) as host:
            result = calibrate_host(host, repeats=args.repeats, warmup=args.warmup, clock=clock)
    problems = result.problems()
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(dict(result.to_json(), model=args.model or "tiny-random-llama",
                           threads=args.threads, repeats=args.repeats, warmup=args.warmup),
                      fh, indent=2)
            fh.write("\n")
    for t in result.timings:
        print(f"# prefill_tokens={t.prefill_tokens} decode_rows={t.decode_rows} "
              f"fastest_us={t.fastest_us:.1f} median_us={t.median_us:.1f}", file=sys.stderr)
    for why in result.skipped:
        print(f"# not timed: {why}", file=sys.stderr)
    print(f"# fit: rms residual {result.residual_us:.1f} us, rms relative error "
          f"{result.relative_residual:.1%} ({clock} clock, {args.threads} thread"
          f"{'s' if args.threads > 1 else ''})", file=sys.stderr)
    print(result.model)
    if not problems:
        return 0
    for problem in problems:
        _warn(problem)
    advice = []
    if args.threads > 1:
        advice.append("--threads 1 (which times by CPU clock)")
    elif clock == "wall":
        advice.append("--clock cpu")
    advice += [f"more --repeats (now {args.repeats})", "a quieter machine"]
    _warn("do not use this cost model; calibrate again with " + ", ".join(advice[:-1])
          + " or " + advice[-1])
    return UNTRUSTWORTHY_FIT
