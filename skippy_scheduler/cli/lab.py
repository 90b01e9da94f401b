"""`skippy-scheduler lab`: reference scenarios (§5.5-§5.8), with --suite the workload suite, and
with --trace FILE the replay of a production request trace."""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace

from ..lab.backend import BACKENDS, BackendUnavailable, resolve_backend
from ..lab.model import RuntimeCostModel
from ..lab.progress import Progress
from ..lab.replay import (DEFAULT_MODE, DEFAULT_PREFIX_CACHE_TOKENS,
                          POLICIES as TRACE_POLICIES, ReplayOptions, run_replays)
from ..lab.traces import FORMATS, Trace, TraceError
from ..lab.report import (TRACE_UNITS, dump_json, format_replay, format_table,
                          format_tenant_table, format_trace_header, format_trace_row,
                          lab_document, trace_document)
from ..lab.scenarios import SCENARIO_NAMES, get_scenario, replay_all, run_scenario
from ..lab.suite import MODES, POLICIES, SuiteOptions, format_suite, run_suite
from ..lab.workload import WorkloadSpec, generate
from ._common import (CommandError, check_output_dir, check_output_file, non_negative_int,
                      positive_int)

# Suite options: argparse destination -> WorkloadSpec field / SuiteOptions field.
_SPEC_OPTIONS = {"requests": "requests", "seed": "seed", "rate": "rate", "families": "families",
                 "family_share": "family_share", "priority_share": "priority_share"}
_RUN_OPTIONS = {"max_active": "max_active", "max_tokens": "max_tokens", "chunk": "chunk",
                "kv_capacity_tokens": "kv_capacity_tokens",
                "reserve_output_tokens": "reserve_output_tokens",
                "ttft_target_ms": "ttft_target_ms", "itl_target_ms": "itl_target_ms"}
# Options that only some modes read: given to another, they are a mistake.
_SCENARIO_ONLY = {"scenario": "--scenario", "iteration_trace": "--iteration-trace",
                  "replay": "--replay", "trace": "--trace"}
_SUITE_ONLY = {"policy": "--policy", "mode": "--mode", "plot": "--plot"}
_RUN_FLAGS = {"max_active": "--max-active", "max_tokens": "--max-tokens", "chunk": "--chunk",
              "kv_capacity_tokens": "--kv-capacity-tokens",
              "reserve_output_tokens": "--reserve-output-tokens",
              "ttft_target_ms": "--ttft-target-ms", "itl_target_ms": "--itl-target-ms"}
_WORKLOAD_ONLY = {"requests": "--requests", "seed": "--seed", "rate": "--rate",
                  "families": "--families", "family_share": "--family-share",
                  "priority_share": "--priority-share"}
