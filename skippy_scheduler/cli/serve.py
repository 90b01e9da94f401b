"""`skippy-scheduler serve`: an OpenAI-compatible HTTP server with continuous batching.

Without `--model` it serves the tiny random-weight model written to a temporary directory, so
it starts offline. Needs the `serve` and `llama` extras; both are imported only when the
command runs.
"""
from __future__ import annotations

import argparse
import socket
import sys
from typing import Any

from ..selection import DEFAULT_IMPLEMENTATION
from ._common import (LLAMA_MAX_SEQUENCES, CommandError, add_model_options, bound,
                      check_model,
                      import_llama_host, non_negative_int, non_negative_ms, positive_int,
                      plans_in_flight_count, positive_ms, refuse_rpc_with_stages)
from ..hosts.offload import CTX_FLOOR
from .offload import check_device_names, offload_spec, refuse_offload_with_stage_addresses
from .stage import (add_stage_cache_flag, check_stage_cache_flag, stage_addresses,
                    stage_directory)
from .vocabulary import add_flag


def register(subparsers: Any) -> None:
    from ..serve.server import PLANNING_RULES, ServeSettings

    d = ServeSettings()
    p = subparsers.add_parser(
        "serve", help="serve an OpenAI-compatible API on a llama.cpp model",
        usage="%(prog)s [-m GGUF] [--host HOST] [--port PORT] [OPTIONS]",
        description="Serve /v1/completions and /v1/chat/completions (streamed or not), "
                    "/v1/models, /health and /metrics, batching requests through the "
                    "scheduler on a llama.cpp model.")
    add_model_options(p, stages=True, backend_sampling=True, stage_ahead=True)
    add_flag(p, "served-model-name", type=_names, default_text="the model file's name",
             note="several names separated by commas, all listed by /v1/models: the first "
                  "names the model where one name is needed (/metrics, /props, the answer to "
                  "a request without 'model'); a request may give any (another is a 404)")
    p.add_argument("--host", default=d.host, help=f"address to listen on (default: {d.host})")
    p.add_argument("--port", type=_port, default=d.port, help=f"port (default: {d.port})")
    add_flag(p, "max-active", type=positive_int, default=d.max_active)
    p.add_argument("--max-waiting", type=positive_int, default=d.max_waiting, metavar="N",
                   help=f"waiting-queue size; beyond it requests get 503 "
                        f"(default: {d.max_waiting})")
    add_flag(p, "ctx-size", type=positive_int, default=d.ctx_size,
             default_text="the model's training context (at least 256 tokens a lane), capped "
                          "by what fits the devices (with --stages or --stage-addresses: at "
                          "most 4096, or 256 a lane; 4096 with --stage-addresses and no "
                          "--model)",
             note="a request's prompt plus max_tokens must fit its lane; a lane needs 256")
    add_flag(p, "batch-tokens", type=positive_int, default=d.batch_size,
             default_text="512 on the CPU, 2048 with layers on a GPU (llama-server's); 512 "
                          "with --stages or --stage-addresses",
             note="it follows the device where the layers go")
    add_flag(p, "prefill-chunk", type=positive_int, default=d.prefill_chunk)
    add_flag(p, "mixed", default=d.mixed)
    add_flag(p, "max-consecutive-prefill", type=bound,
             default=d.max_consecutive_prefill)
    add_flag(p, "planning-rule", default=d.planning_rule, choices=PLANNING_RULES)
    add_flag(p, "itl-target", type=positive_ms, default=d.itl_target_ms,
             note="the slack rule's; a request's \"skippy\": {\"itl_ms\": ...} overrides "
                  "it for that request")
    add_flag(p, "prefill-age-max", type=non_negative_ms, default=d.prefill_age_max_ms)
    add_flag(p, "policy", default=d.policy)
    add_flag(p, "scheduler", default=DEFAULT_IMPLEMENTATION)
    p.add_argument("--priority-preemption", action=argparse.BooleanOptionalAction,
                   default=d.priority_preemption,
                   help="a waiting request of higher priority preempts running requests of "
                        "lower priority when no lane or memory is free (their KV is kept as a "
                        "resident prefix with --prefix-cache-tokens, so they resume without "
                        "recomputing); --no-priority-preemption: priority only orders "
                        "admission (default: on)")
    add_flag(p, "prefix-cache-tokens", type=non_negative_int, default=d.prefix_cache_tokens,
             note="each holder gets a KV stream like a lane's",
             default_text="sized from the KV cache: a lane's tokens (--ctx-size / --max-active) "
                          "per holder")
    add_flag(p, "prefix-holders", type=positive_int, default=d.prefix_holders,
             default_text="one per lane (--max-active), as many as llama.cpp's 256 sequence "
                          "ids leave")
    p.add_argument("--cold-prefix-hold", action=argparse.BooleanOptionalAction,
                   default=d.cold_prefix_hold,
                   help="with prefix reuse, a request sharing at least 64 prompt tokens with "
                        "a running request's uncached prompt waits until that prompt is "
                        "resident and restores it, so a burst prefills a shared prefix once "
                        "(default: on)")
    p.add_argument("--first-token-hold", action=argparse.BooleanOptionalAction,
                   default=d.first_token_hold,
                   help="under the slack rule, while the waiting prefill is pressed for its "
                        "first-token deadlines (an SLO's TTFT, or 'skippy.ttft_ms'), a prompt "
                        "far from its own deadline keeps its last token back until near it, so "
                        "its decode rows do not slow the others' prefill (default: on; only "
                        "requests with a deadline are held)")
    add_flag(p, "inflight", type=plans_in_flight_count, default=d.inflight,
             note="llama_decode runs on a worker thread",
             default_text="2 with layers on a GPU, 1 on the CPU")
    p.add_argument("--strict-request-fields", action="store_true",
                   help="refuse request fields nobody defined with a 400 (default: ignore "
                        "them with a logged warning, as vLLM does)")
    p.add_argument("--kv-events-endpoint", metavar="ADDR",
                   help="publish the prefix store's blocks as vLLM-format KV cache events on "
                        "a ZeroMQ PUB socket bound here, e.g. tcp://127.0.0.1:5557; needs "
                        "prefix reuse (on unless --prefix-cache-tokens 0; docs/fleet.md)")
    p.add_argument("--kv-events-replay-endpoint", metavar="ADDR",
                   help="ZeroMQ ROUTER address answering KV event replay requests")
    p.add_argument("--kv-block-size", type=positive_int, default=d.kv_block_size, metavar="N",
                   help=f"tokens per KV event block; a router's --kv-event-block-size "
                        f"(default: {d.kv_block_size})")
    p.add_argument("--kv-hash-seed", default=d.kv_hash_seed, metavar="SEED",
                   help="seed of the block hash chain, as vLLM's PYTHONHASHSEED "
                        f"(default: {d.kv_hash_seed!r})")
    p.add_argument("--step-log", metavar="FILE",
                   help="write one JSON line per engine iteration to FILE: its wall time, the "
                        "time in planning, in the host's execution, waiting on it, in events "
                        "and in completing, and the plan's shape (docs/measuring.md; default: "
                        "none)")
    p.add_argument("--cost-warmup", action="store_true",
                   help="before listening, run a burst of random prompts through the model (one "
                        "per lane, up to 16, of 16 to 768 tokens, 16 tokens out each) and start "
                        "the slack rule's cost model from those steps instead of its generic "
                        "guess (docs/serving.md; staged serving does not warm up; default: off)")
    p.add_argument("--log-level", choices=("critical", "error", "warning", "info", "debug"),
                   default=d.log_level, help=f"uvicorn log level (default: {d.log_level})")
    p.add_argument("--stages", type=stage_directory, metavar="DIR",
                   help="stages of a split model; here the directory of stage-K.gguf files "
                        "written by split, served by one local stage worker process each; "
                        "--model, if given, must be the model they were cut from (default: no "
                        "stages)")
    p.add_argument("--stage-addresses", type=stage_addresses, default=(), metavar="ADDR,...",
                   help="serve on stage workers already running at these pyzmq addresses "
                        "(`stage --listen`), stage 0 first; needs --model (default: none)")
    add_stage_cache_flag(p)
    _add_slo_options(p, d)
    _add_limit_options(p, d)
    _add_access_options(p, d)
    # serve drains and cleans up on SIGINT and SIGTERM itself.
    p.set_defaults(func=run, own_signals=True)


