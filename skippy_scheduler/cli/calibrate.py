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

import argparse
import contextlib
import sys
from typing import Any

from .offload import print_placement, resolve_for
from ._common import (MAX_COUNT, CommandError, add_model_options, check_model,
                      check_output_file, import_llama_host, model_path, non_negative_int,
                      positive_int)
from .interrupt import Interrupted, saving
from .lab_runs import Saved, json_writer
from .vocabulary import add_flag

DEFAULT_THREADS = 1
UNTRUSTWORTHY_FIT = 1  # exit status: the model was printed but failed its plausibility checks
LANES = 8  # llama.cpp sequences: the widest decode shape
BATCH = 512  # llama.cpp batch: the longest prefill shape
CELLS_STEP = 256  # llama.cpp pads each sequence's KV stream to a multiple of this


def register(subparsers: Any) -> None:
    from ..hosts.calibrate import DEFAULT_PASSES, DEFAULT_REPEATS, DEFAULT_WARMUP

    p = subparsers.add_parser(
        "calibrate", help="fit the lab's iteration cost model to a llama.cpp model",
        usage="%(prog)s [-m GGUF] [--repeats N] [--warmup N] [--clock {auto,cpu,wall}] "
              "[--json FILE] [OPTIONS]",
        description="Run a few plan shapes through the scheduler on a llama.cpp model "
                    f"({LANES} sequences, batches of up to {BATCH} tokens) and print the cost "
                    "model (iteration_overhead_us=..,prefill_token_us=..,decode_batch_us=..,"
                    "decode_sequence_us=..) that the lab's --cost-model option accepts; the "
                    "--json file is accepted there too. When the fit does not explain the "
                    "timings it says so on stderr and exits with status 1 (the model is still "
                    "printed). Each shape's timings are printed on stderr as it is timed: "
                    "'# pass K of N: ...' after each pass but the last, its final line after "
                    "the last.")
    add_model_options(p, threads=DEFAULT_THREADS, backend_sampling=True,
                      threads_note="1 here because with more, timings on a busy machine swing "
                                   "by tens of ms")
    add_flag(p, "ctx-size", type=positive_int,
             default_text=f"sized for the shapes: {LANES} lanes, each the longer of the "
                          f"256-token prefill and the 37 + --warmup + --repeats/"
                          f"{DEFAULT_PASSES} positions the decoders reach, rounded up to a "
                          f"multiple of {CELLS_STEP}")
    p.add_argument("--repeats", type=positive_int, default=DEFAULT_REPEATS, metavar="N",
                   help=f"timed iterations per plan shape, over {DEFAULT_PASSES} passes through "
                        f"the shapes; the fastest is fitted (default: {DEFAULT_REPEATS})")
    p.add_argument("--warmup", type=non_negative_int, default=DEFAULT_WARMUP, metavar="N",
                   help=f"untimed iterations of a shape before each pass times it "
                        f"(default: {DEFAULT_WARMUP})")
    p.add_argument("--clock", choices=("auto", "cpu", "wall"), default="auto",
                   help="charge each plan the process's CPU time, which load from other "
                        "processes does not inflate, or the elapsed time; auto is cpu with one "
                        "thread and wall with several, since CPU time adds up every thread "
                        "(default: auto)")
    add_flag(p, "json", note="the cost model with the shapes and timings; the lab's "
                             "--cost-model reads it")
    p.set_defaults(func=run)


