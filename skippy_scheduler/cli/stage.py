"""`skippy-scheduler stage`: serve one stage file as a stage worker (docs/stages.md).

The worker listens on a pyzmq address (`tcp://HOST:PORT` or `ipc://PATH`) until the driver
(`run --stage-addresses ...`) configures it and sends plans; it runs until it is stopped
(SIGTERM, Ctrl-C) or, started by a driver with `--parent-pid`, until that driver is gone.
"""
from __future__ import annotations

import argparse
import contextlib
import signal
import sys
from typing import Any, Optional

from ._common import CommandError, check_gguf, check_model_file, positive_int, thread_count
from .vocabulary import add_flag


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "stage", help="serve one stage of a split model (a stage worker)",
        usage="%(prog)s -m STAGE.gguf --listen ADDR [-t N] [--max-batch-tokens N]",
        description="Run one stage file (from `split`) as a worker that takes plans and "
                    "activations over pyzmq and passes its own on.")
    add_flag(p, "model", note="a stage-K.gguf file written by split", required=True)
    p.add_argument("--listen", metavar="ADDR", required=True, type=listen_address,
                   help="pyzmq address to bind, e.g. tcp://127.0.0.1:5601 (a port of * "
                        "takes a free one, printed at start) or ipc:///tmp/s0")
    add_flag(p, "threads", type=thread_count, default_text="what the driver asks")
    from ..hosts.stages.wire import DEFAULT_MAX_BATCH_TOKENS  # (no llama.cpp needed)

    p.add_argument("--max-batch-tokens", type=positive_int, default=DEFAULT_MAX_BATCH_TOKENS,
                   metavar="N",
                   help="the most tokens a plan may carry: a driver asking a larger batch "
                        "(-b) is refused, and with the stage's embedding width it bounds every "
                        "message the worker takes; a larger one drops its sender's connection "
                        f"(default: {DEFAULT_MAX_BATCH_TOKENS})")
    from .offload import add_offload_options

    add_offload_options(p)
    p.add_argument("--parent-pid", type=positive_int, metavar="PID",
                   help="exit when process PID is no longer this worker's parent (what a "
                        "driver that starts its own workers passes; default: run until told)")
    p.set_defaults(func=run)


def add_stage_cache_flag(p: Any) -> None:
    """`--stage-prefix-cache-tokens N,N,...` of `run` and `serve` with stages."""
    p.add_argument("--stage-prefix-cache-tokens", type=_capacities, default=(),
                   metavar="N,N,...",
                   help="with stages: the tokens of prefixes each stage keeps, stage 0 first, "
                        "each at most --prefix-cache-tokens; only what every stage keeps is "
                        "restored (default: --prefix-cache-tokens on every stage)")


def check_stage_cache_flag(args: argparse.Namespace,
                           prefix_cache_tokens: Optional[int] = None) -> None:
    """`--stage-prefix-cache-tokens` only with stages and prefix reuse (before anything starts;
    the host checks the count against the stages). `prefix_cache_tokens`: the store's size
    when the command sized it (serve's default), else `--prefix-cache-tokens`."""
    caps = args.stage_prefix_cache_tokens
    if not caps:
        return
    if not (args.stages or args.stage_addresses):
        raise CommandError("--stage-prefix-cache-tokens needs --stages or --stage-addresses")
    tokens = args.prefix_cache_tokens if prefix_cache_tokens is None else prefix_cache_tokens
    if not tokens or max(caps) > tokens:
        raise CommandError(f"--stage-prefix-cache-tokens: each stage keeps at most "
                           f"--prefix-cache-tokens ({tokens}), which sizes every stage's "
                           f"context")


def stage_directory(text: str) -> str:
    """`--stages DIR`: a directory's name (an empty one would mean no stages, silently)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("expected the directory of stage-K.gguf files "
                                         "written by split")
    return text


def listen_address(text: str) -> str:
    """`stage --listen`: tcp://HOST:PORT (PORT 1-65535, or * for a free one) or ipc://PATH
    (pyzmq would take a port past 65535 modulo 65536, a worker no driver finds)."""
    a = text.strip()
    scheme, sep, rest = a.partition("://")
    if sep and scheme == "ipc" and rest:
        return a
    if sep and scheme == "tcp":
        host, colon, port = rest.rpartition(":")
        if colon and host and (port == "*" or (port.isdigit() and 0 < int(port) < 65536)):
            return a
    raise argparse.ArgumentTypeError(f"expected tcp://HOST:PORT (a port 1-65535, or *) or "
                                     f"ipc://PATH, got {text!r}")


def stage_addresses(text: str) -> tuple[str, ...]:
    """`--stage-addresses`: the stage workers' pyzmq addresses (`stage --listen`), stage 0
    first, each a tcp:// or ipc:// address."""
    addresses = tuple(a.strip() for a in text.split(",") if a.strip())
    if not addresses:
        raise argparse.ArgumentTypeError("expected pyzmq addresses separated by commas, such "
                                         "as tcp://127.0.0.1:5600,tcp://127.0.0.1:5601")
    for a in addresses:
        scheme, sep, rest = a.partition("://")
        if not sep or scheme not in ("tcp", "ipc") or not rest:
            raise argparse.ArgumentTypeError(
                f"{a!r} is not a stage worker's address: expected tcp://HOST:PORT or "
                f"ipc://PATH, as given to `stage --listen`")
        if scheme == "tcp":
            host, colon, port = rest.rpartition(":")
            if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise argparse.ArgumentTypeError(
                    f"{a!r} is not a stage worker's address: expected tcp://HOST:PORT")
    return addresses


