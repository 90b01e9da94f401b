"""The llama.cpp host's own CPU per step: what its worker thread spends around the decode call.

    python bench/host_cpu.py -- -m rpc-4m.gguf --prompts prompts.json -n 256 -np 64 -t 1 \\
        --rpc 127.0.0.1:50632 -fa off
    python bench/host_cpu.py --write-prompts prompts.json --count 64

Everything after `--` is `skippy-scheduler run`'s command line: this runs it in this process
with `LlamaHost.execute` and the decoder's C calls timed on the thread that calls them, both by
the thread's CPU clock (`time.thread_time_ns`) and by the wall clock. The decoder's calls are
`Decoder.decode` (stage the batch, run `llama_decode`, wait for the outputs, in one call) or,
for a plan whose next plan the host stages while the device runs it (`stage_ahead`, on by
default beside a device), `Decoder.launch` and `Decoder.wait`. Beside a device (a GPU, or a
llama.cpp RPC server lending a CPU: `--rpc`) those calls' CPU is the host's share of the step
(graph building, the inputs, copying the outputs), their wall the step's length, and the CPU
of `execute` outside them is the host's own Python around each step: reading the plan,
assigning lanes, staging the batch, taking each row's argmax, and (staged ahead) staging the
next plan while the device runs.

What the device waits for is the host's time from one step's outputs in hand to the next
step's decode call (`between_wall_us`): the argmax and hand-back of the one, then whatever of
the next is not staged yet.

Reported (one JSON line with `--json`): the run's summary line, then the medians over the
steps with as many rows as the busiest step (the decode phase; the first quarter of them
skipped as warm-up): `between_wall_us` (over pairs of consecutive such steps),
`staged_ahead_share` (the share of them that ran as staged while the step before ran:
`LlamaHost.staged_ahead`), `execute_cpu_us`, `decode_cpu_us` (the decoder's calls),
`outside_cpu_us` (execute minus those, step by step),
`execute_wall_us`, `decode_wall_us` and `outside_wall_us` (the same by the wall clock: the CPU
outside the calls and any wait for the GIL or a core there), and `read_cpu_us` and
`read_wall_us` (the reads of the device's sampled tokens after the decode, part of the time
outside it; 0 with sampling on the host). Alternate two trees' runs on a quiet machine to
compare them (the thread's CPU clock is steadier than the wall, but a core shared with other
threads slows what it counts too).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any


def measure(run_argv: list[str]) -> dict[str, Any]:
    from skippy_scheduler.cli import main
    from skippy_scheduler.hosts.llama import backend_sampling, decode as decode_mod
    from skippy_scheduler.hosts.llama import host as host_mod

    # (owner, method, name) of the calls timed inside a step: the decode call (or, for a plan
    # whose next one is staged in between, its launch and its wait), and the reads of the
    # device's sampled tokens (with sampling on the device).
    inner = [(decode_mod.Decoder, "decode", "decode"),
             (decode_mod.Decoder, "launch", "launch"),
             (decode_mod.Decoder, "wait", "wait"),
             (backend_sampling.DeviceChains, "read", "read")]
    # (name, thread CPU ns, wall ns, wall clock at its start, at its end) of each inner call
    calls: list[tuple[str, int, int, int, int]] = []
    steps: list[dict[str, int]] = []
    originals = [(owner, attr, getattr(owner, attr)) for owner, attr, _ in inner]
    execute = host_mod.LlamaHost.execute

    def timed(fn: Any, name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            c, w = time.thread_time_ns(), time.perf_counter_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                end = time.perf_counter_ns()
                calls.append((name, time.thread_time_ns() - c, end - w, w, end))
        return call

    def timed_execute(self: Any, plan: Any) -> Any:
        first = len(calls)
        staged = self.staged_ahead  # plans run from their staging ahead so far
        c, w = time.thread_time_ns(), time.perf_counter_ns()
        try:
            return execute(self, plan)
        finally:
            step = {"rows": len(plan), "cpu": time.thread_time_ns() - c,
                    "wall": time.perf_counter_ns() - w}
            for _, _, name in inner:  # this plan's calls (one decode; none when empty)
                mine = [x for x in calls[first:] if x[0] == name]
                step[f"{name}_cpu"] = sum(x[1] for x in mine)
                step[f"{name}_wall"] = sum(x[2] for x in mine)
            device = [x for x in calls[first:] if x[0] in ("decode", "launch", "wait")]
            step["device_cpu"] = sum(x[1] for x in device)
            step["device_wall"] = sum(x[2] for x in device)
            step["ahead"] = self.staged_ahead - staged  # this plan ran as staged ahead
            # When its decode call began, and when its outputs were in hand.
            step["t_launch"] = device[0][3] if device else 0
            step["t_outputs"] = device[-1][4] if device else 0
            steps.append(step)

    for (owner, attr, name), (_, _, fn) in zip(inner, originals):
        setattr(owner, attr, timed(fn, name))
    host_mod.LlamaHost.execute = timed_execute  # type: ignore[method-assign]
    try:
        rc = main(["run", *run_argv])
    finally:
        for owner, attr, fn in originals:
            setattr(owner, attr, fn)
        host_mod.LlamaHost.execute = execute  # type: ignore[method-assign]
    if rc:
        raise SystemExit(f"skippy-scheduler run exited {rc}")
    steps = [s for s in steps if s["rows"] > 0]
    if not steps:
        raise SystemExit("the run executed no plan")
    busiest = max(s["rows"] for s in steps)
    phase = [s for s in steps if s["rows"] == busiest]
    phase = phase[len(phase) // 4:] or phase

    def med(values: list[int]) -> float:
        return round(statistics.median(values) / 1e3, 1) if values else 0.0

    # From one step's outputs in hand to the next step's decode call, both in the phase.
    in_phase = {id(s) for s in phase}
    between = [b["t_launch"] - a["t_outputs"] for a, b in zip(steps, steps[1:])
               if id(a) in in_phase and b["rows"] == busiest]
    return {
        "steps": len(steps), "decode_phase_steps": len(phase), "rows": busiest,
        "staged_ahead_share": round(sum(s["ahead"] for s in phase) / len(phase), 3),
        "between_wall_us": med(between),
        "execute_cpu_us": med([s["cpu"] for s in phase]),
        "decode_cpu_us": med([s["device_cpu"] for s in phase]),
        "outside_cpu_us": med([s["cpu"] - s["device_cpu"] for s in phase]),
        "execute_wall_us": med([s["wall"] for s in phase]),
        "decode_wall_us": med([s["device_wall"] for s in phase]),
        "outside_wall_us": med([s["wall"] - s["device_wall"] for s in phase]),
        "read_cpu_us": med([s["read_cpu"] for s in phase]),
        "read_wall_us": med([s["read_wall"] for s in phase]),
    }


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    run_argv: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, run_argv = argv[:cut], argv[cut + 1:]
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False,
                                 usage="%(prog)s [--json FILE] -- RUN_ARGS...")
    ap.add_argument("--json", help="append the result as a JSON line")
    ap.add_argument("--label", default="", help="a label kept in the JSON line")
    ap.add_argument("--write-prompts", metavar="PATH",
                    help="write a prompts file for `run --prompts` (distinct prompts of about "
                         "40 words) and exit")
    ap.add_argument("--count", type=int, default=64, help="prompts --write-prompts writes")
    args = ap.parse_args(argv)
    if args.write_prompts:
        if args.count < 1:
            ap.error("--count must be at least 1")
        with open(args.write_prompts, "w") as f:
            json.dump([f"{'word ' * 40}{i}" for i in range(args.count)], f)
        return 0
    if not run_argv:
        ap.error("give skippy-scheduler run's arguments after --")
    result = {"label": args.label, **measure(run_argv)}
    print(json.dumps(result))
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps({**result, "run_argv": run_argv}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