def _lane_cells(args: argparse.Namespace) -> int:
    """Each lane's KV cells: what the shapes need, or -c/--ctx-size's share if that holds it."""
    from ..hosts.calibrate import default_shapes, positions_needed

    need = positions_needed(default_shapes(LANES, BATCH), args.repeats, args.warmup)
    if args.ctx_size is None:
        return -(-need // CELLS_STEP) * CELLS_STEP
    lane: int = args.ctx_size // LANES
    if lane < need:
        fix = (f"give -c {need * LANES} or more, or leave it out" if need * LANES <= MAX_COUNT
               else "lower them")
        raise CommandError(f"--ctx-size {args.ctx_size} gives each of the {LANES} lanes "
                           f"{lane} cells; --repeats {args.repeats} and --warmup {args.warmup} "
                           f"need {need} ({fix})")
    return lane


def _timed(timing: Any, done: int, passes: int) -> None:
    """A shape's line on stderr as soon as a pass has timed it: its final figures once the
    last pass that times it is done, `# pass K of N: ...` before that."""
    line = (f"prefill_tokens={timing.prefill_tokens} decode_rows={timing.decode_rows} "
            f"fastest_us={timing.fastest_us:.1f} median_us={timing.median_us:.1f}")
    print(f"# {line}" if done == passes else f"# pass {done} of {passes}: {line}",
          file=sys.stderr, flush=True)


def _warn(message: str) -> None:
    print(f"skippy-scheduler calibrate: warning: {message}", file=sys.stderr)


def _lower(args: argparse.Namespace) -> str:
    """What a context that does not fit tells the user to lower: calibrate has no -np, and
    without -c/--ctx-size its context is sized for --repeats and --warmup."""
    return ("-c/--ctx-size" if args.ctx_size is not None else
            f"--repeats (now {args.repeats}) or --warmup (now {args.warmup}), which size the "
            "context when -c/--ctx-size is not given")


def run(args: argparse.Namespace) -> int:
    check_output_file("--json", args.json, [("--model", args.model)])
    check_model(args)
    lane = _lane_cells(args)
    llama = import_llama_host()
    from ..hosts.calibrate import calibrate_host

    clock = args.clock
    if clock == "auto":
        clock = "cpu" if args.threads == 1 else "wall"
    elif clock == "cpu" and args.threads > 1:
        _warn(f"--clock cpu with --threads {args.threads} charges each plan the CPU time of "
              "every thread, spinning included, which is more than the plan lasted; "
              "use --clock wall to time several threads")
    # Once the model is fitted, both signals are ignored (saving() is entered into this
    # stack): closing the model, printing the fit and writing --json go to the end.
    with contextlib.ExitStack() as finishing:
        try:
            with model_path(args) as model:
                fit = resolve_for(args, model, n_ctx=LANES * lane, lanes=LANES,
                                  n_batch=BATCH, lower=_lower(args))
                print_placement("calibrate", fit, always=False)
                try:
                    host = llama.LlamaHost(
                        model, n_ctx=LANES * lane, n_seq_max=LANES, n_threads=args.threads,
                        n_batch=BATCH, n_ubatch=fit.n_ubatch, kv_type=fit.kv_type,
                        flash_attn=fit.flash_attn, placement=fit.placement,
                        backend_sampling=args.backend_sampling)
                except llama.LlamaLoadError as exc:
                    raise CommandError(str(exc)) from None
                with host:
                    result = calibrate_host(host, repeats=args.repeats, warmup=args.warmup,
                                            clock=clock, on_timed=_timed)
                    finishing.enter_context(saving())
        except Interrupted as stop:
            raise stop.keeping("a cost model is fitted over every shape, so none was fitted"
                               + (f" and --json {args.json} was not written" if args.json
                                  else "")) from None
        return _report(args, result, clock)


def _report(args: argparse.Namespace, result: Any, clock: str) -> int:
    """Print the fitted model and its warnings, then write --json (a write error is the
    command's one-line error, after the model it cannot lose)."""
    problems = result.problems()
    for why in result.skipped:
        print(f"# not timed: {why}", file=sys.stderr)
    print(f"# fit: rms residual {result.residual_us:.1f} us, rms relative error "
          f"{result.relative_residual:.1%} ({clock} clock, {args.threads} thread"
          f"{'s' if args.threads > 1 else ''})", file=sys.stderr)
    print(result.model, flush=True)
    if problems:
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
    saved = Saved()
    saved.write("--json", args.json,
                json_writer(dict(result.to_json(), model=args.model or "tiny-random-llama",
                                 threads=args.threads, repeats=args.repeats,
                                 warmup=args.warmup)))
    saved.check()
    return UNTRUSTWORTHY_FIT if problems else 0