def _add_slo_options(p: Any, d: Any) -> None:
    """The SLO the server is told (skippy_scheduler/serve/slo.py, docs/serving.md)."""
    g = p.add_argument_group("SLO")
    g.add_argument("--slo-ttft-ms", type=positive_ms, default=d.slo_ttft_ms, metavar="MS",
                   help="time-to-first-token budget of every request, from its arrival: its "
                        "first-token deadline in the scheduler; a request's \"skippy\": "
                        "{\"ttft_ms\": ...} overrides it (default: none)")
    g.add_argument("--slo-itl-ms", type=positive_ms, default=d.slo_itl_ms, metavar="MS",
                   help="inter-token budget of every request (every gap): the slack rule "
                        "plans each request to 3/4 of it instead of --itl-target-ms; a request's "
                        "\"skippy\": {\"itl_ms\": ...} overrides it (default: none)")
    g.add_argument("--slo-shed", action="store_true", default=d.slo_shed,
                   help="answer 503 with Retry-After, before any work, to a request whose "
                        "first token the fitted cost model predicts past its TTFT budget "
                        "(--slo-ttft-ms or its own skippy.ttft_ms) in the slack rule's "
                        "prefill order, or that would push an admitted request past a "
                        "deadline the order keeps (the slack rule only; default: off)")


