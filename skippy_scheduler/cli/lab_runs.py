"""The two long runs of `skippy-scheduler lab`: the workload suite and the trace replay.

Both print one table row per (policy, mode) run as it finishes and collect the finished runs,
so an interrupted run still writes its JSON and plots for the runs that finished. Once the last
run has finished, the outputs are printed and written with both signals ignored (`saving()`):
a signal then changes nothing (the command ends as it would have), and never leaves half a
file; one just before `saving()` has everything written and says so. A file is
written whole or not at all (`write_output`), and one that cannot be written is the command's
one-line error after everything else was printed and written.
"""
from __future__ import annotations

import argparse
import array
import contextlib
import json
import math
import os
import secrets
import stat
import sys
from dataclasses import replace
from typing import Any, Callable, Optional, TextIO

import numpy as np

from ..lab.backend import Backend
from ..lab.driver import LabStalled
from ..lab.model import StepCost
from ..lab.replay import DEFAULT_MODE, DEFAULT_PREFIX_CACHE_TOKENS, ReplayOptions, run_replays
from ..lab.report import (TRACE_UNITS, format_tenant_table, format_trace_header,
                          format_trace_row, trace_document)
from ..lab.options import ALL_MODES, RunOptions
from ..lab.suite import (MODES, POLICIES as SUITE_POLICIES, SuiteOptions, format_suite,
                         run_suite, suite_units)
from ..lab.tails import TAILS_NOTE, format_tails
from ..lab.traces import Trace, TraceError, TraceRequest, request_id
from ..lab.workload import Workload, WorkloadSpec, generate
from ..selection import POLICIES
from ._common import (CommandError, check_distinct_outputs, check_output_dir,
                      check_output_file)
from .interrupt import Interrupted, saving

# The files --plot DIR gets (lab/plot.py's plot_suite and plot_trace): no other output may be one.
SUITE_PLOTS = ("ttft_cdf.png", "batch_occupancy.png", "queue_depth.png")
TRACE_PLOTS = ("trace_ttft_cdf.png", "trace_hit_rate.png", "trace_queue_depth.png")

# argparse destination -> WorkloadSpec field / SuiteOptions (and ReplayOptions) field.
_SPEC_OPTIONS = {"requests": "requests", "seed": "seed", "rate": "rate", "families": "families",
                 "family_share": "family_share", "priority_share": "priority_share"}
_RUN_OPTIONS = {"max_active": "max_active", "max_num_batched_tokens": "max_tokens",
                "prefill_chunk": "chunk", "kv_capacity_tokens": "kv_capacity_tokens",
                "reserve_output_tokens": "reserve_output_tokens",
                "ttft_target_ms": "ttft_target_ms", "itl_target_ms": "itl_target_ms"}


def _overrides(args: argparse.Namespace, names: dict[str, str]) -> dict[str, Any]:
    return {field: getattr(args, arg) for arg, field in names.items()
            if getattr(args, arg) is not None}


def _check_modes(modes: list[str]) -> None:
    for name in modes:
        if name not in ALL_MODES:
            raise CommandError(f"unknown mode {name!r} (choose from {', '.join(ALL_MODES)})")


def _check_slack_target(modes: list[str], options: SuiteOptions | ReplayOptions) -> None:
    """The slack rule plans every step to the inter-token target: 0 is no target to plan to."""
    if "slack" in modes and not options.itl_target_ms > 0:
        raise CommandError(f"--itl-target-ms {options.itl_target_ms:g}: the slack rule "
                           "(--slack) plans each step to this inter-token target; give a target "
                           "> 0")


def _kv_message(options: RunOptions, need: int, request: str, prompt: int, output: int,
                where: str = "") -> str:
    """Request `request` (`where`: its trace line) needs `need` cells, more than there are."""
    reserve = options.reserve_output_tokens
    return (f"--kv-capacity-tokens {options.kv_capacity_tokens} is too small: request "
            f"{request} ({where}prompt {prompt}, output {output} tokens) needs {need} KV cells "
            f"to run even alone (prompt + max(min(output, --reserve-output-tokens {reserve}), "
            f"output - 2)); give --kv-capacity-tokens >= {need}, or 0 for no memory model")


