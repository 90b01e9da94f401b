"""A whole server: the llama.cpp host, the scheduler, the engine thread, the app, uvicorn.

    server = Server(ServeSettings(model="m.gguf", max_active=16))
    server.serve()                    # blocks (what `skippy-scheduler serve` runs)

    url = server.start_in_thread()    # tests and embedding: returns "http://127.0.0.1:PORT"
    ...
    server.shutdown()

Lanes: `max_active` requests run at once, each in its own llama.cpp sequence with
`ctx_size / max_active` KV cells (llama.cpp's per-sequence KV streams); a request's prompt plus
`max_tokens` must fit one lane. Plans are bounded by `batch_size` tokens, prompts are prefilled
in chunks of `prefill_chunk` tokens. Under the slack rule (the default, docs/behaviour.md
§2.13) each step's prefill chunk is sized so the step fits the tightest running stream's
inter-token target (`itl_target_ms`), on a cost model fitted from the steps the engine timed;
under the reference rule, with `mixed` decode rows ride along with prefill chunks within the
reference's gate.

An SLO (docs/serving.md "An SLO: goodput and shedding", serve/slo.py): `slo_ttft_ms` gives every
request without a `"skippy.ttft_ms"` of its own that first-token deadline, `slo_itl_ms` makes
its gap the inter-token target the slack rule plans each request to (in place of
`itl_target_ms`), and `slo_shed` answers 503 to a request whose first token the fitted cost
model predicts past its budget. Without them, nothing changes.

Defaults (docs/serving.md "Defaults"): prefix reuse is on, sized from the KV cache by
`default_reuse` (one holder per lane, each keeping a lane's worth of tokens;
`prefix_cache_tokens=0` turns it off; on stages as on one process); one plan in flight.

Capacity: `max_active + max_waiting` requests may be open at once (running or queued); the
app refuses the next with a 503 before it reaches the engine, and the scheduler's own waiting
limit is set to that sum, because a burst reaches the scheduler's waiting queue whole before
the next plan moves any of it into a lane.

Limits and shutdown (docs/reliability.md, "The server"): bodies above `max_body_bytes` are a
413, a request head must arrive within `header_timeout_s` and a body within `body_timeout_s`,
at most `max_connections` connections are open (kept below the descriptor limit), and
`serve()` turns SIGINT and SIGTERM into a drain of at most `shutdown_timeout_s` after which the
engine, llama.cpp and the temporary model directory are closed and `serve()` returns; a second
signal skips the drain but not the closing.
"""
from __future__ import annotations

import contextlib
import gc
import logging
import os
import signal
import socket
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Union

from ..engine.contract import (InterruptibleHost, MemoryComponentsHost, ServingHost,
                               VocabularyHost)
from ..hosts.offload import CPU_BATCH, CTX_FLOOR, OffloadSpec
from ..selection import DEFAULT_IMPLEMENTATION, DEFAULT_POLICY, POLICIES, make_scheduler
from ..types import DEFAULT_SEQUENCE_ID_LIMIT
from . import kv_events
from .gc_pauses import freeze_startup_heap

if TYPE_CHECKING:  # pragma: no cover
    from ..engine.warmup import WarmUp
    from ..slack import StepCost
    from ..types import SchedulerConfig
    from .runner import EngineRunner

# NOTE: asyncio accepts up to `backlog` connections per wake-up of the listening socket, and a
# connection's protocol sees it (and can turn it away) only two loop turns later, a third turn
# before an evicted one's descriptor is freed: about four batches are in flight in a flood. Those
# descriptors are kept free, on top of a margin for everything else (model, engine, logs, the
# event loop's own). The kernel's queue of connections not yet accepted is set apart, larger.
ACCEPT_BATCH = 16
LISTEN_BACKLOG = 1024
FD_RESERVE = 4 * ACCEPT_BATCH + 32

log = logging.getLogger("skippy_scheduler.serve")