def _add_limit_options(p: Any, d: Any) -> None:
    """What one client may take, and how long shutting down may last (docs/reliability.md)."""
    g = p.add_argument_group("limits")
    g.add_argument("--max-body-bytes", type=positive_int, default=d.max_body_bytes, metavar="N",
                   help=f"largest request body; larger ones get 413 (default: {d.max_body_bytes})")
    g.add_argument("--header-timeout", type=_seconds, default=d.header_timeout_s, metavar="S",
                   help="seconds a request's head may take to arrive before the server answers "
                        f"408 and closes the connection (default: {d.header_timeout_s:g})")
    g.add_argument("--body-timeout", type=_seconds, default=d.body_timeout_s, metavar="S",
                   help=f"seconds a request's body may take to arrive (408, closed) "
                        f"(default: {d.body_timeout_s:g})")
    g.add_argument("--max-connections", type=positive_int, default=d.max_connections,
                   metavar="N", help="open connections; fewer when the descriptor limit "
                                     f"requires (default: {d.max_connections})")
    g.add_argument("--shutdown-timeout", type=_seconds, default=d.shutdown_timeout_s,
                   metavar="S", help="on SIGTERM or Ctrl-C, seconds running requests get to "
                                     "finish before they are ended "
                                     f"(default: {d.shutdown_timeout_s:g})")
    g.add_argument("--allowed-hosts", type=_hosts, default=None, metavar="NAMES",
                   help="Host header names answered, comma-separated ('*' any, '*.example.com' "
                        "a domain); default: loopback names when --host is a loopback address, "
                        "any otherwise")


def _add_access_options(p: Any, d: Any) -> None:
    """Who may call the server (skippy_scheduler/serve/access.py)."""
    from ..serve.access import API_KEY_ENV

    g = p.add_argument_group("access")
    g.add_argument("--api-key", type=_api_key, default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every request but those to "
                        f"--open-paths (401 otherwise); default: the {API_KEY_ENV} "
                        "environment variable, else no key")
    g.add_argument("--open-paths", type=_open_paths, default=d.open_paths, metavar="PATHS",
                   help="paths answered without the key, comma-separated, '' for none "
                        f"(default: {','.join(d.open_paths)})")
    g.add_argument("--allowed-origins", type=_origins, default=d.allowed_origins,
                   metavar="ORIGINS",
                   help="origins (https://host[:port]) whose browser requests may read the "
                        "answers (CORS), comma-separated, '*' any; default: none")


def _padded_or_empty(key: str) -> bool:
    """A key no request could present (HTTP trims header values; an empty one admits only an
    empty bearer token)."""
    return not key.strip() or key != key.strip()


def _api_key(text: str) -> str:
    if _padded_or_empty(text):
        raise argparse.ArgumentTypeError(
            "expected a key without spaces around it (an empty key would admit only an empty "
            "bearer token); leave --api-key out to require no key")
    return text


def _access_settings(args: Any) -> dict[str, Any]:
    import os

    from ..serve.access import API_KEY_ENV

    key = args.api_key
    if key is None and API_KEY_ENV in os.environ:
        # Set and empty is most often a secret that did not arrive: refused, not an open
        # server (unset it to require no key).
        value = os.environ[API_KEY_ENV]
        if _padded_or_empty(value):
            what = "empty" if not value.strip() else "set with spaces around the key"
            raise CommandError(f"{API_KEY_ENV} is {what}: give a key without spaces around "
                               "it, or unset it to require no key")
        key = value
    names = args.served_model_name or ()
    return dict(model_name=names[0] if names else None, model_aliases=tuple(names[1:]),
                api_key=key, open_paths=args.open_paths, allowed_origins=args.allowed_origins)


