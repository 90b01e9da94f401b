"""`skippy-scheduler run`: serve prompts through the scheduler on a real llama.cpp model.

It reports what each client saw (generated tokens, queue wait, TTFT, inter-token gaps). Without
`--model` it writes the tiny random-weight model to a temporary directory, so it works offline.
`llama_cpp` is imported only when the command runs, so the rest of the CLI does not need the
`llama` extra.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
from typing import Any, Optional

from .._validate import json_loads
from ..engine.contract import ContextLimitsHost, PipelinedHost, StateReportingHost
from ..engine.record import percentile
from ..lab.progress import Progress
from ..selection import DEFAULT_IMPLEMENTATION, DEFAULT_POLICY, make_scheduler
from ..hosts.offload import CPU_BATCH
from .offload import (check_device_names, print_placement, refuse_offload_with_stage_addresses,
                      resolve_for)
from ._common import (DEFAULT_THREADS, LLAMA_MAX_SEQUENCES, CommandError, add_model_options, bound,
                      check_model, check_output_file, import_llama_host, model_path,
                      non_negative_int, non_negative_ms, positive_int, positive_ms,
                      plans_in_flight_count, refuse_rpc_with_stages)
from .interrupt import Interrupted, saving
from .lab_runs import Saved, json_writer
from .stage import (add_stage_cache_flag, check_stage_cache_flag, stage_addresses,
                    stage_directory)
from .vocabulary import add_flag

# Prompts used when --prompts is not given: strings (tokenized by the model) and raw ids.
BUILTIN_PROMPTS: list[Any] = [
    "the cat sat on the mat",
    "hello world",
    "in the beginning there was a scheduler",
    "batching is what makes serving cheap",
    [1, 300, 301, 302, 303, 304, 305, 306, 307, 308, 309, 310],
    "a b c d e f g",
]
CELLS_PER_LANE_STEP = 256  # llama.cpp pads each sequence's KV stream to a multiple of this
PROGRESS_DELAY_S = 1.0  # a run shows its progress bar (on a terminal) once it lasts this long
# The summary's percentiles: (summary name, the record's figure or figures).
_PERCENTILES = (("queue_wait", "queue_wait_us"), ("ttft", "ttft_us"), ("itl", "itl_us"),
                ("latency", "latency_us"))


def register(subparsers: Any) -> None:
    from ..serve.server import PLANNING_RULES, ServeSettings

    p = subparsers.add_parser(
        "run", help="serve prompts through the scheduler on a llama.cpp model",
        usage="%(prog)s [-m GGUF] [--prompts FILE] [--json FILE] [OPTIONS]",
        description="Serve prompts through the scheduler on a llama.cpp model and measure "
                    "queue wait, time to first token and inter-token gaps. The scheduler "
                    "settings and their defaults are serve's. On a terminal, a run that lasts "
                    f"more than {PROGRESS_DELAY_S:g} s shows a progress bar on stderr (the "
                    "requests finished), cleared before the results are printed.")
    add_model_options(p, stages=True, backend_sampling=True, stage_ahead=True)
    p.add_argument("--prompts", metavar="FILE",
                   help="JSON list of prompts: token-id lists or strings (default: a built-in "
                        "set of six)")
    add_flag(p, "max-tokens", type=positive_int, default=16)
    add_flag(p, "max-active", type=positive_int, default=8)
    add_flag(p, "ctx-size", type=positive_int,
             default_text="each lane sized for the longest prompt plus --max-tokens")
    add_flag(p, "batch-tokens", type=positive_int, default=None,
             default_text="512 on the CPU, 2048 with layers on a GPU (llama-server's)",
             note="it follows the device where the layers go")
    add_flag(p, "prefill-chunk", type=positive_int, default=256)
    add_flag(p, "mixed", default=True)
    add_flag(p, "max-consecutive-prefill", type=bound, default=1)
    add_flag(p, "planning-rule", default=ServeSettings.planning_rule, choices=PLANNING_RULES)
    add_flag(p, "itl-target", type=positive_ms, default=ServeSettings.itl_target_ms,
             note="the slack rule's")
    add_flag(p, "prefill-age-max", type=non_negative_ms,
             default=ServeSettings.prefill_age_max_ms)
    add_flag(p, "policy", default=DEFAULT_POLICY)
    add_flag(p, "scheduler", default=DEFAULT_IMPLEMENTATION)
    add_flag(p, "inflight", type=plans_in_flight_count, default=ServeSettings.inflight,
             note="llama_decode runs on a worker thread",
             default_text="2 with layers on a GPU, 1 on the CPU")
    p.add_argument("--arrival-interval-ms", type=non_negative_ms, default=0.0, metavar="MS",
                   help="request i arrives at i x this interval (default: 0, all at once)")
    add_flag(p, "prefix-cache-tokens", type=non_negative_int, default=0,
             note="each holder gets a KV stream like a lane's unless --kv-unified; off unless "
                  "asked for, unlike serve, so a run's figures are of prefill as given")
    add_flag(p, "prefix-holders", type=positive_int, default=16,
             note="the scheduler reserves them; unlike serve, a fixed count, as run's reuse is "
                  "asked for explicitly")
    p.add_argument("-kvu", "--kv-unified", action="store_true",
                   help="one KV cache shared by all sequences (with prefix reuse: holders "
                        "share cells instead of holding a stream each; default: off)")
    add_flag(p, "json", note="per-request tokens and metrics; after Ctrl-C or SIGTERM, those "
                             "of the requests that finished, the summary's percentiles over "
                             "them and \"interrupted\": the signal")
    p.add_argument("--stages", type=stage_directory, metavar="DIR",
                   help="stages of a split model; here the directory of stage-K.gguf files "
                        "written by split, served by one local stage worker process each "
                        "(default: no stages)")
    p.add_argument("--stage-addresses", type=stage_addresses, default=(), metavar="ADDR,...",
                   help="serve on stage workers already running at these pyzmq addresses "
                        "(`stage --listen`), stage 0 first (default: none)")
    add_stage_cache_flag(p)
    p.set_defaults(func=run)


def _deepest_line(text: str) -> int:
    """The line of `text` (JSON) where its nesting first reaches its deepest (strings
    skipped): where a document nested too deeply for the parser goes too deep."""
    depth = deepest = 0
    line = where = 1
    in_string = escaped = False
    for ch in text:
        if ch == "\n":
            line += 1
        elif in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > deepest:
                deepest, where = depth, line
        elif ch in "]}":
            depth -= 1
    return where


def _long_number_line(text: str) -> Optional[int]:
    """The line of the first number in `text` longer than Python reads (None if none)."""
    limit = getattr(sys, "get_int_max_str_digits", lambda: 0)()
    if not limit:
        return None
    # Digits inside a string are text, not a number: strings are matched and passed over.
    for m in re.finditer(r'"(?:[^"\\]|\\.)*"|(\d{%d,})' % (limit + 1), text):
        if m.group(1):
            return text.count("\n", 0, m.start(1)) + 1
    return None


def load_prompts(path: str | None) -> list[Any]:
    if path is None:
        return list(BUILTIN_PROMPTS)
    text = ""
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
        data = json_loads(text)
    except FileNotFoundError:
        raise CommandError(f"--prompts: file not found: {path}") from None
    except OSError as exc:
        raise CommandError(f"--prompts: cannot read {path}: {exc.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CommandError(f"--prompts: {path} is not valid JSON ({exc})") from None
    except RecursionError:  # [[[[...: deeper than the parser goes
        raise CommandError(f"--prompts: {path} is not valid JSON (line {_deepest_line(text)}: "
                           "nested too deeply)") from None
    except ValueError as exc:  # an integer of more digits than Python reads
        line = _long_number_line(text)
        raise CommandError(f"--prompts: {path} is not valid JSON ("
                           + (f"line {line}: " if line else "")
                           + f"{str(exc).split(';')[0]})") from None
    if not isinstance(data, list) or not data:
        raise CommandError("--prompts must hold a non-empty JSON list")
    for i, item in enumerate(data):
        ok = isinstance(item, str) or (
            isinstance(item, list)
            and all(isinstance(t, int) and not isinstance(t, bool) for t in item))
        if not ok:
            raise CommandError(
                f"prompt {i} must be a string or a list of token ids")
    return data


def _tokenize_prompts(host: Any, prompts: list[Any]) -> list[list[int]]:
    out = []
    for i, item in enumerate(prompts):
        tokens = host.tokenize(item) if isinstance(item, str) else list(item)
        if not tokens:
            raise CommandError(f"prompt {i} is empty")
        bad = [t for t in tokens if not 0 <= t < host.n_vocab]
        if bad:
            raise CommandError(
                f"prompt {i} has token ids outside [0, {host.n_vocab}): {bad[:5]}")
        out.append(tokens)
    return out


def _lane_cells(need: int) -> int:
    """A lane's KV cells for `need` positions, as llama.cpp pads them."""
    step = CELLS_PER_LANE_STEP
    return max(step, -(-need // step) * step)


def _n_ctx(args: argparse.Namespace, prompts: list[Any], holders: int) -> tuple[int, int]:
    """(llama.cpp context, cells of one lane): -c/--ctx-size split between the lanes, or each
    lane sized for the longest prompt plus --max-tokens; holders get lanes of the same size
    (or, unified, the cells of the prefixes they keep)."""
    if args.ctx_size is not None:
        lane = _lane_cells(args.ctx_size // args.max_active)
    else:
        lane = _lane_cells(args.max_tokens + max(
            (len(p) if isinstance(p, list) else len(p.encode()) + 2) for p in prompts))
    n_ctx = args.max_active * lane
    if args.prefix_cache_tokens and args.kv_unified:
        n_ctx += _lane_cells(args.prefix_cache_tokens)
    elif args.prefix_cache_tokens:
        n_ctx += holders * lane
    return n_ctx, lane


def run(args: argparse.Namespace) -> int:
    holders = args.prefix_holders if args.prefix_cache_tokens else 0
    if args.max_active + holders > LLAMA_MAX_SEQUENCES:
        raise CommandError(f"--max-active (+ --prefix-holders with reuse) must be <= "
                           f"{LLAMA_MAX_SEQUENCES} (llama.cpp's sequence ids)")
    if args.ctx_size is not None and args.ctx_size < args.max_active:
        raise CommandError(f"--ctx-size ({args.ctx_size}) must be at least --max-active "
                           f"({args.max_active}): every lane needs KV cells")
    check_output_file("--json", args.json, [("--model", args.model),
                                            ("--prompts", args.prompts)])
    refuse_rpc_with_stages(args)
    refuse_offload_with_stage_addresses(args)
    if args.stages:
        check_device_names([*args.device, *(getattr(args, "stage_devices", ()) or ())])
    if getattr(args, "stage_devices", None) and not args.stages:
        raise CommandError("--stage-devices needs --stages (local stage workers)")
    check_model(args)
    check_stage_cache_flag(args)
    prompts = load_prompts(args.prompts)
    llama = import_llama_host()
    # From the end of the run on (serve_prompts enters saving() into it), both signals are
    # ignored: closing the model and the temporary folder, printing and writing go to the end.
    with contextlib.ExitStack() as finishing:
        return _run(args, llama, prompts, holders, finishing)


def _run(args: argparse.Namespace, llama: Any, prompts: list[Any], holders: int,
         finishing: contextlib.ExitStack) -> int:
    with model_path(args) as model:
        n_ctx, lane = _n_ctx(args, prompts, holders)
        n_seq, n_batch = args.max_active, args.max_num_batched_tokens
        if args.stages or args.stage_addresses:
            from .stage import run_staged

            args.inflight = args.inflight or 1  # the pipeline depth: one stage's work at a time
            requests, report, settings, summary = run_staged(args, prompts, n_seq,
                                                             n_batch or CPU_BATCH, lane,
                                                             finishing)
        else:
            fit = resolve_for(args, model, n_ctx=n_ctx, lanes=n_seq,
                              holders=holders if args.prefix_cache_tokens else 0,
                              unified=bool(args.kv_unified), n_batch=n_batch)
            print_placement("run", fit, always=False)
            n_batch = fit.n_batch
            from ..serve.server import plans_in_flight

            args.inflight = plans_in_flight(args.inflight, fit.placement.on_gpu)
            try:
                host = llama.LlamaHost(
                    model, n_ctx=n_ctx, n_seq_max=n_seq,
                    n_threads=args.threads or DEFAULT_THREADS, n_batch=n_batch,
                    n_ubatch=fit.n_ubatch,
                    kv_type=fit.kv_type, placement=fit.placement,
                    flash_attn=fit.flash_attn, prefix_cache_tokens=args.prefix_cache_tokens,
                    kv_unified=args.kv_unified,
                    prefix_holders=max(holders, 1),
                    backend_sampling=args.backend_sampling,
                    stage_ahead=args.stage_ahead)
            except llama.LlamaLoadError as exc:  # a context too large for the memory, ...
                raise CommandError(str(exc)) from None
            with host:
                requests, report, settings, summary = serve_prompts(
                    args, host, prompts, n_seq, n_batch, lane, finishing=finishing)
    stopped = summary.pop("interrupted", None)
    if stopped is not None:  # the figures of the requests printed, not of the ones cut short
        summary.update(finished_percentiles(report.records))
    doc = {
        "model": args.model or f"tiny-random-llama (seed {args.seed}, f32)",
        "settings": settings,
        "requests": [_request_json(i, req, rec) for i, (req, rec)
                     in enumerate(zip(requests, report.records))
                     if stopped is None or rec.finish_reason is not None],
        "summary": summary,
    }
    if stopped is None:
        _save(args, doc).check()
        return 0
    if not doc["requests"]:
        raise stopped
    doc["interrupted"] = stopped.signal_name
    saved = _save(args, doc)
    raise stopped.keeping(f"{len(doc['requests'])} of {len(requests)} requests had finished "
                          f"and are printed" + saved.kept())


def finished_percentiles(records: list[Any]) -> dict[str, float]:
    """The summary's percentiles (`EngineReport.summary`'s p50/p95/p99 of queue wait, TTFT,
    inter-token gap and latency, µs) over the records of the requests that finished."""
    done = [r for r in records if r.finish_reason is not None]
    out: dict[str, float] = {}
    for name, figure in _PERCENTILES:
        if figure == "itl_us":
            values = [g for r in done for g in r.itl_us]
        else:
            values = [getattr(r, figure) for r in done if getattr(r, figure) is not None]
        for p in (50, 95, 99):
            out[f"p{p}_{name}_us"] = float(percentile(values, p))
    return out


def _progress(engine: Any, total: int) -> Progress:
    """A progress bar of the requests finished (shown on a terminal only, once the run lasts
    PROGRESS_DELAY_S), fed by the engine's events; close it before printing."""
    from ..engine import FinishEvent

    bar = Progress(total, "run", delay_s=PROGRESS_DELAY_S)
    if bar.enabled:
        finished = 0

        def count(event: Any) -> None:
            nonlocal finished
            if isinstance(event, FinishEvent):
                finished += 1
            bar.update(finished)  # on every token too: the elapsed time moves on

        engine.add_listener(count)
    return bar


def serve_prompts(args: argparse.Namespace, host: Any, prompts: list[Any], n_seq: int,
                  n_batch: int, lane: Optional[int] = None, *,
                  finishing: Optional[contextlib.ExitStack] = None) -> tuple[Any, Any, Any, Any]:
    """Run the prompts through the scheduler on `host`: (requests, report, settings, summary).

    lane: KV cells of one lane, when known: a prompt that cannot fit its lane is refused before
    the run. Interrupted by SIGINT or SIGTERM, the run stops and the summary holds the
    `Interrupted` under "interrupted" (the report covers what happened until then).
    finishing: once the run has ended (finished or interrupted), `saving()` is entered into it,
    so that a signal cannot stop the caller before it has printed and saved the results.
    """
    from .. import PlanningRule, SchedulerConfig
    from ..engine import Engine, Request

    token_prompts = _tokenize_prompts(host, prompts)
    for i, tokens in enumerate(token_prompts):
        if lane is not None and len(tokens) + args.max_tokens > lane:
            raise CommandError(
                f"prompt {i} ({len(tokens)} tokens) and --max-tokens {args.max_tokens} need "
                f"{len(tokens) + args.max_tokens} KV cells; a lane holds {lane} "
                f"(--ctx-size / --max-active, rounded up to {CELLS_PER_LANE_STEP})")
    if isinstance(host, ContextLimitsHost):  # the batch its context got (capped at its cells)
        n_batch = min(n_batch, host.n_batch)
    config = dict(
        max_active_sequences=n_seq, max_tokens_per_iteration=n_batch,
        prefill_chunk_tokens=int(min(args.prefill_chunk, n_batch)),
        mixed_prefill_decode=args.mixed,
        max_consecutive_prefill_iterations=args.max_consecutive_prefill,
        max_inflight_plans=args.inflight or 1,
        planning_rule=PlanningRule.SLACK if args.planning_rule == "slack"
        else PlanningRule.REFERENCE, itl_target=args.itl_target_ms / 1e3,
        slack_prefill_age_max=args.prefill_age_max_ms / 1e3,
    )
    if args.prefix_cache_tokens:
        config.update(host.sequence_id_settings)
    if isinstance(host, PipelinedHost) and host.pipeline_depth > 1:  # stages: disjoint groups
        config["disjoint_inflight_plans"] = True
    scheduler = make_scheduler(SchedulerConfig(**config), policy=args.policy,
                               implementation=args.scheduler)
    interval_us = args.arrival_interval_ms * 1e3
    requests = [
        Request(f"request-{i}", toks, args.max_tokens, arrival_us=i * interval_us)
        for i, toks in enumerate(token_prompts)
    ]
    try:
        engine = Engine(scheduler, host, clock="wall")
    except ValueError as exc:  # a config the host refuses (more lanes or a larger plan)
        raise CommandError(str(exc)) from None
    bar = _progress(engine, len(requests))
    stopped = None
    try:
        report = engine.run(requests)
    except Interrupted as stop:
        stopped, report = stop, engine.report()
    finally:
        if finishing is not None:
            finishing.enter_context(saving())
        bar.close()
    settings = dict(host.settings, scheduler=args.scheduler, max_tokens=args.max_tokens,
                    arrival_interval_ms=args.arrival_interval_ms, policy=args.policy,
                    **{**config, "planning_rule": args.planning_rule})
    summary = report.summary()
    summary.update(_reuse_summary(scheduler.metrics(), host.prefix_store))
    if settings.get("stage_ahead") and isinstance(host, StateReportingHost):
        summary["staged_ahead"] = host.host_state().staged_ahead  # plans run as staged
    if stopped is not None:
        summary["interrupted"] = stopped
    return requests, report, settings, summary


def _save(args: argparse.Namespace, doc: dict[str, Any]) -> Saved:
    """Print the results, then write --json (a `Saved`: a write error is reported after the
    table, which it cannot lose)."""
    _print_run(doc)
    sys.stdout.flush()
    saved = Saved()
    saved.write("--json", args.json, json_writer(doc))
    return saved


def _reuse_summary(metrics: Any, store: Any) -> dict[str, Any]:
    """Prefix reuse over the whole run: prompt tokens restored from resident prefixes and
    tokens prefilled (prefill + recompute rows), the share restored, evictions, stale refreshes."""
    restored = metrics.restored_tokens
    prefilled = metrics.prefill_tokens + metrics.recompute_tokens
    return {
        "restored_tokens": restored,
        "prefilled_tokens": prefilled,
        "prefix_hit_rate": restored / (restored + prefilled) if restored + prefilled else 0.0,
        "evictions": store.evictions if store is not None else 0,
        "stale_refreshes": metrics.stale_refreshes,
    }


def _request_json(index: int, request: Any, record: Any) -> dict[str, Any]:
    return {
        "index": index,
        "id": record.id,
        "prompt_tokens": list(request.prompt_tokens),
        "generated_tokens": record.tokens,
        "queue_wait_us": record.queue_wait_us,
        "ttft_us": record.ttft_us,
        "itl_us": record.itl_us,
        "finish": record.finish_reason,
        "preemptions": record.preemptions,
    }


def _print_run(doc: dict[str, Any]) -> None:
    out = sys.stdout
    print("index\tprompt\tgen\tfinish\tqueue_ms\tttft_ms\tmax_itl_ms", file=out)
    for r in doc["requests"]:
        def ms(v: float | None) -> str:
            return "-" if v is None else f"{v / 1e3:.3f}"
        itl = max(r["itl_us"]) if r["itl_us"] else None
        print(f"{r['index']}\t{len(r['prompt_tokens'])}\t{len(r['generated_tokens'])}\t"
              f"{r['finish']}\t{ms(r['queue_wait_us'])}\t{ms(r['ttft_us'])}\t{ms(itl)}", file=out)
    s = doc["summary"]
    gaps = any(r["itl_us"] for r in doc["requests"])  # none when every request made one token
    itl = (f"{s['p50_itl_us'] / 1e3:.3f}/{s['p95_itl_us'] / 1e3:.3f} ms" if gaps
           else "- (no request made two tokens)")
    # Interrupted, the percentiles are those of the requests printed above (finished_percentiles).
    over = (f"over the {len(doc['requests'])} finished requests: " if "interrupted" in doc
            else "")
    print(f"# {s['completed']}/{s['requests']} completed, {s['generated_tokens']} tokens in "
          f"{s['makespan_s'] * 1e3:.1f} ms ({s['tokens_per_s']:.0f} tok/s); {over}"
          f"p50/p95 TTFT {s['p50_ttft_us'] / 1e3:.3f}/{s['p95_ttft_us'] / 1e3:.3f} ms, "
          f"p50/p95 ITL {itl}; "
          f"{s['iterations']} iterations, mean batch {s['mean_batch_size']:.2f}", file=out)
    if doc["settings"].get("prefix_cache_tokens"):
        print(f"# prefix reuse: {s['restored_tokens']} tokens restored, {s['prefilled_tokens']} "
              f"prefilled (hit rate {s['prefix_hit_rate']:.1%}), {s['evictions']} evictions, "
              f"{s['stale_refreshes']} stale refreshes", file=out)