_TRACE_ONLY = {"format": "--format", "time_scale": "--time-scale", "limit": "--limit",
               "prefix_cache_tokens": "--prefix-cache-tokens", "tenants": "--tenants"}


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "lab", help="deterministic scheduler lab (reference scenarios, workload suite)",
        usage="%(prog)s [--list | --scenario NAME ... | --suite [SUITE OPTIONS] | "
              "--trace FILE [TRACE OPTIONS]] [OPTIONS]",
        description="Drive the scheduler under a virtual cost model. Without --suite or --trace, "
                    "print the reference scenario table (tab-separated).")
    p.add_argument("--scenario", action="append", metavar="NAME",
                   help=f"run only this scenario (repeatable): {', '.join(SCENARIO_NAMES)}")
    p.add_argument("--list", action="store_true", help="list the scenario names and exit")
    p.add_argument("--iteration-trace", metavar="FILE",
                   help="write the per-iteration trace of the scenarios to FILE")
    p.add_argument("--json", metavar="FILE", help="write every figure (and per-request metrics) "
                                                  "as JSON to FILE")
    p.add_argument("--cost-model", metavar="SPEC",
                   help="override cost constants: name=value,... or a JSON file path "
                        "(iteration_overhead_us, prefill_token_us, decode_batch_us, "
                        "decode_sequence_us)")
    p.add_argument("--bench-reps", type=non_negative_int, default=200, metavar="N",
                   help="extra runs per scenario used only to time the simulator (default 200)")
    p.add_argument("--replay", action="store_true",
                   help="also print the fixture replay switch counts (§5.8)")
    p.add_argument("--backend", choices=BACKENDS, default="auto",
                   help="scheduler implementation (auto = native when available)")
    p.add_argument("--twin", action="store_const", dest="backend", const="twin",
                   help="drive the pure-Python TwinScheduler (same as --backend twin)")
    s = p.add_argument_group("workload suite (--suite)")
    s.add_argument("--suite", action="store_true", help="run the seeded workload suite")
    s.add_argument("--requests", type=int, default=None,
                   help="number of requests (100-100000, default 1000)")
    s.add_argument("--seed", type=int, default=None, help="workload seed (default 0)")
    s.add_argument("--rate", type=float, default=None, help="Poisson arrival rate, requests/s")
    s.add_argument("--families", type=int, default=None, help="number of prompt families")
    s.add_argument("--family-share", type=float, default=None,
                   help="fraction of requests that belong to a family")
    s.add_argument("--priority-share", type=float, default=None,
                   help="fraction of requests with priority 1")
    s.add_argument("--max-active", type=int, default=None)
    s.add_argument("--max-tokens", type=int, default=None, help="max tokens per iteration")
    s.add_argument("--chunk", type=int, default=None, help="prefill chunk tokens")
    s.add_argument("--kv-capacity-tokens", type=int, default=None,
                   help="KV cells of the modelled memory component (0 = none); small values "
                        "force preemption")
    s.add_argument("--reserve-output-tokens", type=int, default=None,
                   help="output tokens reserved at admission when memory is modelled")
    s.add_argument("--policy", action="append", metavar="NAME",
                   help="admission policy (repeatable): fcfs, cache-aware-noaging, "
                        "cache-aware-aging, priority, and with --trace fair-share "
                        "(default: all)")
    s.add_argument("--mode", action="append", metavar="MODE",
                   help="planning mode (repeatable with --suite): phase, mixed (default: both; "
                        "with --trace one mode, default mixed)")
    s.add_argument("--ttft-target-ms", type=float, default=None, help="goodput TTFT target")
    s.add_argument("--itl-target-ms", type=float, default=None,
                   help="goodput target for a request's mean inter-token gap")
    s.add_argument("--plot", metavar="DIR", help="write PNG plots of the suite or replay into DIR")
    t = p.add_argument_group("trace replay (--trace FILE; also --policy, --mode, --json, --plot "
                             "and the scheduler options above)")
    t.add_argument("--trace", metavar="FILE",
                   help="replay a request trace (Mooncake JSONL, Azure CSV or BurstGPT CSV)")
    t.add_argument("--format", choices=("auto",) + FORMATS, default=None,
                   help="trace format (default auto: from the first line)")
    t.add_argument("--time-scale", type=_positive_float, default=None, metavar="F",
                   help="multiply every arrival time by F (0.25 = four times the rate; "
                        "default 1)")
    t.add_argument("--limit", type=positive_int, default=None, metavar="N",
                   help="replay only the first N requests")
    t.add_argument("--prefix-cache-tokens", type=_cache_tokens, default=None, metavar="N",
                   help=f"capacity of the prefix cache in tokens, 'unlimited', or 0 for no "
                        f"cache (default {DEFAULT_PREFIX_CACHE_TOKENS})")
    t.add_argument("--tenants", type=positive_int, default=None, metavar="K",
                   help="spread requests over K tenants by a stable hash of their id "
                        "(replaces a tenant field of the trace)")
    p.set_defaults(func=run)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text}")
    return value


def _cache_tokens(text: str):
    if text.strip().lower() in ("unlimited", "inf", "none"):
        return "unlimited"
    return non_negative_int(text)


def _cost(spec: str | None) -> RuntimeCostModel:
    if spec is None:
        return RuntimeCostModel()
    # `RuntimeCostModel.parse` reads an existing path as a file and anything else as overrides;
    # a path that is not there would otherwise be reported as a malformed override.
    looks_like_path = "=" not in spec and (os.sep in spec or spec.endswith(".json"))
    if looks_like_path and not os.path.exists(spec):
        raise CommandError(f"--cost-model: file not found: {spec}")
    if os.path.isdir(spec):
        raise CommandError(f"--cost-model: {spec} is a directory")
    try:
        return RuntimeCostModel.parse(spec)
    except json.JSONDecodeError as exc:
        raise CommandError(f"--cost-model: {spec} is not valid JSON ({exc})") from None
    except OSError as exc:
        raise CommandError(f"--cost-model: cannot read {spec}: {exc.strerror}") from None
    except (ValueError, TypeError) as exc:
        raise CommandError(f"--cost-model: {exc}") from None


def _backend(name: str):
    try:
        return resolve_backend(name)
    except BackendUnavailable as exc:
        raise CommandError(str(exc)) from None