def _capacities(text: str) -> tuple[int, ...]:
    try:
        caps = tuple(int(x) for x in text.split(","))
    except ValueError:
        caps = ()
    if not caps or min(caps) < 1:
        raise argparse.ArgumentTypeError(f"expected positive token counts separated by "
                                         f"commas, got {text!r}")
    return caps


def require_stage_packages(command: str, *modules: str) -> None:
    """Import the optional packages a stage command needs, or say how to install them."""
    import importlib

    for name in modules or ("gguf", "zmq", "llama_cpp"):
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise CommandError(f"{command} needs {name} ({exc}); install it from the "
                               "checkout with: pip install '.[llama]'") from None


def run(args: argparse.Namespace) -> int:
    check_gguf("--model", args.model)
    require_stage_packages("stage")
    check_model_file("--model", args.model)
    import zmq

    from ..hosts.stages.split import SplitError
    from ..hosts.stages.worker import StageWorker

    if args.rpc:  # refused now, not when the driver first opens the stage
        from ..hosts.llama.backend import add_rpc_servers
        from ..hosts.offload import RpcError

        try:
            add_rpc_servers(args.rpc)
        except RpcError as exc:
            raise CommandError(str(exc)) from None
    try:
        from .offload import offload_spec

        worker = StageWorker(args.model, args.listen, n_threads=args.threads,
                             parent_pid=args.parent_pid, offload=offload_spec(args),
                             max_batch_tokens=args.max_batch_tokens)
    except SplitError as exc:
        raise CommandError(str(exc)) from None
    except zmq.ZMQError as exc:
        raise CommandError(f"--listen: cannot bind {args.listen}: {exc}") from None
    # SIGTERM ends the loop like Ctrl-C does.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print(f"stage {worker.info.index} of {worker.info.count} (layers {worker.info.layer_start}-"
          f"{worker.info.layer_end - 1}) listening on {worker.address}", file=sys.stderr,
          flush=True)
    try:
        worker.serve()
    except KeyboardInterrupt:
        pass
    finally:
        worker.close()
    return 0


def run_staged(args: argparse.Namespace, prompts: list[Any], n_seq: int, n_batch: int,
               lane: int, finishing: Optional[contextlib.ExitStack] = None) -> Any:
    """`run --stages DIR` / `run --stage-addresses ...`: the same run on stage workers, on the
    stage host `serve` opens too (hosts/stages/opening.py: every stage context holds the
    lanes' `n_seq` x `lane` cells plus the prefix holders' cells).

    Local workers are started (and stopped) here; the model given with --model, if any, must be
    the one the stages were cut from. `finishing`: as `serve_prompts`'s (so the workers are
    stopped with the signals ignored once the run has ended).
    """
    from .run import serve_prompts

    if args.stages and args.stage_addresses:
        raise CommandError("give --stages or --stage-addresses, not both")
    if not args.stages and not args.model:
        raise CommandError("--stage-addresses needs --model: the model the stages were cut "
                           "from (its vocabulary tokenizes the prompts)")
    if args.model:  # the model the stages were cut from: a whole one
        check_model_file("--model", args.model, allow_stage=False)
    require_stage_packages("run --stages")
    from ..hosts.stages.host import StageFailure
    from ..hosts.stages.holders import StageCapacityError
    from ..hosts.stages.opening import open_stage_host
    from ..hosts.stages.split import SplitError, stage_paths

    from ._common import stage_worker_args

    addresses = list(args.stage_addresses or ())
    try:
        stage_args = (stage_worker_args(args, len(stage_paths(args.stages)))
                      if args.stages else ())
        host = open_stage_host(
            stages=args.stages, stage_addresses=addresses, model=args.model,
            ctx_size=n_seq * lane, n_seq_max=n_seq, n_batch=n_batch,
            n_threads=args.threads, kv_type=args.kv_type or "f32",
            flash_attn=args.flash_attn == "on", prefix_cache_tokens=args.prefix_cache_tokens,
            prefix_holders=args.prefix_holders, pipeline_depth=args.inflight,
            stage_prefix_cache_tokens=args.stage_prefix_cache_tokens or (),
            stage_args=stage_args)
        with host:
            return _with_failure(host, serve_prompts(args, host, prompts, n_seq, n_batch,
                                                     lane, finishing=finishing))
    except (SplitError, StageFailure) as exc:
        raise CommandError(str(exc)) from None
    except StageCapacityError as exc:
        raise CommandError(f"--stage-prefix-cache-tokens: {exc}") from None


def _with_failure(host: Any, result: Any) -> Any:
    """The run's result with, in its summary, why the stages broke (None if they did not)."""
    result[3]["stage_failure"] = host.broken
    return result