def _names(text: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    if not names:
        raise argparse.ArgumentTypeError("expected model names separated by commas")
    return names


def _open_paths(text: str) -> tuple[str, ...]:
    from ..serve.access import parse_paths

    try:
        return parse_paths(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _origins(text: str) -> tuple[str, ...]:
    from ..serve.access import parse_origins

    try:
        return parse_origins(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _limit_settings(args: Any) -> dict[str, Any]:
    return dict(max_body_bytes=args.max_body_bytes, header_timeout_s=args.header_timeout,
                body_timeout_s=args.body_timeout, max_connections=args.max_connections,
                shutdown_timeout_s=args.shutdown_timeout,
                allowed_hosts=args.allowed_hosts)


def _seconds(text: str) -> float:
    import argparse
    import math

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {text}")
    return value


def _hosts(text: str) -> tuple[str, ...]:
    import argparse

    from ..serve.guard import parse_allowed_hosts

    try:
        return parse_allowed_hosts(text) or ("*",)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port in [0, 65535], got {value}")
    return value


def _check_stage_args(args: argparse.Namespace) -> None:
    """`--stages` / `--stage-addresses`: refused before anything starts when they cannot work."""
    import os

    from .stage import require_stage_packages

    if args.stages and args.stage_addresses:
        raise CommandError("give --stages or --stage-addresses, not both")
    if args.stage_addresses and not args.model:
        raise CommandError("--stage-addresses needs --model: the model the stages were cut "
                           "from (its vocabulary tokenizes the prompts)")
    if args.stages and not os.path.isdir(args.stages):
        raise CommandError(f"--stages: not a directory: {args.stages}")
    if args.model:  # the model the stages were cut from: a whole one
        from ._common import check_model_file

        check_model_file("--model", args.model, allow_stage=False)
    require_stage_packages("serve --stages")


def _import_serve() -> tuple[Any, Any]:
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise CommandError(f"the server's packages are missing ({exc}); install them from "
                           "the checkout with: pip install '.[serve,llama]'") from None
    from ..serve.server import Server, ServeSettings

    return Server, ServeSettings


def _check_port(host: str, port: int) -> None:
    """Refuse an address another process listens on before the model is loaded, so the
    startup line is printed only for an address that was free (port 0 picks one itself)."""
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise CommandError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind(address)
        except OSError as exc:
            raise CommandError(f"cannot listen on {host}:{port}: {exc.strerror}") from None


def _stage_worker_args(args: argparse.Namespace) -> tuple[tuple[str, ...], ...]:
    """The offload flags of each local stage worker (`--stages`), --stage-devices applied."""
    if not args.stages:
        if args.stage_devices:
            raise CommandError("--stage-devices needs --stages (local stage workers)")
        return ()
    from ..hosts.stages.split import SplitError, stage_paths
    from ._common import stage_worker_args

    try:
        count = len(stage_paths(args.stages))
    except SplitError as exc:
        raise CommandError(f"--stages: {exc}") from None
    return tuple(tuple(a) for a in stage_worker_args(args, count))


def _reuse(args: argparse.Namespace) -> tuple[int, int]:
    """(prefix cache tokens, holders) as the server will size them (serve/server.py)."""
    from ..serve.server import default_reuse

    tokens, holders = default_reuse(args.max_active, args.ctx_size or CTX_FLOOR)
    if args.prefix_cache_tokens is not None:
        tokens = args.prefix_cache_tokens
    if args.prefix_holders is not None:
        holders = args.prefix_holders
    return tokens, holders


def run(args: argparse.Namespace) -> int:
    tokens, holders = _reuse(args)
    holders = holders if tokens else 0
    if args.max_active + holders > LLAMA_MAX_SEQUENCES:
        raise CommandError(f"--max-active (+ --prefix-holders with reuse) must be <= "
                           f"{LLAMA_MAX_SEQUENCES} (llama.cpp's sequence ids)")
    if args.ctx_size is not None and args.ctx_size < args.max_active:
        raise CommandError(f"--ctx-size ({args.ctx_size}) must be at least --max-active "
                           f"({args.max_active}): every lane needs KV cells")
    if args.ctx_size is not None and args.ctx_size // args.max_active < 256:
        raise CommandError(f"--ctx-size {args.ctx_size} over --max-active {args.max_active} "
                           f"lanes gives each lane {args.ctx_size // args.max_active} tokens; a "
                           f"lane needs at least 256 (give -c {256 * args.max_active} or more, "
                           "or fewer lanes with -np)")
    if args.slo_shed and args.planning_rule != "slack":
        raise CommandError("--slo-shed needs --planning-rule slack: the slack rule's fitted "
                           "step cost model predicts each request's first token")
    refuse_rpc_with_stages(args)
    refuse_offload_with_stage_addresses(args)
    if args.stages:
        check_device_names([*args.device, *(getattr(args, "stage_devices", ()) or ())])
    check_model(args)
    check_stage_cache_flag(args, tokens)
    if args.stages or args.stage_addresses:
        _check_stage_args(args)
    _check_port(args.host, args.port)
    import_llama_host()
    Server, ServeSettings = _import_serve()
    settings = ServeSettings(
        model=args.model, seed=args.seed, host=args.host,
        port=args.port, max_active=args.max_active, max_waiting=args.max_waiting,
        ctx_size=args.ctx_size, threads=args.threads, batch_size=args.max_num_batched_tokens,
        prefill_chunk=args.prefill_chunk, mixed=args.mixed,
        max_consecutive_prefill=args.max_consecutive_prefill, inflight=args.inflight,
        planning_rule=args.planning_rule, itl_target_ms=args.itl_target_ms,
        slo_ttft_ms=args.slo_ttft_ms, slo_itl_ms=args.slo_itl_ms, slo_shed=args.slo_shed,
        prefill_age_max_ms=args.prefill_age_max_ms,
        policy=args.policy, scheduler=args.scheduler,
        priority_preemption=args.priority_preemption,
        prefix_cache_tokens=args.prefix_cache_tokens,
        prefix_holders=args.prefix_holders, cold_prefix_hold=args.cold_prefix_hold,
        first_token_hold=args.first_token_hold,
        kv_type=args.kv_type, flash_attn=args.flash_attn, log_level=args.log_level,
        backend_sampling=args.backend_sampling, stage_ahead=args.stage_ahead,
        offload=offload_spec(args), stage_worker_args=_stage_worker_args(args),
        strict_request_fields=args.strict_request_fields,
        kv_events_endpoint=args.kv_events_endpoint,
        kv_events_replay_endpoint=args.kv_events_replay_endpoint,
        kv_block_size=args.kv_block_size, kv_hash_seed=args.kv_hash_seed,
        stages=args.stages, stage_addresses=args.stage_addresses,
        stage_prefix_cache_tokens=args.stage_prefix_cache_tokens, step_log=args.step_log,
        cost_warmup=args.cost_warmup,
        **_limit_settings(args), **_access_settings(args))
    try:
        server = Server(settings)
    except (OSError, RuntimeError, ValueError) as exc:
        raise CommandError(str(exc)) from None
    except KeyboardInterrupt:  # SIGINT or SIGTERM while loading: the server cleaned up
        return 0
    ctx, s = server.context, server.settings
    from ..serve.slo import planned_gap_ms

    # The target the slack rule plans to: under an ITL budget, its planned share.
    target = planned_gap_ms(s.slo_itl_ms) if s.slo_itl_ms is not None else s.itl_target_ms
    rule = (f"slack rule at {target:g} ms" if s.planning_rule == "slack"
            else "reference planning")
    slo = [f"{name} {value:g} ms" for name, value in (("TTFT", s.slo_ttft_ms),
                                                      ("gaps", s.slo_itl_ms))
           if value is not None]
    if slo:
        rule += f", SLO {' and '.join(slo)}"
    if s.slo_shed:
        rule += ", shedding"
    reuse = (f"prefix reuse of {s.prefix_cache_tokens} tokens in {s.prefix_holders} holders"
             if s.prefix_cache_tokens else "no prefix reuse")
    where = (f"{server.fitted.placement.line()}, " if server.fitted is not None
             else "layers on each stage's devices, ")
    host_settings = getattr(server.host, "settings", None)
    sampling = (", sampling on the device" if isinstance(host_settings, dict)
                and host_settings.get("backend_sampling") else "")
    auth = ", API key required" if server.settings.api_key else ""

    def announce(port: int) -> None:  # once the socket is bound (port 0: the one picked)
        print(f"skippy-scheduler serve: {ctx.model_name} on http://{args.host}:{port}/v1 "
              f"({where}{args.max_active} lanes of {ctx.n_ctx_seq} tokens{sampling}, {rule}, "
              f"{reuse}, chat template {ctx.chat.source}{auth}); Ctrl-C stops",
              file=sys.stderr, flush=True)
        if server.warmup is not None:
            print(f"skippy-scheduler serve: {server.warmup.describe()}", file=sys.stderr,
                  flush=True)

    try:
        server.serve(announce, exiting=True)
    except OSError as exc:  # e.g. the port is taken
        server.close()
        raise CommandError(f"cannot listen on {args.host}:{args.port}: {exc.strerror}") from None
    except KeyboardInterrupt:
        pass
    print("skippy-scheduler serve: stopped (engine, model and temporary files closed)",
          file=sys.stderr, flush=True)
    return 0
