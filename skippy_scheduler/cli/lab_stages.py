"""`skippy-scheduler lab --pipeline-stages 1,2,3,4`: the staged-serving model (lab/stages.py).

A uniform burst (N requests of 64 prompt tokens and 32 output tokens, all at 0 µs) runs through
P stages, each costing 1/P of the cost model's per-token and per-row terms and the whole
iteration overhead, with G = 1 .. P sequence groups; the table puts the simulated output rate
and inter-token gaps beside the closed form (docs/lab.md, "Staged serving").
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any, TextIO

from ..lab.backend import Backend
from ..lab.model import StepCost, burst_requests
from ..lab.simulate import SimulationError
from ..lab.stages import MAX_STAGES, format_staged, staged_table
from ..types import SchedulerConfig
from ._common import CommandError, check_output_file, int_in
from .interrupt import saving
from .lab_runs import Saved

PROMPT_TOKENS, OUTPUT_TOKENS = 64, 32
MAX_PIPELINE_REQUESTS = 4096


def _stage_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected stage counts like 1,2,3,4, got {text!r}") \
            from None
    if not values or any(not 1 <= v <= MAX_STAGES for v in values):
        raise argparse.ArgumentTypeError(f"stage counts must be 1-{MAX_STAGES}, got {text!r}")
    return list(dict.fromkeys(values))  # each once, as --policy: a repeat is not a second row


def _micros(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of µs, got {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text}")
    if value > 1e12:  # (11.6 days: more overflows the lab's sums)
        raise argparse.ArgumentTypeError(f"expected at most 1e+12 µs, got {text}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("staged pipeline model (--pipeline-stages)")
    g.add_argument("--pipeline-stages", type=_stage_list, default=None, metavar="P,...",
                   help="model a model split into P stages, for each P listed (1-"
                        f"{MAX_STAGES}), with 1 .. P sequence groups: the staged table")
    g.add_argument("--hop-us", type=_micros, default=None, metavar="US",
                   help="latency of one hop between stages, µs (default: 100)")
    g.add_argument("--driver-overhead-us", type=_micros, default=None, metavar="US",
                   help="the driver's time between a group's plan coming back and its next "
                        "plan, µs (default: 0)")
    g.add_argument("--pipeline-requests", type=int_in(1, MAX_PIPELINE_REQUESTS), default=None,
                   metavar="N",
                   help="requests of the uniform burst (default: 12)")


STAGED_ONLY = {"hop_us": "--hop-us", "driver_overhead_us": "--driver-overhead-us",
               "pipeline_requests": "--pipeline-requests"}


def run_staged_command(args: argparse.Namespace, cost: StepCost,
                       backend: Backend) -> int:
    check_output_file("--json", args.json,
                      [("--cost-model", getattr(args, "cost_model", None))])
    hop = 100.0 if args.hop_us is None else args.hop_us
    overhead = args.driver_overhead_us or 0.0
    n = args.pipeline_requests or 12
    requests = burst_requests(n, PROMPT_TOKENS, OUTPUT_TOKENS)
    # The whole burst arrives at 0 µs and waits in the groups' queues (all of it in one with
    # G = 1): the waiting limit covers it (the default, 256, refused the 257th request), as the
    # suite's unbounded one does.
    config = SchedulerConfig(
        max_waiting_sequences=max(SchedulerConfig().max_waiting_sequences, n))
    try:
        rows = staged_table(config, cost, requests, args.pipeline_stages, hop, overhead,
                            backend=backend)
    except ValueError as exc:
        raise CommandError(str(exc)) from None
    except SimulationError as exc:  # a run the model could not finish: one line, not a trace
        raise CommandError(f"the staged pipeline could not run: {exc}") from None
    header = [f"staged pipeline: {n} requests at 0 µs, {PROMPT_TOKENS} prompt tokens, "
              f"{OUTPUT_TOKENS} output tokens; scheduler {backend.name}",
              f"each of P stages: iteration overhead {cost.base_us:g} µs, the "
              f"other terms of {cost} divided by P; hop {hop:g} µs; driver overhead "
              f"{overhead:g} µs",
              "form: gap = max(sum of stages + hops + overhead, groups x slowest stage), "
              "tokens/s = groups x rows per group / gap"]
    doc: dict[str, Any] = {"cost_model": cost.lab_dict(), "hop_us": hop,
                           "driver_overhead_us": overhead, "requests": n,
                           "prompt_tokens": PROMPT_TOKENS, "output_tokens": OUTPUT_TOKENS,
                           "scheduler": backend.name, "rows": rows}

    def write(fh: TextIO) -> None:
        json.dump(doc, fh, indent=2, sort_keys=True)
        fh.write("\n")

    saved = Saved()
    with saving():  # the table and the file whole, whatever signal comes now
        sys.stdout.write(format_staged(rows, header))
        sys.stdout.flush()  # before the file: stdout gone (`| head`) is found here, not at exit
        saved.write("--json", args.json, write)
    saved.check()
    return 0
