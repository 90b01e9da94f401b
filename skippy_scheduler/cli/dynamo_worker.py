"""`skippy-scheduler dynamo-worker`: serve a GGUF as an NVIDIA Dynamo backend.

The engine runs in this process (skippy_scheduler/dynamo/worker.py): Dynamo's frontend
(`python -m dynamo.frontend`) finds it through Dynamo's discovery, sends it token-id requests
and routes on its KV events. Without `--model-path` the Hugging Face folder Dynamo's frontend
tokenizes with is exported from the GGUF first, into a folder of the cache named by its contents
(kept, so every replica of one model registers the same path), and the worker refuses to start
when that tokenizer differs from llama.cpp's (export-hf-tokenizer). Needs the
`serve`, `llama` and `dynamo` extras (docs/fleet.md, "Dynamo", for the install).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import Any

from ._common import (LLAMA_MAX_SEQUENCES, CommandError, add_model_options, check_model,
                      import_llama_host, non_negative_int, positive_int)
from .offload import offload_spec
from .vocabulary import add_flag


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "dynamo-worker", help="serve a llama.cpp model as an NVIDIA Dynamo backend",
        usage="%(prog)s [-m GGUF] [--model-path DIR] [--served-model-name NAME] [OPTIONS]",
        description="Run the scheduler and llama.cpp in this process as a Dynamo worker: it "
                    "registers the model with Dynamo's discovery (file-based by default: no "
                    "etcd or NATS), takes token-id requests from Dynamo's frontend, streams "
                    "token ids back, publishes the prefix store's KV events for Dynamo's KV "
                    "router and reports its load. Start `python -m dynamo.frontend "
                    "--discovery-backend file` beside it (docs/fleet.md).")
    add_model_options(p)
    p.add_argument("--model-path", metavar="DIR", default=None,
                   help="the Hugging Face folder Dynamo's frontend tokenizes with (default: "
                        "exported from the GGUF into dynamo-hf/ under $SKIPPY_SCHEDULER_CACHE "
                        "(else ~/.cache/skippy-scheduler), in a folder named by its contents "
                        "and kept, and checked against llama.cpp's tokenizer, as "
                        "export-hf-tokenizer does)")
    add_flag(p, "served-model-name", default_text="the model file's name")
    g = p.add_argument_group("dynamo")
    g.add_argument("--namespace", default=os.environ.get("DYN_NAMESPACE", "dynamo"),
                   help="Dynamo namespace (default: $DYN_NAMESPACE or dynamo)")
    g.add_argument("--component", default="backend", help="component name (default: backend)")
    g.add_argument("--endpoint", default="generate", help="endpoint name (default: generate)")
    g.add_argument("--discovery-backend", choices=("file", "etcd", "kubernetes", "mem"),
                   default=os.environ.get("DYN_DISCOVERY_BACKEND", "file"),
                   help="Dynamo discovery; file keeps it in $DYN_FILE_KV (default: "
                        "$DYN_DISCOVERY_BACKEND or file)")
    g.add_argument("--request-plane", choices=("tcp", "nats"),
                   default=os.environ.get("DYN_REQUEST_PLANE", "tcp"),
                   help="(default: $DYN_REQUEST_PLANE or tcp)")
    g.add_argument("--event-plane", choices=("zmq", "nats"),
                   default=os.environ.get("DYN_EVENT_PLANE", "zmq"),
                   help="where KV events and load go (default: $DYN_EVENT_PLANE or zmq)")
    g.add_argument("--no-add-bos", action="store_true",
                   help="pass Dynamo's token ids as they come (default: put the model's BOS in "
                        "front of a prompt that lacks it when the model adds one, as serve's "
                        "tokenizer does)")
    e = p.add_argument_group("engine")
    add_flag(e, "max-active", type=positive_int, default=8)
    e.add_argument("--max-waiting", type=positive_int, default=256, metavar="N",
                   help="waiting-queue size; beyond it Dynamo gets an error (default: 256)")
    add_flag(e, "ctx-size", type=positive_int, default=None,
             default_text="the model's training context (at least 256 tokens a lane), capped "
                          "by what fits")
    add_flag(e, "prefix-cache-tokens", type=non_negative_int, default=None,
             default_text="sized from the KV cache, as serve's")
    add_flag(e, "prefix-holders", type=positive_int, default=None,
             default_text="one per lane, as serve's")
    e.add_argument("--kv-block-size", type=positive_int, default=16, metavar="N",
                   help="tokens per KV event block; registered with Dynamo as the KV block "
                        "size (default: 16)")
    e.add_argument("--kv-events-endpoint", metavar="ADDR", default=None,
                   help="publish the prefix store's blocks as vLLM-format KV cache events on "
                        "a ZeroMQ PUB socket bound here, e.g. tcp://127.0.0.1:5557; as serve "
                        "does, BOS included, for routers other than Dynamo's (default: none; "
                        "Dynamo's relay reads a stream of its own on a free loopback port, "
                        "the blocks as its frontend counts them)")
    e.add_argument("--routing-events-endpoint", metavar="ADDR", default=None,
                   help="where the stream Dynamo's relay reads is bound (default: a free "
                        "loopback TCP port)")
    e.add_argument("--stats-file", metavar="PATH", default=None,
                   help="rewrite the engine's counters (prompt tokens restored from the prefix "
                        "store and prefilled, requests) as JSON here every 0.5 s and at exit "
                        "(bench/dynamo_fleet.py reads it)")
    p.set_defaults(func=run, own_signals=True)


def cache_root() -> str:
    """Where exported folders are kept: $SKIPPY_SCHEDULER_CACHE, else the user's cache."""
    root = os.environ.get("SKIPPY_SCHEDULER_CACHE")
    if not root:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"),
                                                                ".cache")
        root = os.path.join(base, "skippy-scheduler")
    return os.path.join(root, "dynamo-hf")