@dataclass
class ServeSettings:
    model: Optional[str] = None  # None: the tiny random-weight model, written to a temp dir
    model_name: Optional[str] = None  # the id /v1/models reports (default: the file's stem)
    model_aliases: tuple[str, ...] = ()  # further names requests may give (serve/access.py)
    api_key: Optional[str] = None  # needed as a Bearer token on all but open_paths
    open_paths: tuple[str, ...] = ("/health", "/metrics")  # answered without the key
    allowed_origins: tuple[str, ...] = ()  # CORS origins ("*": any); empty: no CORS
    seed: int = 0  # of the tiny model
    host: str = "127.0.0.1"
    port: int = 8000
    max_active: int = 8
    max_waiting: int = 256
    ctx_size: Optional[int] = None  # KV cells the lanes share; None: from the model (its
    #   training context, at least 256 tokens a lane, capped by what fits the devices:
    #   hosts/offload.py)
    threads: Optional[int] = None  # None: 2; with stages, the cores divided among them
    stage_worker_args: tuple[tuple[str, ...], ...] = ()  # per local stage: its offload flags
    batch_size: Optional[int] = None  # None: 512 on the CPU, 2048 with layers on a GPU
    ubatch_size: Optional[int] = None  # None: the batch on the CPU, 512 with layers on a GPU
    prefill_chunk: int = 256
    mixed: bool = True
    max_consecutive_prefill: Optional[int] = 1
    planning_rule: str = "slack"  # a name of PLANNING_RULES (docs/behaviour.md §2.13); under
    #   "slack", mixed and max_consecutive_prefill are not read
    itl_target_ms: float = 150.0  # the slack rule's inter-token target ("skippy.itl_ms" of a
    #   request overrides it for that request)
    slo_ttft_ms: Optional[float] = None  # the server-wide SLO (serve/slo.py): each request's
    #   first-token deadline from its arrival ("skippy.ttft_ms" of a request overrides it)
    slo_itl_ms: Optional[float] = None  # and its inter-token budget: the target the slack
    #   rule plans it to, instead of itl_target_ms ("skippy.itl_ms" overrides it)
    slo_shed: bool = False  # a 503 for a request the cost model predicts cannot make its TTFT
    #   budget (the slack rule's fitted model; serve/slo.py)
    prefill_age_max_ms: float = 2000.0  # > 0: the slack rule prefills the shortest prompt
    #   first, but one that arrived this long ago first of all; 0: arrival order (§2.13,
    #   docs/serving.md "The prefill order")
    inflight: Optional[int] = None  # plans in flight (max_inflight_plans): 2 overlaps
    #   scheduling with decode; None: 2 with layers on a GPU, 1 otherwise (`plans_in_flight`)
    policy: str = DEFAULT_POLICY  # a name of skippy_scheduler.selection.POLICIES
    scheduler: str = DEFAULT_IMPLEMENTATION  # native (the C core) or twin (the Python twin)
    priority_preemption: bool = True  # a waiting request of higher priority takes a lane from
    #   lower-priority running ones (docs/behaviour.md §2.8a); False: priority orders admission
    prefix_cache_tokens: Optional[int] = None  # tokens the prefix store keeps for reuse (0: off;
    #   None: sized from the KV cache, see default_reuse); each holder gets a KV stream of
    #   ctx_size / max_active cells on top of ctx_size
    prefix_holders: Optional[int] = None  # sequence ids holding resident prefixes (with reuse;
    #   None: one per lane, see default_reuse)
    first_token_hold: bool = True  # the slack rule's first-token hold (§2.13): under a burst
    #   pressed for its first-token deadlines, a prompt far from its own keeps its last token
    #   back until near it, so its decode rows do not slow the others' prefill
    cold_prefix_hold: bool = True  # with reuse: a request sharing a running one's cold prompt
    #   waits until that prompt is resident, then restores it (docs/behaviour.md §2.3a)
    kv_type: Optional[str] = None  # None: f32 on the CPU, f16 with layers on a GPU
    flash_attn: Union[bool, str, None] = None  # on/off/auto; None: off on the CPU, auto on a GPU
    backend_sampling: str = "auto"  # on/off/auto: sampling on the device (backend_sampling.py)
    stage_ahead: str = "auto"  # on/off/auto: stage the next plan while the device runs one
    #   (LlamaHost's stage_ahead; auto: on with layers on a GPU)
    offload: OffloadSpec = OffloadSpec()  # -ngl, -sm, -ts, -mg, -dev (docs/gpu.md)
    log_level: str = "info"  # uvicorn logs one line per request at info, as llama-server and vLLM do
    max_body_bytes: int = 8 << 20  # larger request bodies are a 413
    header_timeout_s: float = 10.0  # a request head must arrive within this (408, closed)
    body_timeout_s: float = 30.0  # a request body must arrive within this (408, closed)
    max_connections: int = 1024  # open connections (kept below the descriptor limit)
    shutdown_timeout_s: float = 5.0  # on SIGTERM / SIGINT, running requests get this long
    allowed_hosts: Optional[tuple[str, ...]] = None  # Host names answered; None: loopback
    #   names when bound to a loopback address, any otherwise; "*" in it: any
    strict_request_fields: bool = False  # refuse fields nobody defined (default: warn, ignore)
    kv_events_endpoint: Optional[str] = None  # ZeroMQ PUB address of vLLM-format KV events
    kv_events_replay_endpoint: Optional[str] = None  # ROUTER address answering replays
    kv_block_size: int = 16  # tokens per announced block
    kv_hash_seed: str = "0"  # vLLM's PYTHONHASHSEED: the first block's parent hash
    stages: Optional[str] = None  # a split model's stage directory: local stage workers
    stage_addresses: tuple[str, ...] = ()  # or stage workers already running (docs/stages.md)
    stage_prefix_cache_tokens: tuple[int, ...] = ()  # per stage; () = prefix_cache_tokens each
    step_log: Optional[str] = None  # a file of one JSON line per engine iteration (its times;
    #   docs/measuring.md "Where an iteration's time goes"); None: no log
    cost_warmup: bool = False  # under the slack rule, time a synthetic burst before serving and
    #   start from the cost model fitted to it (engine/warmup.py); staged serving does not warm up


