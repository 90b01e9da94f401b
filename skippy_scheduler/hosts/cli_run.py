"""`skippy-scheduler run` and `skippy-scheduler calibrate`: the scheduler on a real llama.cpp model.

`run` serves a list of prompts through the scheduler and `LlamaHost` and reports what each
client saw (generated tokens, queue wait, TTFT, inter-token gaps); `calibrate` fits the lab's
iteration cost model to the model on this machine. Without `--model` both write the tiny
random-weight model to a temporary directory, so they work offline. `llama_cpp` is imported only
when a command runs, so the rest of the CLI does not need the `llama` extra.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile

from skippy_scheduler.cli import CommandError

# Prompts used when --prompts is not given: strings (tokenized by the model) and raw ids.
BUILTIN_PROMPTS: list = [
    "the cat sat on the mat",
    "hello world",
    "in the beginning there was a scheduler",
    "batching is what makes serving cheap",
    [1, 300, 301, 302, 303, 304, 305, 306, 307, 308, 309, 310],
    "a b c d e f g",
]


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def _add_model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", metavar="PATH",
                   help="GGUF model (default: a tiny random-weight model written to a temp dir)")
    p.add_argument("--seed", type=int, default=0, help="seed of the tiny default model (0)")
    p.add_argument("--threads", type=_positive_int, default=2, help="llama.cpp threads (2)")
    p.add_argument("--kv-type", choices=("f32", "f16"), default="f32",
                   help="KV cache type; f32 (default) keeps batched and alone runs identical")
    p.add_argument("--flash-attn", action="store_true",
                   help="enable flash attention (faster, gives up batch-invariant tokens)")


def register(subparsers) -> None:
    """Add `run` and `calibrate` to the `skippy-scheduler` command line."""
    add_run_parser(subparsers)
    add_calibrate_parser(subparsers)


def add_run_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "run", help="serve prompts through the scheduler on a llama.cpp model",
        description="Serve prompts through the scheduler on a llama.cpp model and measure "
                    "queue wait, time to first token and inter-token gaps.")
    _add_model_options(p)
    p.add_argument("--prompts", metavar="FILE",
                   help="JSON list of prompts: token-id lists or strings (default: built-in set)")
    p.add_argument("--max-tokens", type=_positive_int, default=16,
                   help="tokens to generate per request (16)")
    p.add_argument("--max-active", type=_positive_int, default=4,
                   help="max active sequences = llama sequence ids (4)")
    p.add_argument("--prefill-chunk", type=_positive_int, default=256,
                   help="prefill chunk tokens (256)")
    p.add_argument("--max-tokens-per-iteration", type=_positive_int, default=512,
                   help="token budget per iteration = llama batch size (512)")
    p.add_argument("--max-consecutive-prefill", type=_positive_int, default=None,
                   help="prefill plans in a row while decode waits (default unbounded)")
    p.add_argument("--mixed", action="store_true", help="allow mixed prefill+decode iterations")
    p.add_argument("--arrival-interval-ms", type=_non_negative_float, default=0.0,
                   help="request i arrives at i x this interval (0: all at once)")
    p.add_argument("--scheduler", choices=("native", "twin"), default="native",
                   help="native scheduler (default) or the pure-Python twin")
    p.add_argument("--json", metavar="FILE", help="write per-request tokens and metrics here")
    p.set_defaults(func=run_command)
    return p


def add_calibrate_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "calibrate", help="fit the lab's iteration cost model to a llama.cpp model",
        description="Time a few plan shapes on a llama.cpp model and print the cost model "
                    "(iteration_overhead_us=..,prefill_token_us=..,decode_batch_us=..,"
                    "decode_sequence_us=..) that the lab's --cost-model option accepts.")
    _add_model_options(p)
    p.add_argument("--repeats", type=_positive_int, default=7,
                   help="timed runs per plan shape; the median is fitted (7)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="time plans by elapsed time (default) or by process CPU time, "
                        "which load from other processes does not inflate")
    p.add_argument("--json", metavar="FILE", help="also write the shapes and timings here")
    p.set_defaults(func=calibrate_command)
    return p


def _import_host():
    try:
        from skippy_scheduler.hosts import llama
    except ImportError as exc:
        raise CommandError(
            f"llama.cpp is not available ({exc}); "
            "install it with: pip install 'skippy-scheduler[llama]'") from None
    return llama


@contextlib.contextmanager
def _model_path(args):
    if args.model:
        if not os.path.isfile(args.model):
            raise CommandError(f"model file not found: {args.model}")
        yield args.model
        return
    try:
        from skippy_scheduler.hosts.tiny_model import write_tiny_llama
        import gguf  # noqa: F401 - the writer needs it; fail here with a clear message
    except ImportError as exc:
        raise CommandError(
            f"the default tiny model needs the gguf package ({exc}); pass --model or "
            "install it with: pip install 'skippy-scheduler[llama]'") from None
    with tempfile.TemporaryDirectory(prefix="skippy-tiny-") as tmp:
        yield write_tiny_llama(os.path.join(tmp, "tiny-llama-f32.gguf"), seed=args.seed)


def load_prompts(path: str | None) -> list:
    if path is None:
        return list(BUILTIN_PROMPTS)
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, json.JSONDecodeError) as exc:
        raise CommandError(f"cannot read prompts from {path}: {exc}") from None
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


def _make_scheduler(kind: str, **config):
    from skippy_scheduler import Scheduler, SchedulerConfig, TwinScheduler

    cls = Scheduler if kind == "native" else TwinScheduler
    return cls(SchedulerConfig(**config))


def _ctx_per_sequence(need: int) -> int:
    # llama.cpp pads each sequence's KV stream to a multiple of 256 cells.
    return max(256, -(-need // 256) * 256)


def run_command(args) -> int:
    llama = _import_host()
    from skippy_scheduler.hosts.serve import ServeRequest, serve

    if args.max_active > 256:
        raise CommandError("--max-active must be <= 256 (llama.cpp's sequence ids)")
    prompts = load_prompts(args.prompts)
    with _model_path(args) as model:
        probe_need = args.max_tokens + max(
            (len(p) if isinstance(p, list) else len(p.encode()) + 2) for p in prompts)
        n_seq = args.max_active
        n_batch = args.max_tokens_per_iteration
        with llama.LlamaHost(
            model, n_ctx=n_seq * _ctx_per_sequence(probe_need), n_seq_max=n_seq,
            n_threads=args.threads, n_batch=n_batch, kv_type=args.kv_type,
            flash_attn=args.flash_attn,
        ) as host:
            token_prompts = _tokenize_prompts(host, prompts)
            config = dict(
                max_active_sequences=n_seq, max_tokens_per_iteration=n_batch,
                prefill_chunk_tokens=min(args.prefill_chunk, n_batch),
                mixed_prefill_decode=args.mixed,
            )
            if args.max_consecutive_prefill is not None:
                config["max_consecutive_prefill_iterations"] = args.max_consecutive_prefill
            scheduler = _make_scheduler(args.scheduler, **config)
            interval = args.arrival_interval_ms / 1e3
            requests = [
                ServeRequest(f"request-{i}", toks, args.max_tokens, arrival_s=i * interval)
                for i, toks in enumerate(token_prompts)
            ]
            report = serve(scheduler, host, requests, clock="wall")
            settings = dict(host.settings, scheduler=args.scheduler, max_tokens=args.max_tokens,
                            arrival_interval_ms=args.arrival_interval_ms, **config)
    summary = report.summary()
    doc = {
        "model": args.model or f"tiny-random-llama (seed {args.seed}, f32)",
        "settings": settings,
        "requests": [r.to_json() for r in report.results],
        "summary": summary,
    }
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(doc, fh, indent=2)
            fh.write("\n")
    _print_run(doc)
    return 0


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


def calibrate_command(args) -> int:
    llama = _import_host()
    from skippy_scheduler.hosts.calibrate import calibrate_host

    with _model_path(args) as model:
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