def _shared_folder(written: str, name: str) -> str:
    """The exported folder moved to a path named by its contents, so every replica of one
    model registers the same path (Dynamo refuses a replica whose model card differs from the
    first one's, and the card holds the folder's path)."""
    import hashlib
    import shutil

    digest = hashlib.sha256()
    for entry in sorted(os.listdir(written)):
        with open(os.path.join(written, entry), "rb") as f:
            digest.update(entry.encode() + b"\0" + f.read())
    target = os.path.join(cache_root(), f"{name}-{digest.hexdigest()[:16]}")
    if not os.path.isdir(target):
        os.makedirs(os.path.dirname(target), exist_ok=True)
        try:
            os.replace(written, target)
        except OSError:  # another replica put it there first
            if not os.path.isdir(target):
                raise
    shutil.rmtree(written, ignore_errors=True)
    return target


def _import_dynamo() -> Any:
    try:
        from ..dynamo import worker
    except ImportError as exc:
        raise CommandError(f"Dynamo is not available ({exc}); install it as docs/fleet.md "
                           "says: pip install --no-deps ai-dynamo==1.6.1, then "
                           "pip install '.[dynamo,serve,llama]' (a plain pip install "
                           "ai-dynamo fails on Python 3.11+)") from None
    return worker


def run(args: argparse.Namespace) -> int:
    names = args.served_model_name
    if isinstance(names, str):
        names = tuple(n.strip() for n in names.split(",") if n.strip())
    if names and len(names) > 1:
        raise CommandError(f"--served-model-name: a Dynamo worker registers one name (Dynamo "
                           f"1.6's backend takes no aliases), got {len(names)}: "
                           f"{', '.join(names)}")
    holders = args.max_active if args.prefix_holders is None else args.prefix_holders
    if args.max_active + holders > LLAMA_MAX_SEQUENCES:
        raise CommandError(f"--max-active + --prefix-holders must be <= {LLAMA_MAX_SEQUENCES}")
    if args.ctx_size is not None and args.ctx_size // args.max_active < 256:
        raise CommandError(f"--ctx-size {args.ctx_size} over --max-active {args.max_active} "
                           "lanes leaves a lane fewer than 256 tokens")
    if args.prefix_cache_tokens == 0:
        raise CommandError("--prefix-cache-tokens 0 turns off the prefix store, whose KV "
                           "events Dynamo's KV router reads; give a size, or leave it out")
    check_model(args)
    import_llama_host()
    worker = _import_dynamo()
    from ..serve.server import ServeSettings

    tmp = tempfile.TemporaryDirectory(prefix="skippy-dynamo-")
    try:
        model = args.model
        if model is None:
            from ..hosts.tiny_model import write_tiny_llama

            model = write_tiny_llama(os.path.join(tmp.name, "tiny-random-llama.gguf"),
                                     seed=args.seed)
        name = names[0] if names else os.path.splitext(os.path.basename(model))[0]
        folder = args.model_path
        if folder is None:
            from ..dynamo.hf_export import ExportMismatch, UnsupportedTokenizer, export_folder
            from ..hosts.offload import ModelFileError

            try:
                exported = export_folder(model, os.path.join(tmp.name, "hf"))
            except ModelFileError as exc:  # a damaged file, or one stage of a split model
                raise CommandError(f"--model: {exc}") from None
            except (ExportMismatch, UnsupportedTokenizer) as exc:
                raise CommandError(f"{exc}; give a Hugging Face folder with --model-path"
                                   ) from None
            folder = _shared_folder(exported.folder, name)
            print(f"skippy-scheduler dynamo-worker: tokenizer folder {folder} "
                  f"({exported.check.line()})", file=sys.stderr, flush=True)
        elif not os.path.isfile(os.path.join(folder, "tokenizer.json")):
            raise CommandError(f"--model-path: {folder} has no tokenizer.json")
        serve_settings = ServeSettings(
            model=model, model_name=name, seed=args.seed, max_active=args.max_active,
            max_waiting=args.max_waiting, ctx_size=args.ctx_size, threads=args.threads,
            kv_type=args.kv_type, flash_attn=args.flash_attn, offload=offload_spec(args),
            prefix_cache_tokens=args.prefix_cache_tokens, prefix_holders=args.prefix_holders,
            kv_events_endpoint=args.kv_events_endpoint,
            kv_block_size=args.kv_block_size, log_level="warning")
        settings = worker.WorkerSettings(
            hf_folder=folder, served_model_name=name, namespace=args.namespace,
            component=args.component, endpoint=args.endpoint,
            discovery_backend=args.discovery_backend, request_plane=args.request_plane,
            event_plane=args.event_plane, add_bos=not args.no_add_bos,
            routing_events_endpoint=args.routing_events_endpoint, stats_file=args.stats_file)
        extra = (f", serve's KV events on {args.kv_events_endpoint}"
                 if args.kv_events_endpoint else "")
        print(f"skippy-scheduler dynamo-worker: {name} as {args.namespace}.{args.component}."
              f"{args.endpoint} ({args.discovery_backend} discovery, {args.request_plane} "
              f"requests{extra}); Ctrl-C stops",
              file=sys.stderr, flush=True)
        worker.run_worker(serve_settings, settings)
    finally:
        tmp.cleanup()
    return 0
