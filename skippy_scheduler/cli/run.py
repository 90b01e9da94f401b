"""`skippy-scheduler run`: serve prompts through the scheduler on a real llama.cpp model.

It reports what each client saw (generated tokens, queue wait, TTFT, inter-token gaps). Without
`--model` it writes the tiny random-weight model to a temporary directory, so it works offline.
`llama_cpp` is imported only when the command runs, so the rest of the CLI does not need the
`llama` extra.
"""
from __future__ import annotations

import json
import sys

from ._common import (CommandError, add_model_options, check_model, check_output_file,
                      import_llama_host, model_path, non_negative_float, non_negative_int,
                      positive_int)

# Prompts used when --prompts is not given: strings (tokenized by the model) and raw ids.
BUILTIN_PROMPTS: list = [
    "the cat sat on the mat",
    "hello world",
    "in the beginning there was a scheduler",
    "batching is what makes serving cheap",
    [1, 300, 301, 302, 303, 304, 305, 306, 307, 308, 309, 310],
    "a b c d e f g",
]
LLAMA_MAX_SEQUENCES = 256  # llama.cpp's sequence ids


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "run", help="serve prompts through the scheduler on a llama.cpp model",
        usage="%(prog)s [--model GGUF] [--prompts FILE] [--json FILE] [OPTIONS]",
        description="Serve prompts through the scheduler on a llama.cpp model and measure "
                    "queue wait, time to first token and inter-token gaps.")
    add_model_options(p)
    p.add_argument("--prompts", metavar="FILE",
                   help="JSON list of prompts: token-id lists or strings (default: built-in set)")
    p.add_argument("--max-tokens", type=positive_int, default=16,
                   help="tokens to generate per request (16)")
    p.add_argument("--max-active", type=positive_int, default=4,
                   help="max active sequences = llama sequence ids (4)")
    p.add_argument("--prefill-chunk", type=positive_int, default=256,
                   help="prefill chunk tokens (256)")
    p.add_argument("--max-tokens-per-iteration", type=positive_int, default=512,
                   help="token budget per iteration = llama batch size (512)")
    p.add_argument("--max-consecutive-prefill", type=positive_int, default=None,
                   help="prefill plans in a row while decode waits (default unbounded)")
    p.add_argument("--mixed", action="store_true", help="allow mixed prefill+decode iterations")
    p.add_argument("--inflight", type=positive_int, default=1, metavar="D",
                   help="plans in flight: with 2, the next plan is made and the previous one "
                        "completed while llama_decode runs on a worker thread (1)")
    p.add_argument("--arrival-interval-ms", type=non_negative_float, default=0.0,
                   help="request i arrives at i x this interval (0: all at once)")
    p.add_argument("--scheduler", choices=("native", "twin"), default="native",
                   help="native scheduler (default) or the pure-Python twin")
    p.add_argument("--admission", choices=("cache-aware", "fcfs", "priority"),
                   default="cache-aware", help="admission order (default: cache-aware)")
    p.add_argument("--prefix-cache-tokens", type=non_negative_int, default=0, metavar="N",
                   help="keep up to N tokens of finished sequences' KV as reusable prefixes "
                        "(0, the default, disables reuse; each holder gets a KV stream like a lane's "
                        "unless --kv-unified)")
    p.add_argument("--prefix-holders", type=positive_int, default=16, metavar="K",
                   help="sequence ids that hold resident prefixes (default 16; the scheduler "
                        "reserves them)")
    p.add_argument("--kv-unified", action="store_true",
                   help="one KV cache shared by all sequences (with prefix reuse: holders "
                        "share cells instead of holding a stream each)")
    p.add_argument("--json", metavar="FILE", help="write per-request tokens and metrics here")
    p.add_argument("--stages", metavar="DIR",
                   help="serve the model split into DIR/stage-K.gguf (from `split`), one local "
                        "stage worker process each")
    p.add_argument("--stage-addresses", metavar="ADDR,...",
                   help="serve on stage workers already running at these pyzmq addresses "
                        "(`stage --listen`), stage 0 first")
    p.set_defaults(func=run)