def _check_kv_workload(options: RunOptions, workload: Workload) -> None:
    """Refuse a memory model that the workload's largest request cannot run in (the run would
    stall when that request arrives)."""
    if not options.kv_capacity_tokens:
        return
    need, r = max((options.kv_cells_needed(n, o), r) for r, (n, o) in enumerate(
        zip(workload.prompt_len.tolist(), workload.output_len.tolist())))
    if need > options.kv_capacity_tokens:
        raise CommandError(_kv_message(options, need, workload.request_id(r),
                                       int(workload.prompt_len[r]),
                                       int(workload.output_len[r])))


def _check_reserve(args: argparse.Namespace, options: RunOptions) -> None:
    """--reserve-output-tokens sizes the memory model's reservations: without that model
    (--kv-capacity-tokens N > 0) the run would ignore it."""
    if args.reserve_output_tokens is not None and not options.kv_capacity_tokens:
        raise CommandError("--reserve-output-tokens sizes the reservations of the memory "
                           "model, which this run does not have: give --kv-capacity-tokens "
                           "N > 0 with it")


def _check_families(args: argparse.Namespace, spec: WorkloadSpec) -> None:
    """--families and --family-share each mean nothing when the other is 0."""
    if args.family_share is not None and spec.families == 0:
        raise CommandError(f"--family-share {args.family_share:g} does not apply with "
                           "--families 0 (no prompt families): give --families > 0")
    if args.families is not None and args.families > 0 and args.family_share is not None \
            and spec.family_share == 0:
        raise CommandError(f"--families {args.families} does not apply with --family-share 0 "
                           "(no request belongs to a family)")