PLANNING_RULES = ("slack", "reference")
MIN_LANE_TOKENS = 256  # a lane smaller than llama.cpp's KV padding serves next to nothing
LLAMA_SEQUENCE_IDS = 256  # llama.cpp's sequence ids: lanes plus prefix holders


def default_reuse(max_active: int, ctx_size: int) -> tuple[int, int]:
    """(prefix_cache_tokens, prefix_holders) when the settings leave them to the server: one
    holder per lane (as many as llama.cpp's sequence ids leave), each keeping what a lane holds
    (ctx_size / max_active tokens), so the store keeps as much KV as the lanes have: every
    finished request's prompt stays resident until as many others have finished. No holder
    left: (0, 1), reuse off."""
    holders = min(max_active, LLAMA_SEQUENCE_IDS - max_active)
    if holders < 1:
        return 0, 1
    return holders * (ctx_size // max_active), holders


def resolve_settings(settings: ServeSettings) -> ServeSettings:
    """`settings` with what was left to the server decided (reuse sized from the KV cache) and
    the planning settings checked (ValueError before anything is loaded)."""
    import dataclasses
    import math

    from .._validate import as_float

    s = settings
    if s.planning_rule not in PLANNING_RULES:
        raise ValueError(f"planning_rule must be one of {', '.join(PLANNING_RULES)}, got "
                         f"{s.planning_rule!r}")
    if isinstance(s.itl_target_ms, bool) or not isinstance(s.itl_target_ms, (int, float)) or \
            not (math.isfinite(as_float(s.itl_target_ms)) and s.itl_target_ms > 0):
        raise ValueError(f"itl_target_ms must be a finite number of ms > 0, got "
                         f"{s.itl_target_ms!r}")
    if isinstance(s.prefill_age_max_ms, bool) or \
            not isinstance(s.prefill_age_max_ms, (int, float)) or \
            not (math.isfinite(as_float(s.prefill_age_max_ms)) and s.prefill_age_max_ms >= 0):
        raise ValueError(f"prefill_age_max_ms must be a finite number of ms >= 0, got "
                         f"{s.prefill_age_max_ms!r}")
    from .slo import check_budget

    check_budget("slo_ttft_ms", s.slo_ttft_ms)
    check_budget("slo_itl_ms", s.slo_itl_ms)
    if s.slo_shed and s.planning_rule != "slack":
        raise ValueError("slo_shed needs the slack planning rule: its fitted step cost model "
                         "predicts the first token")
    if s.max_active < 1:
        raise ValueError(f"max_active must be at least 1, got {s.max_active}")
    if s.stage_ahead not in ("on", "off", "auto"):
        raise ValueError(f"stage_ahead must be on, off or auto, got {s.stage_ahead!r}")
    if (s.stages or s.stage_addresses) and (s.backend_sampling, s.stage_ahead) != ("auto",
                                                                                "auto"):
        raise ValueError("--backend-sampling and --stage-ahead are the llama.cpp host's; the "
                         "stage workers sample on the last stage and do not stage ahead: "
                         "leave them at auto with --stages or --stage-addresses")
    from ..types import MAX_INFLIGHT_PLANS

    if s.inflight is not None and (isinstance(s.inflight, bool) or
                                   not isinstance(s.inflight, int) or
                                   not 1 <= s.inflight <= MAX_INFLIGHT_PLANS):
        raise ValueError(f"inflight must be None or an integer in [1, {MAX_INFLIGHT_PLANS}], "
                         f"got {s.inflight!r}")
    tokens, holders = default_reuse(s.max_active, context_of(s))  # staged serving too
    return dataclasses.replace(
        s, prefix_cache_tokens=tokens if s.prefix_cache_tokens is None else s.prefix_cache_tokens,
        prefix_holders=holders if s.prefix_holders is None else s.prefix_holders)


def plans_in_flight(inflight: Optional[int], on_gpu: bool) -> int:
    """The plans in flight: `inflight` when given; else 2 when the model's layers run on a GPU
    (llama_decode then runs on the host's worker thread while the engine completes the previous
    step and plans the next, so a millisecond-long device step does not wait for the host), and
    1 on the CPU, where the decode and the host's work share the same cores and overlapping them
    pays nothing."""
    if inflight is not None:
        return inflight
    return 2 if on_gpu else 1


def context_of(s: ServeSettings) -> int:
    """The lanes' context of settings whose context was decided (`Server` fits it to the model
    and the devices first; a `ServeSettings` built by hand with ctx_size=None counts as the
    floor the fit starts from)."""
    return s.ctx_size if s.ctx_size is not None else CTX_FLOOR


def _staged_context(s: ServeSettings) -> int:
    """The default context of a model split across stages: its training context, each lane a
    whole share of 256 cells, as the unsplit server's default, but at most CTX_FLOOR tokens
    (or the lanes' 256 cells each, where that is more): the workers place their own layers, so
    nothing is fitted to a device, and a long-context model's full context could take more
    memory than a worker has. CTX_FLOOR where no model file is at hand to read the training
    context from (only --stage-addresses, no --model) or the file does not say."""
    from ..hosts.offload import ModelFileError, footprint_from_gguf
    from ..hosts.stages.split import SplitError, stage_paths

    try:
        path = s.model or (stage_paths(s.stages)[0] if s.stages else None)
        trained = footprint_from_gguf(path).n_ctx_train if path else 0
    except (ModelFileError, SplitError, OSError, ValueError):
        trained = 0  # (loading the stages says what is wrong with them)
    if trained <= 0:
        return CTX_FLOOR
    quantum = 256 * max(s.max_active, 1)
    return min(-(-max(trained, quantum) // quantum) * quantum, max(CTX_FLOOR, quantum))


def _reuse_of(s: ServeSettings) -> tuple[int, int]:
    """(prefix_cache_tokens, prefix_holders) of resolved settings (resolve_settings)."""
    if s.prefix_cache_tokens is None or s.prefix_holders is None:
        raise ValueError("settings not resolved: prefix reuse is still left to the server")
    return s.prefix_cache_tokens, s.prefix_holders


# The cold prefix hold's minimum shared length: four of the KV event blocks (a shorter shared
# part costs less to prefill twice than to wait for).
COLD_PREFIX_HOLD_TOKENS = 64


def cold_prefix_hold_plans(lane_tokens: int) -> int:
    """The plans a request may be held for a leader (`cold_prefix_hold_max_steps`): enough for
    a leader that fills its lane in the slack rule's smallest chunks, one every
    `slack_interleave_max` + 1 plans, the pace of a rule pressed by decoding streams (with
    the scheduler's 64, a 1 000-token leader outlasted the hold there, and its peers prefilled
    the shared part themselves)."""
    from ..types import SchedulerConfig
    d = SchedulerConfig()
    paced = -(-lane_tokens // max(d.slack_min_chunk_tokens, 1)) * (d.slack_interleave_max + 1)
    return max(d.cold_prefix_hold_max_steps, paced)


def listen_socket(host: str, port: int, backlog: int = LISTEN_BACKLOG) -> socket.socket:
    """The server's listening TCP socket on (`host`, `port`), non-blocking.

    Made with the protocol named (IPPROTO_TCP): asyncio turns Nagle's algorithm off on the
    connections it accepts only when the socket says it is TCP, and with Nagle on, a stream's
    small SSE writes on a reused keep-alive connection wait for the client's delayed ACK
    (about 40 ms on Linux) before they leave."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(backlog)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


class Server:
    def __init__(self, settings: ServeSettings) -> None:
        from ..hosts.llama import LlamaHost

        self._tmp: Optional[tempfile.TemporaryDirectory[str]] = None
        self.fitted: Any = None  # hosts.llama.fit.Resolved: where the layers went
        resolve_settings(settings)  # the planning settings are checked before the model is read
        try:
            settings = self._fit(settings)
        except BaseException:
            if self._tmp is not None:
                self._tmp.cleanup()
            raise
        s = resolve_settings(settings)
        ctx_size = context_of(s)
        if ctx_size < s.max_active:
            raise ValueError(f"ctx_size ({s.ctx_size}) must give every one of the "
                             f"{s.max_active} lanes at least one KV cell")
        if ctx_size // s.max_active < MIN_LANE_TOKENS:
            raise ValueError(f"a context of {ctx_size} tokens over {s.max_active} lanes gives "
                             f"each lane {ctx_size // s.max_active} tokens; a lane needs at "
                             f"least {MIN_LANE_TOKENS} (give -c {MIN_LANE_TOKENS * s.max_active}"
                             " or more, or fewer lanes with -np)")
        for name in ("max_body_bytes", "max_connections", "header_timeout_s", "body_timeout_s"):
            if not getattr(s, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(s, name)}")
        if not s.shutdown_timeout_s >= 0:
            raise ValueError(f"shutdown_timeout_s must be >= 0, got {s.shutdown_timeout_s}")
        kv_events.check(s)  # before the model loads
        self.settings = s
        self.host: ServingHost  # set by _load or _load_stages (the serving seam's protocol)
        self.kv_events: Optional[kv_events.KvEventPublisher] = None
        with _signals_interrupt():
            try:
                if s.stages or s.stage_addresses:
                    self._load_stages(s)
                else:
                    self._load(s, LlamaHost)
            except BaseException:  # an error, or a signal while loading: leave nothing behind
                loaded: Optional[ServingHost] = vars(self).get("host")
                if loaded is not None:
                    loaded.close()
                if self._tmp is not None:
                    self._tmp.cleanup()
                raise
        self._uvicorn: Any = None
        self._sock: Optional[socket.socket] = None
        self._thread: Optional[threading.Thread] = None
        self.url: Optional[str] = None

    def _model_file(self, s: ServeSettings) -> str:
        """The model's path; the tiny model is written (once) to a temporary directory."""
        if s.model is not None:
            return s.model
        if self._tmp is None:
            from ..hosts.tiny_model import write_tiny_llama

            self._tmp = tempfile.TemporaryDirectory(prefix="skippy-serve-")
            write_tiny_llama(os.path.join(self._tmp.name, "tiny-llama-f32.gguf"), seed=s.seed)
        return os.path.join(self._tmp.name, "tiny-llama-f32.gguf")

    def _fit(self, s: ServeSettings) -> ServeSettings:
        """The settings left to the device decided: where the layers go, the context, the KV
        type, flash attention and the batch (hosts/llama/fit.py; FitError and ModelFileError
        are ValueErrors, raised before anything is loaded)."""
        import dataclasses

        if s.stages or s.stage_addresses:  # each stage worker places its own layers
            return dataclasses.replace(
                s, ctx_size=s.ctx_size or _staged_context(s),
                batch_size=s.batch_size or CPU_BATCH,
                kv_type=s.kv_type or "f32",
                flash_attn=s.flash_attn if s.flash_attn is not None else False,
                inflight=s.inflight or 1)  # the pipeline depth: one stage's work at a time
        s = dataclasses.replace(s, threads=s.threads or 2)
        from ..hosts.llama.fit import resolve

        reuse = s.prefix_cache_tokens != 0
        holders = (s.prefix_holders if s.prefix_holders is not None
                   else default_reuse(s.max_active, max(s.ctx_size or 0, s.max_active))[1])
        r = resolve(self._model_file(s), s.offload, n_ctx=s.ctx_size, lanes=s.max_active,
                    holders=holders if reuse else 0, share_ctx=True, kv_type=s.kv_type,
                    flash_attn=s.flash_attn, n_batch=s.batch_size, n_ubatch=s.ubatch_size)
        self.fitted = r
        return dataclasses.replace(s, ctx_size=r.n_ctx, batch_size=r.n_batch,
                                   ubatch_size=r.n_ubatch, kv_type=r.kv_type,
                                   flash_attn=r.flash_attn,
                                   inflight=plans_in_flight(s.inflight, r.placement.on_gpu))

    def _load(self, s: ServeSettings, host_class: Callable[..., ServingHost]) -> None:
        model = self._model_file(s)
        name = s.model_name or ("tiny-random-llama" if s.model is None
                                else os.path.splitext(os.path.basename(model))[0])
        # With reuse every holder gets a KV stream like a lane's (each request keeps to
        # ctx_size / max_active, as without reuse).
        tokens, holders = _reuse_of(s)
        reuse = tokens > 0
        ctx_size = context_of(s)
        n_ctx = ctx_size + (holders * (ctx_size // s.max_active) if reuse else 0)
        self.host = host_class(model, n_ctx=n_ctx, n_seq_max=s.max_active, n_threads=s.threads,
                               n_batch=s.batch_size, n_ubatch=s.ubatch_size,
                               kv_type=s.kv_type, flash_attn=s.flash_attn,
                               prefix_cache_tokens=s.prefix_cache_tokens,
                               prefix_holders=s.prefix_holders,
                               placement=self.fitted.placement if self.fitted else None,
                               backend_sampling=s.backend_sampling,
                               stage_ahead=s.stage_ahead)
        self._build(s, name, reuse)

    def _load_stages(self, s: ServeSettings) -> None:
        """A model split across stage workers (docs/stages.md "Serving")."""
        from .staged import StageMetrics, StagedEngineRunner, stage_host

        host = self.host = stage_host(s)
        name = s.model_name or (os.path.splitext(os.path.basename(s.model))[0] if s.model
                                else host.stages[0].source_name)
        self._build(s, name, _reuse_of(s)[0] > 0, StagedEngineRunner,
                    disjoint=(s.inflight or 1) > 1)
        runner = self.runner
        assert isinstance(runner, StagedEngineRunner)
        self.context.metrics.registry.register(StageMetrics(runner))

    def _build(self, s: ServeSettings, name: str, reuse: bool,
               runner_class: "Optional[type[EngineRunner]]" = None,
               disjoint: bool = False) -> None:
        from .. import PlanningRule, SchedulerConfig
        from ..engine.contract import PromptKeepingHost
        from .access import AccessSettings
        from .app import Limits, ServeContext, create_app
        from .guard import default_allowed_hosts
        from .slo import GAP_PLAN_SHARE, Slo, SloSettings
        from . import vllm_compat
        from .runner import EngineRunner
        from .text import token_pieces

        host = self.host
        # The host's memory pools (a staged model's KV per stage), if it reports any.
        components = host.memory_components if isinstance(host, MemoryComponentsHost) else []
        # With reuse the holders' sequence ids are the scheduler's reserved ids.
        ids = host.sequence_id_settings if reuse else {}
        lane_tokens = (context_of(s) // s.max_active if reuse
                       else min(host.n_ctx_seq, host.n_ctx))
        # Waiting room for a whole burst: see "Capacity" in the module docstring.
        config = SchedulerConfig(
            max_active_sequences=s.max_active, max_waiting_sequences=s.max_waiting + s.max_active,
            # The batch the context got (llama.cpp caps it at the context size), not the one
            # asked for: a plan above it would abort the process inside llama_decode.
            max_tokens_per_iteration=host.n_batch,
            prefill_chunk_tokens=min(s.prefill_chunk, host.n_batch),
            mixed_prefill_decode=s.mixed,
            max_consecutive_prefill_iterations=s.max_consecutive_prefill,
            max_inflight_plans=s.inflight or 1,  # decided by _fit; 1 for a hand-built one
            disjoint_inflight_plans=disjoint,
            planning_rule=PlanningRule.SLACK if s.planning_rule == "slack"
            else PlanningRule.REFERENCE,
            itl_target=(s.slo_itl_ms * GAP_PLAN_SHARE if s.slo_itl_ms is not None
                        else s.itl_target_ms) / 1e3,
            slack_prefill_age_max=s.prefill_age_max_ms / 1e3,
            slack_first_token_hold=s.first_token_hold,
            memory_components=list(components),
            priority_preemption=s.priority_preemption,
            cold_prefix_hold_tokens=(COLD_PREFIX_HOLD_TOKENS if s.cold_prefix_hold and reuse
                                     and isinstance(host, PromptKeepingHost) else 0),
            cold_prefix_hold_max_steps=cold_prefix_hold_plans(lane_tokens),
            sequence_id_limit=ids.get("sequence_id_limit", DEFAULT_SEQUENCE_ID_LIMIT),
            reserved_sequence_ids=ids.get("reserved_sequence_ids", 0))
        self.scheduler = make_scheduler(config, policy=s.policy, implementation=s.scheduler)
        # Before the runner: its step timer reads the host's running totals from its start.
        self.warmup: Optional[WarmUp] = None
        if s.cost_warmup and s.planning_rule == "slack" and runner_class is None:
            self.warmup = self._warm_up(s, config, lane_tokens)
        self.runner = (runner_class or EngineRunner)(self.scheduler, host)
        if self.warmup is not None:
            self.runner.engine.cost_fitter = self.warmup.fitter
        if s.step_log:
            self.runner.step_timing.step_log(s.step_log)
        self.context = ServeContext(
            runner=self.runner, host=host, model_name=name, model_aliases=s.model_aliases,
            pieces=token_pieces(host.n_vocab, host.token_bytes),
            n_ctx_seq=lane_tokens, lanes=s.max_active,
            memory_components=list(config.memory_components),
            limits=Limits(capacity=s.max_active + s.max_waiting, max_body_bytes=s.max_body_bytes,
                          body_timeout_s=s.body_timeout_s,
                          max_piece_bytes=max_piece_bytes(host)),
            strict_request_fields=s.strict_request_fields,
            slo=Slo(SloSettings(s.slo_ttft_ms, s.slo_itl_ms, s.slo_shed),
                    cost=_fitted_cost(self.scheduler, config.step_cost),
                    batch_tokens=config.max_tokens_per_iteration,
                    age_max_ms=s.prefill_age_max_ms,
                    prefilled=self.runner.track_prefill().done if s.slo_shed else None))
        if self.fitted is not None:
            from .metrics import DeviceMemory

            self.context.metrics.registry.register(DeviceMemory(self.fitted.placement))
        hosts = s.allowed_hosts
        if hosts is None:
            hosts = default_allowed_hosts(s.host)
        elif "*" in hosts:
            hosts = None
        self.allowed_hosts = hosts
        self.app = create_app(self.context, allowed_hosts=hosts, access=AccessSettings(
            api_key=s.api_key, open_paths=s.open_paths, allowed_origins=s.allowed_origins))
        vllm_compat.install(self.app, self.context)
        # last: nothing after it can fail
        self.kv_events = kv_events.start(s, host, self.runner.engine, self.runner.post)

    def _warm_up(self, s: ServeSettings, config: "SchedulerConfig",
                 lane_tokens: int) -> "WarmUp":
        """The slack rule's cost model fitted to a synthetic burst on the host, for the engine
        to start from (engine/warmup.py)."""
        from ..engine.warmup import warm_cost_model

        def scheduler(c: "SchedulerConfig") -> Any:
            return make_scheduler(c, policy=s.policy, implementation=s.scheduler)

        warm = warm_cost_model(self.host, scheduler, config, n_vocab=self.host.n_vocab,
                               lane_tokens=lane_tokens)
        log.info("%s", warm.describe())
        return warm

    # -- running ------------------------------------------------------------------------------

    def _uvicorn_server(self, sock: socket.socket) -> Any:
        import uvicorn

        from .connections import DeadlineServer, protocol_class

        s = self.settings
        limit = connection_budget(s.max_connections)
        if limit < s.max_connections:
            log.warning("serving at most %d connections (the descriptor limit leaves no room "
                        "for --max-connections %d)", limit, s.max_connections)
        self.max_connections = limit
        config = uvicorn.Config(self.app, log_level=s.log_level,
                                http=protocol_class(s.header_timeout_s, limit,
                                                    body_timeout_s=s.body_timeout_s,
                                                    on_error=self._count_error),
                                loop="asyncio", lifespan="off", timeout_keep_alive=30,
                                backlog=ACCEPT_BATCH)
        server = DeadlineServer(config, shutdown_timeout_s=s.shutdown_timeout_s,
                                stop_engine=self._stop_engine, listen_backlog=LISTEN_BACKLOG)
        host, port = sock.getsockname()[:2]
        self.url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
        return server

    def _count_error(self, status: int) -> None:
        """Count an error answer written below the app (connections.py)."""
        self.context.metrics.request_errors.labels(str(status)).inc()

    def _stop_engine(self) -> None:
        self.context.shutting_down = True
        self.runner.stop()

    def _bind(self, port: Optional[int] = None) -> socket.socket:
        return listen_socket(self.settings.host, self.settings.port if port is None else port)

    def serve(self, announce: Optional[Callable[[int], None]] = None, *,
              exiting: bool = False) -> None:
        """Serve until SIGINT or SIGTERM, then drain (see the module docstring) and close.
        `announce` is called with the port once the socket is bound (the one the system
        picked for port 0), before the engine starts. `exiting`: the process ends once this
        returns (the command line's), so a signal after the closing is ignored rather than
        given its default action (which would kill it with the signal's status)."""
        with _exit_on_signals(exiting) as server_box:
            try:
                sock = self._bind()
                try:
                    if announce is not None:
                        announce(sock.getsockname()[1])
                    self.runner.start()
                    server = self._uvicorn_server(sock)
                    self._uvicorn = server
                    server_box.append(server)
                    # The heap kept from here on, out of the collector's passes (gc_pauses.py).
                    freeze_startup_heap()
                    server.run(sockets=[sock])
                finally:
                    gc.unfreeze()
                    sock.close()
            finally:
                self.close()

    def start_in_thread(self, port: int = 0, timeout_s: float = 20.0) -> str:
        """Start the engine and uvicorn on background threads; return the base URL."""
        sock = self._bind(port)
        self.runner.start()
        server = self._uvicorn_server(sock)
        self._uvicorn = server
        self._thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]},
                                        name="skippy-http", daemon=True)
        self._thread.start()
        end = time.monotonic() + timeout_s
        while not server.started:
            if time.monotonic() > end or not self._thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        self._sock = sock
        return self.url  # type: ignore[return-value]

    def shutdown(self, timeout_s: float = 10.0) -> None:
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
        self.close()

    def close(self) -> None:
        """Stop the engine, free llama.cpp and remove the temporary model (each step runs even
        when an earlier one fails)."""
        stopped = True
        try:
            if self.runner.running or self.runner.started:
                stopped = self.runner.stop()
        finally:
            try:
                if self.kv_events is not None:
                    self.kv_events.close()
                    self.kv_events = None
                if stopped:
                    self.host.close()
                elif isinstance(self.host, InterruptibleHost):
                    # The engine thread is still in the host: leave its memory alone.
                    self.host.abandon()
            finally:
                if self._tmp is not None:
                    self._tmp.cleanup()
                    self._tmp = None


def _fitted_cost(scheduler: Any, prior: "StepCost") -> "Callable[[], Optional[StepCost]]":
    """The slack rule's step cost model once the engine has refit it (None before: the
    config's prior is a guess), read whole from the event loop (serve/slo.py)."""
    from ..engine.contract import SlackRuleScheduler

    if not isinstance(scheduler, SlackRuleScheduler):
        return lambda: None

    def cost() -> "Optional[StepCost]":
        c = scheduler.step_cost
        return None if c is prior else c

    return cost


def max_piece_bytes(host: VocabularyHost) -> int:
    """The most bytes of text one token can stand for (control tokens by their text), at least
    8: a prompt longer than this many bytes per token of context can never fit."""
    longest = max((len(host.token_bytes(t, special=True)) for t in range(host.n_vocab)),
                  default=0)
    return max(longest, 8)


def connection_budget(wanted: int) -> int:
    """`wanted`, or fewer so that connections never take the process's last descriptors."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):  # pragma: no cover - not POSIX
        return wanted
    if soft == resource.RLIM_INFINITY:
        return wanted
    try:
        used = len(os.listdir("/proc/self/fd"))
    except OSError:  # pragma: no cover - no procfs
        used = 64
    return max(1, min(wanted, soft - used - FD_RESERVE))


@contextlib.contextmanager
def _signals_interrupt() -> Iterator[None]:
    """SIGTERM interrupts the block as Ctrl-C does (on the main thread), so loading can clean
    up after either."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def _exit_on_signals(exiting: bool = False) -> Iterator[list[Any]]:
    """SIGINT and SIGTERM ask the uvicorn server put in the yielded list to exit (a second one
    skips the drain); before it exists, they interrupt start-up. The handlers stay until the
    block, closing included, is done, so a late Ctrl-C cannot cut the closing short; then the
    previous ones are put back, or with `exiting` (the process ends next) the signals are
    ignored from there on."""
    if threading.current_thread() is not threading.main_thread():
        yield []
        return
    box: list[Any] = []
    seen: list[int] = []

    def handle(sig: int, frame: Any) -> None:
        seen.append(sig)
        if not box:
            raise KeyboardInterrupt
        server = box[0]
        if len(seen) == 1:
            log.warning("stopping (signal %d): draining for up to %g s", sig,
                        server.shutdown_timeout_s)
            server.should_exit = True
        else:
            server.force_exit = True

    previous = {sig: signal.signal(sig, handle) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield box
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_IGN if exiting else handler)