def load_prompts(path: str | None) -> list:
    if path is None:
        return list(BUILTIN_PROMPTS)
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except FileNotFoundError:
        raise CommandError(f"--prompts: file not found: {path}") from None
    except OSError as exc:
        raise CommandError(f"--prompts: cannot read {path}: {exc.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CommandError(f"--prompts: {path} is not valid JSON ({exc})") from None
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


def _tokenize_prompts(host, prompts: list) -> list[list[int]]:
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


def _make_scheduler(kind: str, admission: str = "cache-aware", **config):
    from .. import Scheduler, SchedulerConfig, TwinScheduler
    from ..policies import CacheAwareAdmission, FcfsAdmission, PriorityAdmission

    cls = Scheduler if kind == "native" else TwinScheduler
    policy = {"cache-aware": CacheAwareAdmission, "fcfs": FcfsAdmission,
              "priority": PriorityAdmission}[admission]()
    return cls(SchedulerConfig(**config), policy)


def _ctx_per_sequence(need: int) -> int:
    # llama.cpp pads each sequence's KV stream to a multiple of 256 cells.
    return max(256, -(-need // 256) * 256)


def run(args) -> int:
    holders = args.prefix_holders if args.prefix_cache_tokens else 0
    if args.max_active + holders > LLAMA_MAX_SEQUENCES:
        raise CommandError(f"--max-active (+ --prefix-holders with reuse) must be <= "
                           f"{LLAMA_MAX_SEQUENCES} (llama.cpp's sequence ids)")
    check_model(args)
    check_output_file("--json", args.json)
    prompts = load_prompts(args.prompts)
    llama = import_llama_host()

    with model_path(args) as model:
        probe_need = args.max_tokens + max(
            (len(p) if isinstance(p, list) else len(p.encode()) + 2) for p in prompts)
        n_seq = args.max_active
        n_batch = args.max_tokens_per_iteration
        # One stream per lane and per holder, or (unified) the lanes' cells plus the resident
        # prefixes' cells.
        n_ctx = n_seq * _ctx_per_sequence(probe_need)
        if args.prefix_cache_tokens and args.kv_unified:
            n_ctx += _ctx_per_sequence(args.prefix_cache_tokens)
        elif args.prefix_cache_tokens:
            n_ctx += holders * _ctx_per_sequence(probe_need)
        if args.stages or args.stage_addresses:
            from .stage import run_staged

            requests, report, settings, summary = run_staged(args, model, prompts, n_seq,
                                                             n_batch, n_ctx)
        else:
            with llama.LlamaHost(
                model, n_ctx=n_ctx, n_seq_max=n_seq,
                n_threads=args.threads, n_batch=n_batch, kv_type=args.kv_type,
                flash_attn=args.flash_attn, prefix_cache_tokens=args.prefix_cache_tokens,
                kv_unified=args.kv_unified,
                prefix_holders=max(holders, 1),
            ) as host:
                requests, report, settings, summary = serve_prompts(args, host, prompts,
                                                                    n_seq, n_batch)
    doc = {
        "model": args.model or f"tiny-random-llama (seed {args.seed}, f32)",
        "settings": settings,
        "requests": [_request_json(i, req, rec) for i, (req, rec)
                     in enumerate(zip(requests, report.records))],
        "summary": summary,
    }
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(doc, fh, indent=2)
            fh.write("\n")
    _print_run(doc)
    return 0


def serve_prompts(args, host, prompts: list, n_seq: int, n_batch: int):
    """Run the prompts through the scheduler on `host`: (requests, report, settings, summary)."""
    from ..engine import Engine, Request

    token_prompts = _tokenize_prompts(host, prompts)
    config = dict(
        max_active_sequences=n_seq, max_tokens_per_iteration=n_batch,
        prefill_chunk_tokens=min(args.prefill_chunk, n_batch),
        mixed_prefill_decode=args.mixed,
        max_inflight_plans=args.inflight,
    )
    if args.max_consecutive_prefill is not None:
        config["max_consecutive_prefill_iterations"] = args.max_consecutive_prefill
    if args.prefix_cache_tokens:
        config.update(host.sequence_id_settings)
    scheduler = _make_scheduler(args.scheduler, args.admission, **config)
    interval_us = args.arrival_interval_ms * 1e3
    requests = [
        Request(f"request-{i}", toks, args.max_tokens, arrival_us=i * interval_us)
        for i, toks in enumerate(token_prompts)
    ]
    report = Engine(scheduler, host, clock="wall").run(requests)
    settings = dict(host.settings, scheduler=args.scheduler, max_tokens=args.max_tokens,
                    arrival_interval_ms=args.arrival_interval_ms,
                    admission=args.admission, **config)
    summary = report.summary()
    summary.update(_reuse_summary(scheduler.metrics(), getattr(host, "prefix_store", None)))
    return requests, report, settings, summary


def _reuse_summary(metrics, store) -> dict:
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


def _request_json(index: int, request, record) -> dict:
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


def _print_run(doc: dict) -> None:
    out = sys.stdout
    print("index\tprompt\tgen\tfinish\tqueue_ms\tttft_ms\tmax_itl_ms", file=out)
    for r in doc["requests"]:
        def ms(v):
            return "-" if v is None else f"{v / 1e3:.3f}"
        itl = max(r["itl_us"]) if r["itl_us"] else None
        print(f"{r['index']}\t{len(r['prompt_tokens'])}\t{len(r['generated_tokens'])}\t"
              f"{r['finish']}\t{ms(r['queue_wait_us'])}\t{ms(r['ttft_us'])}\t{ms(itl)}", file=out)
    s = doc["summary"]
    print(f"# {s['completed']}/{s['requests']} completed, {s['generated_tokens']} tokens in "
          f"{s['makespan_s'] * 1e3:.1f} ms ({s['tokens_per_s']:.0f} tok/s); "
          f"p50/p95 TTFT {s['p50_ttft_us'] / 1e3:.3f}/{s['p95_ttft_us'] / 1e3:.3f} ms, "
          f"p50/p95 ITL {s['p50_itl_us'] / 1e3:.3f}/{s['p95_itl_us'] / 1e3:.3f} ms; "
          f"{s['iterations']} iterations, mean batch {s['mean_batch_size']:.2f}", file=out)
    if doc["settings"].get("prefix_cache_tokens"):
        print(f"# prefix reuse: {s['restored_tokens']} tokens restored, {s['prefilled_tokens']} "
              f"prefilled (hit rate {s['prefix_hit_rate']:.1%}), {s['evictions']} evictions, "
              f"{s['stale_refreshes']} stale refreshes", file=out)