def _check_trace_file(path: str) -> None:
    """The trace is read more than once (a pass for its header and checks, one per policy):
    a pipe or a device would be empty after the first pass. A missing file or a folder is the
    trace reader's to report."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return
    if not stat.S_ISREG(mode) and not stat.S_ISDIR(mode):
        raise CommandError(f"--trace: {path} is not a regular file (a pipe or a device); "
                           "--trace must be a regular file, as it is read more than once")


def _stalled(exc: LabStalled, options: RunOptions) -> CommandError:
    """A stall the up-front check did not foresee, as a user error naming the capacity."""
    return CommandError(f"--kv-capacity-tokens {options.kv_capacity_tokens}: {exc}")


def _tails(args: argparse.Namespace, runs: list[Any], document: dict[str, Any]) -> None:
    """--tails (or --slack): the tails table on stdout, and in the JSON document."""
    if not (getattr(args, "tails", None) or getattr(args, "slack", None)):
        return
    sys.stdout.write("# tails: " + TAILS_NOTE + "\n" + format_tails(runs))
    sys.stdout.flush()
    document["tails"] = [{"policy": r.policy, "mode": r.mode, **r.tails} for r in runs]


def _check_outputs(args: argparse.Namespace, plots: tuple[str, ...]) -> None:
    """--json, --requests-out and --plot: writable, none of them an input or another, nor one
    of the `plots` that --plot DIR gets."""
    inputs = [("--trace", getattr(args, "trace", None)),
              ("--cost-model", getattr(args, "cost_model", None))]
    check_output_file("--json", args.json, inputs)
    check_output_file("--requests-out", args.requests_out, inputs)
    check_distinct_outputs(("--json", args.json), ("--plot", args.plot),
                           ("--requests-out", args.requests_out))
    if args.plot:
        written = {os.path.realpath(os.path.join(args.plot, name)): name for name in plots}
        for option, path in (("--json", args.json), ("--requests-out", args.requests_out)):
            name = written.get(os.path.realpath(path)) if path else None
            if name is not None:
                raise CommandError(f"{option}: {path} is the plot {name} that --plot "
                                   f"{args.plot} writes (give another path)")
    _check_plot(args.plot)


def _check_plot(path: Optional[str]) -> None:
    check_output_dir("--plot", path)
    if path:
        from ..lab.plot import PlotUnavailable, pyplot

        try:
            pyplot()
        except PlotUnavailable as exc:
            raise CommandError(str(exc)) from None


def request_lines(runs: list[Any], ids: Any) -> Any:
    """One JSON object per request of each run: policy, mode, index, id (`ids(i)`), then its
    per-request figures (times in µs of virtual time; None for a time that never came)."""
    for run in runs:
        per = run.per_request or {}
        columns = {name: np.asarray(values).tolist() for name, values in per.items()}
        n = max((len(v) for v in columns.values()), default=0)
        for i in range(n):
            row: dict[str, Any] = {"policy": run.policy, "mode": run.mode, "index": i,
                                   "id": ids(i)}
            for name, values in columns.items():
                v = values[i]
                row[name] = None if isinstance(v, float) and not math.isfinite(v) else v
            yield row


def interrupted(document: dict[str, Any], stop: Interrupted) -> dict[str, Any]:
    """`document` marked as the partial one an interrupted run writes: a top-level
    "interrupted" names the signal (as `run --json` does); a whole run has no such key."""
    document["interrupted"] = stop.signal_name
    return document


def _write_in_place(path: str, write: Callable[[TextIO], None]) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        write(fh)


def _write_whole(path: str, write: Callable[[TextIO], None]) -> None:
    target = os.path.realpath(path)  # a symbolic link stays one: its target is replaced
    try:
        st: Optional[os.stat_result] = os.stat(target)
    except FileNotFoundError:
        st = None
    euid = getattr(os, "geteuid", None)
    if st is not None and (not stat.S_ISREG(st.st_mode) or st.st_nlink > 1
                           or (euid is not None and st.st_uid != euid())):
        # A device or a pipe (/dev/stdout), a file with other names, or another user's: a
        # new file renamed over it would not be it.
        _write_in_place(path, write)
        return
    folder, name = os.path.split(target)
    part = os.path.join(folder, f".{name}.{secrets.token_hex(4)}.part")
    try:
        fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except OSError:  # no file can be made beside it (a folder we may not write): in place
        _write_in_place(path, write)
        return
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            if st is not None:
                os.chmod(part, stat.S_IMODE(st.st_mode))  # the file keeps its permissions
            write(fh)
        os.replace(part, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(part)
        raise


def write_output(option: str, path: str, write: Callable[[TextIO], None]) -> None:
    """Write the output file `path` (`option`'s) with `write(fh)`, whole or not at all: a
    regular file, or a new one, is written beside itself and renamed over itself once
    complete, so that a write that fails (a full disk) leaves the file as it was; anything else
    (/dev/stdout, a pipe) is written in place. An OSError is a `CommandError` naming `option`
    and the path (the command's one-line error)."""
    try:
        _write_whole(path, write)
    except OSError as exc:
        raise CommandError(f"{option}: cannot write {path}: {exc.strerror or exc}") from None


def json_writer(document: Any) -> Callable[[TextIO], None]:
    """What writes `document` as indented JSON, for `write_output`."""
    def write(fh: TextIO) -> None:
        json.dump(document, fh, indent=2)
        fh.write("\n")

    return write


class Saved:
    """What a command's final writes did: the outputs written (`--json FILE`, ...) and the ones
    that failed (one message each). Every output is tried, whatever failed before it."""

    def __init__(self) -> None:
        self.written: list[str] = []
        self.failed: list[str] = []

    def write(self, option: str, path: Optional[str], write: Callable[[TextIO], None]) -> None:
        """`write_output(option, path, write)` if `path` is given, its error kept."""
        if not path:
            return
        try:
            write_output(option, path, write)
        except CommandError as exc:
            self.failed.append(str(exc))
        else:
            self.written.append(f"{option} {path}")

    def wrote(self) -> str:
        """', wrote --json F and --plot D', or ''."""
        return ", wrote " + " and ".join(self.written) if self.written else ""

    def kept(self) -> str:
        """The end of the interrupt line: what was written, then what could not be."""
        return self.wrote() + "".join(f"; {failure}" for failure in self.failed)

    def check(self) -> None:
        """A `CommandError` if an output could not be written (naming what was)."""
        if self.failed:
            raise CommandError("; ".join(self.failed) + f" (the results are printed"
                               f"{self.wrote()})")


def finish(saved: Saved, stopped: Optional[Interrupted], what: str) -> int:
    """The end of a command whose work was all done and whose outputs were written: exit 0, a
    write error's one line, or, if a signal came once the work was done (`stopped`), the
    interrupt line saying that `what` finished."""
    if stopped is not None:
        raise stopped.keeping(what + saved.kept())
    saved.check()
    return 0


def _save(args: argparse.Namespace, document: Any, runs: list[Any], plot: Any,
          ids: Any = None, **plot_kwargs: Any) -> Saved:
    """Write --json, --requests-out and --plot for `runs`; return what was written and what
    failed. `ids(i)`: the id of request i (the suite's or the trace's naming)."""
    saved = Saved()
    if getattr(args, "requests_out", None) and ids is not None:
        def lines(fh: TextIO) -> None:
            for row in request_lines(runs, ids):
                fh.write(json.dumps(row) + "\n")

        saved.write("--requests-out", args.requests_out, lines)
    saved.write("--json", args.json, json_writer(document))
    if args.plot and runs:
        try:
            for path in plot(runs, args.plot, **plot_kwargs):
                print(f"# wrote {path}", file=sys.stderr)
        except OSError as exc:  # the folder changed since it was checked
            saved.failed.append(f"--plot: cannot write into {args.plot}: {exc.strerror or exc}")
        else:
            saved.written.append(f"--plot {args.plot}")
    return saved


def run_suite_command(args: argparse.Namespace, modes: Optional[list[str]],
                      cost: StepCost, backend: Backend) -> int:
    if args.priority_scenario:
        from .lab_priority import run_priority_command

        return run_priority_command(args, modes, cost, backend)
    policies = list(dict.fromkeys(args.policy or SUITE_POLICIES))  # each one once
    modes = modes or list(MODES) + (["slack"] if getattr(args, "slack", None) else [])
    _check_modes(modes)
    _check_outputs(args, SUITE_PLOTS)
    try:
        spec = replace(WorkloadSpec(), **_overrides(args, _SPEC_OPTIONS)).validate()
        options = replace(SuiteOptions(), record_series=bool(args.plot),
                          **_overrides(args, _RUN_OPTIONS)).validate()
    except (ValueError, TypeError) as exc:
        raise CommandError(str(exc)) from None
    _check_reserve(args, options)
    _check_families(args, spec)
    _check_slack_target(modes, options)
    workload = generate(spec)
    _check_kv_workload(options, workload)
    out = sys.stdout
    # NOTE: the header keeps the lab's field names of earlier releases (max_tokens = the step
    # budget, chunk = the prefill chunk) so that the suite's output stays byte-identical.
    out.write(f"# backend={backend.name} seed={spec.seed} rate={spec.rate}/s "
              f"max_active={options.max_active} max_tokens={options.max_tokens} "
              f"chunk={options.chunk} kv_capacity_tokens={options.kv_capacity_tokens}\n")
    out.write("# workload " + " ".join(f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}"
                                       for k, v in workload.summary().items()) + "\n")
    out.write(f"# {suite_units(cost, options)}\n")
    out.write("\t".join(format_suite([]).splitlines()[0].split("\t")) + "\n")
    out.flush()
    finished: list[Any] = []

    def emit(run: Any) -> None:
        finished.append(run)
        out.write(format_suite([run]).splitlines()[1] + "\n")
        out.flush()

    def document(runs: list[Any]) -> dict[str, Any]:
        return {"backend": backend.name, "cost_model": cost.lab_dict(),
                "workload": {**spec.as_dict(), **workload.summary()},
                "options": {k: v for k, v in options.__dict__.items()
                            if k != "record_series"},
                "runs": [run.figures for run in runs]}

    from ..lab.plot import plot_suite

    title = f"suite: {spec.requests} requests at {spec.rate:g}/s, seed {spec.seed}"
    total = len(policies) * len(modes)
    stopped: Optional[Interrupted] = None
    try:
        run_suite(workload, policies, modes, options, cost, backend=backend, on_run=emit)
    except LabStalled as exc:
        raise _stalled(exc, options) from None
    except Interrupted as stop:
        if len(finished) < total:
            with saving():  # with nothing finished too: a script waiting for the file gets one
                saved = _save(args, interrupted(document(finished), stop), finished,
                              plot_suite, ids=workload.request_id, title=title)
            raise stop.keeping(f"{len(finished)} of {total} runs printed" + saved.kept()) \
                from None
        stopped = stop  # after the last run: the outputs are whole all the same
    with saving():  # every run finished: a signal now cannot cut the outputs short
        doc = document(finished)
        _tails(args, finished, doc)
        saved = _save(args, doc, finished, plot_suite, ids=workload.request_id, title=title)
    return finish(saved, stopped, f"all {total} runs printed")


def _fmt(value: Any) -> str:
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def _open_trace(args: argparse.Namespace,
                options: RunOptions) -> tuple[Trace, Callable[[int], Optional[str]]]:
    """The trace, read once before any replay: a malformed line, or a request the memory
    model cannot hold, is reported before work starts, and the header can describe the
    trace. With it, `ids(i)`: the id of the trace's request i (`r<data row>`, which skips a
    BurstGPT trace's failed rows), kept for --requests-out."""
    memory = options.kv_capacity_tokens > 0
    need, largest = 0, None
    rows = array.array("q")  # each request's data row, for --requests-out
    keep_rows = bool(getattr(args, "requests_out", None))
    try:
        trace = Trace(args.trace, args.format or "auto",
                      time_scale=1.0 if args.time_scale is None else args.time_scale,
                      limit=args.limit, tenants=args.tenants)
        request: TraceRequest
        for request in trace:
            if keep_rows and request.row is not None:
                rows.append(request.row)
            if memory:
                cells = options.kv_cells_needed(request.input_length, request.output_length)
                if cells > need:
                    need, largest = cells, request
    except TraceError as exc:
        raise CommandError(str(exc)) from None
    except OSError as exc:
        raise CommandError(f"--trace: cannot read {args.trace}: {exc.strerror}") from None
    except (ValueError, TypeError) as exc:
        raise CommandError(str(exc)) from None
    if not trace.stats.requests:
        raise CommandError(f"--trace: {args.trace} holds no requests")
    if largest is not None and need > options.kv_capacity_tokens:
        raise CommandError(_kv_message(options, need, largest.id, largest.input_length,
                                       largest.output_length,
                                       f"line {largest.line} of {args.trace}: "))

    def ids(i: int) -> Optional[str]:
        return request_id(rows[i]) if i < len(rows) else None

    return trace, ids


def format_slo_lines(runs: list[Any], options: ReplayOptions) -> str:
    """Per policy, the replay against the SLO told (--slo): the share within it, goodput,
    the misses by reason."""
    lines = [f"# SLO told: first token within {options.ttft_target_ms:g} ms, every gap within "
             f"{options.itl_target_ms:g} ms"]
    for run in runs:
        f = run.figures
        lines.append(f"{run.policy}: {100 * f['slo_fraction']:.1f} % within, "
                     f"{f['slo_goodput_rps']:.3g} req/s; missed: TTFT {f['slo_missed_ttft']}, "
                     f"gaps {f['slo_missed_gaps']}, both {f['slo_missed_both']}")
    return "\n".join(lines) + "\n"


def run_trace_command(args: argparse.Namespace, modes: Optional[list[str]],
                      cost: StepCost, backend: Backend) -> int:
    _check_trace_file(args.trace)
    policies = list(dict.fromkeys(args.policy or POLICIES))  # each one once
    modes = modes or [DEFAULT_MODE]
    _check_modes(modes)
    if len(modes) > 1:
        raise CommandError("--trace replays one planning mode at a time: --mixed, "
                           "--no-mixed or --slack")
    mode = modes[0]
    _check_outputs(args, TRACE_PLOTS)
    cache = args.prefix_cache_tokens
    cache = DEFAULT_PREFIX_CACHE_TOKENS if cache is None else (None if cache == "unlimited"
                                                               else cache)
    try:
        options = replace(ReplayOptions(), prefix_cache_tokens=cache,
                          record_series=bool(args.plot), slo_told=bool(args.slo),
                          **_overrides(args, _RUN_OPTIONS)).validate()
    except (ValueError, TypeError) as exc:
        raise CommandError(str(exc)) from None
    _check_reserve(args, options)
    if options.slo_told and mode != "slack":
        raise CommandError("--slo tells the slack rule the SLO: give --slack too")
    _check_slack_target(modes, options)
    trace, ids = _open_trace(args, options)
    stats = trace.stats
    out = sys.stdout
    info = {"path": args.trace, "format": trace.format, "time_scale": trace.time_scale,
            "limit": trace.limit, **stats.as_dict(), "mode": mode, "backend": backend.name,
            "cost_model": cost.lab_dict(),
            "options": {k: v for k, v in options.__dict__.items() if k != "record_series"}}
    out.write(f"# trace {args.trace} format={trace.format} requests={stats.requests} "
              f"skipped_failures={stats.skipped_failures} span_s={stats.span_s:.1f} "
              f"time_scale={trace.time_scale:g} mean_input={_fmt(info['mean_input_tokens'])} "
              f"mean_output={_fmt(info['mean_output_tokens'])} "
              f"tenants={info['tenants']}\n")
    out.write(f"# backend={backend.name} mode={mode} max_active={options.max_active} "
              f"max_tokens={options.max_tokens} chunk={options.chunk} "
              f"kv_capacity_tokens={options.kv_capacity_tokens} prefix_cache_tokens="
              f"{'unlimited' if cache is None else cache} ttft_target_ms="
              f"{options.ttft_target_ms:g} itl_target_ms={options.itl_target_ms:g}\n")
    out.write(f"# {TRACE_UNITS}\n")
    out.write(format_trace_header() + "\n")
    out.flush()
    finished: list[Any] = []

    def emit(run: Any) -> None:
        finished.append(run)
        out.write(format_trace_row(run.figures) + "\n")
        out.flush()

    from ..lab.plot import plot_trace

    title = f"trace {os.path.basename(args.trace)}, time scale {trace.time_scale:g}"
    if trace.limit is not None:
        title += f", first {trace.limit} requests"
    if args.tenants is not None:
        title += f", {args.tenants} hashed tenants"
    stopped: Optional[Interrupted] = None
    try:
        run_replays(trace, policies, mode, options, cost, backend=backend, on_run=emit,
                    total=stats.requests)
    except TraceError as exc:  # the file changed since it was checked
        raise CommandError(str(exc)) from None
    except LabStalled as exc:
        raise _stalled(exc, options) from None
    except Interrupted as stop:
        if len(finished) < len(policies):
            with saving():  # with nothing finished too: a script waiting for the file gets one
                saved = _save(args, interrupted(trace_document(info, finished), stop),
                              finished, plot_trace, ids=ids, title=title)
            raise stop.keeping(f"{len(finished)} of {len(policies)} policies printed"
                               + saved.kept()) from None
        stopped = stop  # after the last replay: the outputs are whole all the same
    with saving():  # every replay finished: a signal now cannot cut the outputs short
        runs = finished
        tenants = format_tenant_table(runs)
        if tenants:
            out.write("\n" + tenants)
        if options.slo_told:
            out.write("\n" + format_slo_lines(runs, options))
        out.flush()
        doc = trace_document(info, runs)
        _tails(args, runs, doc)
        saved = _save(args, doc, runs, plot_trace, ids=ids, title=title)
    return finish(saved, stopped, f"all {len(policies)} policies printed")
