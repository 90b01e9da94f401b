"""`skippy-scheduler lab --suite`: build the workload from the options, run, print, plot."""
from __future__ import annotations

import json
import sys
from dataclasses import replace

from ..cli import CommandError
from .suite import MODES, POLICIES, SuiteOptions, format_suite, run_suite
from .workload import WorkloadSpec, generate

_SPEC_OPTIONS = {"requests": "requests", "seed": "seed", "rate": "rate", "families": "families",
                 "family_share": "family_share", "priority_share": "priority_share"}
_RUN_OPTIONS = {"max_active": "max_active", "max_tokens": "max_tokens", "chunk": "chunk",
                "kv_capacity_tokens": "kv_capacity_tokens",
                "reserve_output_tokens": "reserve_output_tokens",
                "ttft_target_ms": "ttft_target_ms", "itl_target_ms": "itl_target_ms"}


def _overrides(args, names: dict) -> dict:
    return {field: getattr(args, arg) for arg, field in names.items()
            if getattr(args, arg) is not None}


def run_suite_command(args, cost, backend) -> int:
    policies = args.policy or list(POLICIES)
    modes = args.mode or list(MODES)
    for name in policies:
        if name not in POLICIES:
            raise CommandError(f"unknown policy {name!r} (choose from {', '.join(POLICIES)})")
    for name in modes:
        if name not in MODES:
            raise CommandError(f"unknown mode {name!r} (choose from {', '.join(MODES)})")
    if args.plot:
        from .plot import PlotUnavailable, _pyplot

        try:
            _pyplot()
        except PlotUnavailable as exc:
            raise CommandError(str(exc)) from exc
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
        raise CommandError(str(exc)) from exc
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
        from .plot import plot_suite

        for path in plot_suite(runs, args.plot):
            print(f"# wrote {path}", file=sys.stderr)
    return 0