def _refuse(args, options: dict, why: str) -> None:
    for dest, flag in options.items():
        if getattr(args, dest):
            raise CommandError(f"{flag} {why}")


def _write(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text)


def _refuse_given(args, options: dict, why: str) -> None:
    """Like `_refuse`, for options whose unset value is None (0 is a real value)."""
    for dest, flag in options.items():
        if getattr(args, dest) is not None:
            raise CommandError(f"{flag} {why}")


def run(args) -> int:
    if args.list:
        print("\n".join(SCENARIO_NAMES))
        return 0
    if args.trace:
        if args.suite:
            raise CommandError("--trace and --suite are two different runs: give one")
        _refuse(args, {k: v for k, v in _SCENARIO_ONLY.items() if k != "trace"},
                "applies to the reference scenarios, not to --trace")
        _refuse_given(args, _WORKLOAD_ONLY, "applies to the synthetic suite (--suite), not to "
                                            "--trace")
        return _run_trace(args, _cost(args.cost_model), _backend(args.backend))
    _refuse_given(args, _TRACE_ONLY, "needs --trace")
    if args.suite:
        _refuse(args, _SCENARIO_ONLY, "applies to the reference scenarios, not to --suite")
        return _run_suite(args, _cost(args.cost_model), _backend(args.backend))
    _refuse(args, _SUITE_ONLY, "needs --suite or --trace")
    _refuse_given(args, {**_WORKLOAD_ONLY, **_RUN_FLAGS}, "needs --suite or --trace")
    cost = _cost(args.cost_model)
    backend = _backend(args.backend)
    try:
        scenarios = [get_scenario(name) for name in (args.scenario or SCENARIO_NAMES)]
    except ValueError as exc:
        raise CommandError(str(exc)) from None
    check_output_file("--iteration-trace", args.iteration_trace)
    check_output_file("--json", args.json)
    results = []
    bar = Progress(len(scenarios), "lab")
    for scenario in scenarios:
        results.append(run_scenario(scenario, cost, backend=backend, bench_reps=args.bench_reps,
                                    trace=bool(args.iteration_trace)))
        bar.update(len(results))
    bar.close()
    sys.stdout.write(format_table(results))
    replay = replay_all(cost, backend=backend) if (args.replay or args.json) else []
    if args.replay:
        sys.stdout.write("\n" + format_replay(replay))
    if args.iteration_trace:
        _write(args.iteration_trace, "".join(line + "\n" for r in results for line in r.trace))
    if args.json:
        _write(args.json, dump_json(lab_document(results, replay, cost, backend.name)))
    return 0


def _overrides(args, names: dict) -> dict:
    return {field: getattr(args, arg) for arg, field in names.items()
            if getattr(args, arg) is not None}


def _check_plot(path) -> None:
    check_output_dir("--plot", path)
    if path:
        from ..lab.plot import PlotUnavailable, _pyplot

        try:
            _pyplot()
        except PlotUnavailable as exc:
            raise CommandError(str(exc)) from None


def _run_suite(args, cost: RuntimeCostModel, backend) -> int:
    policies = args.policy or list(POLICIES)
    modes = args.mode or list(MODES)
    for name in policies:
        if name not in POLICIES:
            raise CommandError(f"unknown policy {name!r} (choose from {', '.join(POLICIES)})")
    for name in modes:
        if name not in MODES:
            raise CommandError(f"unknown mode {name!r} (choose from {', '.join(MODES)})")
    check_output_file("--json", args.json)
    _check_plot(args.plot)
    try:
        spec = replace(WorkloadSpec(), **_overrides(args, _SPEC_OPTIONS)).validate()
        options = replace(SuiteOptions(), record_series=bool(args.plot),
                          **_overrides(args, _RUN_OPTIONS))
        for name in ("max_active", "max_tokens", "chunk"):
            if getattr(options, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if options.kv_capacity_tokens < 0 or options.reserve_output_tokens < 0:
            raise ValueError("memory options must be >= 0")
    except (ValueError, TypeError) as exc:
        raise CommandError(str(exc)) from None
    workload = generate(spec)
    out = sys.stdout
    out.write(f"# backend={backend.name} seed={spec.seed} rate={spec.rate}/s "
              f"max_active={options.max_active} max_tokens={options.max_tokens} "
              f"chunk={options.chunk} kv_capacity_tokens={options.kv_capacity_tokens}\n")
    out.write("# workload " + " ".join(f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}"
                                       for k, v in workload.summary().items()) + "\n")
    out.write("\t".join(format_suite([]).splitlines()[0].split("\t")) + "\n")
    out.flush()

    def emit(run) -> None:
        out.write(format_suite([run]).splitlines()[1] + "\n")
        out.flush()

    runs = run_suite(workload, policies, modes, options, cost, backend=backend, on_run=emit)
    if args.json:
        document = {"backend": backend.name, "cost_model": cost.as_dict(),
                    "workload": {**spec.as_dict(), **workload.summary()},
                    "options": {k: v for k, v in options.__dict__.items()},
                    "runs": [run.figures for run in runs]}
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(document, fh, indent=2)
            fh.write("\n")
    if args.plot:
        from ..lab.plot import plot_suite

        for path in plot_suite(runs, args.plot):
            print(f"# wrote {path}", file=sys.stderr)
    return 0


def _fmt(value) -> str:
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def _run_trace(args, cost: RuntimeCostModel, backend) -> int:
    policies = args.policy or list(TRACE_POLICIES)
    for name in policies:
        if name not in TRACE_POLICIES:
            raise CommandError(f"unknown policy {name!r} (choose from "
                               f"{', '.join(TRACE_POLICIES)})")
    modes = args.mode or [DEFAULT_MODE]
    for name in modes:
        if name not in MODES:
            raise CommandError(f"unknown mode {name!r} (choose from {', '.join(MODES)})")
    if len(modes) > 1:
        raise CommandError("--trace replays one --mode at a time")
    mode = modes[0]
    check_output_file("--json", args.json)
    _check_plot(args.plot)
    cache = args.prefix_cache_tokens
    cache = DEFAULT_PREFIX_CACHE_TOKENS if cache is None else (None if cache == "unlimited"
                                                               else cache)
    try:
        options = replace(ReplayOptions(), prefix_cache_tokens=cache,
                          record_series=bool(args.plot),
                          **_overrides(args, _RUN_OPTIONS)).validate()
        trace = Trace(args.trace, args.format or "auto",
                      time_scale=1.0 if args.time_scale is None else args.time_scale,
                      limit=args.limit, tenants=args.tenants)
        # One pass before any replay: a malformed line is reported before work starts, and
        # the header can describe the trace.
        for _ in trace:
            pass
    except TraceError as exc:
        raise CommandError(str(exc)) from None
    except OSError as exc:
        raise CommandError(f"--trace: cannot read {args.trace}: {exc.strerror}") from None
    except (ValueError, TypeError) as exc:
        raise CommandError(str(exc)) from None
    stats = trace.stats
    if not stats.requests:
        raise CommandError(f"--trace: {args.trace} holds no requests")
    out = sys.stdout
    info = {"path": args.trace, "format": trace.format, "time_scale": trace.time_scale,
            "limit": trace.limit, **stats.as_dict(), "mode": mode, "backend": backend.name,
            "cost_model": cost.as_dict(),
            "options": {k: v for k, v in options.__dict__.items() if k != "record_series"}}
    out.write(f"# trace {args.trace} format={trace.format} requests={stats.requests} "
              f"skipped_failures={stats.skipped_failures} span_s={stats.span_s:.1f} "
              f"time_scale={trace.time_scale:g} mean_input={_fmt(info['mean_input_tokens'])} "
              f"mean_output={_fmt(info['mean_output_tokens'])} "
              f"tenants={max(len(stats.tenants), 1)}\n")
    out.write(f"# backend={backend.name} mode={mode} max_active={options.max_active} "
              f"max_tokens={options.max_tokens} chunk={options.chunk} "
              f"kv_capacity_tokens={options.kv_capacity_tokens} prefix_cache_tokens="
              f"{'unlimited' if cache is None else cache} ttft_target_ms="
              f"{options.ttft_target_ms:g} itl_target_ms={options.itl_target_ms:g}\n")
    out.write(f"# {TRACE_UNITS}\n")
    out.write(format_trace_header() + "\n")
    out.flush()

    def emit(run) -> None:
        out.write(format_trace_row(run.figures) + "\n")
        out.flush()

    try:
        runs = run_replays(trace, policies, mode, options, cost, backend=backend, on_run=emit,
                           total=stats.requests)
    except TraceError as exc:  # the file changed since it was checked
        raise CommandError(str(exc)) from None
    tenants = format_tenant_table(runs)
    if tenants:
        out.write("\n" + tenants)
    if args.json:
        _write(args.json, json.dumps(trace_document(info, runs), indent=2) + "\n")
    if args.plot:
        from ..lab.plot import plot_trace

        for path in plot_trace(runs, args.plot):
            print(f"# wrote {path}", file=sys.stderr)
    return 0
