"""`skippy-scheduler dynamo-worker`: this server's engine in process behind Dynamo's runtime.

Dynamo's backend SDK (`dynamo.common.backend`, ai-dynamo 1.6) drives an `LLMEngine`: its
Rust `Worker` creates the runtime (discovery, request plane, event plane), calls `start`,
registers the model (`ModelInput.Tokens`, chat and completions) with the Hugging Face folder
as its path, serves the `generate` endpoint, watches for cancellation (calling `abort`), relays
KV events and load snapshots to the router, and on SIGINT/SIGTERM unregisters, drains and calls
`cleanup`.

`SkippyEngine` supplies:

* the engine: a `Server` built from `ServeSettings` (the host, scheduler, engine thread and the
  prefix store's vLLM-format KV event publisher) whose HTTP side is never started;
* `generate`: `EngineAdapter.stream` (adapter.py), Dynamo's token-id request in, token ids and
  the finish reason out; what has no counterpart here is refused with `InvalidArgument`, and a
  full waiting queue with `WorkerUnavailable` (retryable, a 503), as is a request the engine
  failed under (`EngineFailed`: a step out of device memory, a host failure, a shutdown);
* KV events: the prefix store's blocks as Dynamo's router counts them (the leading BOS the
  engine adds left out, routing_events.py) on a ZeroMQ PUB socket of their own, handed to
  Dynamo's relay as a `ZmqSource` (the vLLM wire format it reads from vLLM and SGLang) at the
  address it connects to (a wildcard bind address's host as 127.0.0.1); a subscriber that
  joins late (the relay, a restarted one) gets what is resident, as `serve`'s stream does;
* load: a `ComponentSnapshot` every `SNAPSHOT_S` (KV blocks used and in all, the prefix hit
  rate), which sets Dynamo's worker gauges and feeds its router's load signal.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, AsyncGenerator, Optional

from dynamo._core import Context  # type: ignore[import-not-found, unused-ignore]
from dynamo.common.backend import (  # type: ignore[import-not-found, unused-ignore]
    EngineConfig, LLMEngine, LlmRegistration, WorkerConfig)
from dynamo.common.backend.publisher import (  # type: ignore[import-not-found, unused-ignore]
    ComponentSnapshot, ZmqSource)
from dynamo.llm import ModelInput  # type: ignore[import-not-found, unused-ignore]
from dynamo.llm.exceptions import (  # type: ignore[import-not-found, unused-ignore]
    InvalidArgument, WorkerUnavailable)

from .adapter import EngineAdapter, EngineFailed, EngineRefused, Unsupported, Vocabulary

log = logging.getLogger("skippy_scheduler.dynamo")

SNAPSHOT_S = 0.1  # how often the load snapshot is published


@dataclass(frozen=True)
class WorkerSettings:
    """What the worker registers and where (the engine's own settings are `ServeSettings`)."""

    hf_folder: str  # the model folder Dynamo's frontend tokenizes with (hf_export)
    served_model_name: str
    namespace: str = "dynamo"
    component: str = "backend"
    endpoint: str = "generate"
    discovery_backend: str = "file"
    request_plane: str = "tcp"
    event_plane: Optional[str] = "zmq"
    add_bos: bool = True
    routing_events_endpoint: Optional[str] = None  # the router's KV events (None: a free port)
    stats_file: Optional[str] = None  # the engine's counters as JSON, rewritten every 0.5 s


class SkippyEngine(LLMEngine):  # type: ignore[misc, unused-ignore]
    """The Dynamo engine around a `Server` (see the module docstring)."""

    def __init__(self, serve_settings: Any, settings: WorkerSettings) -> None:
        self.serve_settings = serve_settings
        self.settings = settings
        self.server: Any = None
        self.adapter: Optional[EngineAdapter] = None
        self._snapshots: Optional[threading.Thread] = None
        self._stop = threading.Event()
        self._publisher: Any = None
        self.routing_events: Any = None  # the KV event publisher Dynamo's relay reads
        self.routing_endpoint: Optional[str] = None  # where it is bound
        self.routing_connect: Optional[str] = None  # where the relay connects to it

    @classmethod
    async def from_args(cls, argv: Optional[list[str]] = None) -> Any:
        raise NotImplementedError("built by `skippy-scheduler dynamo-worker`")

    def worker_config(self) -> Any:
        s = self.settings
        return WorkerConfig(
            namespace=s.namespace, component=s.component, endpoint=s.endpoint,
            model_name=s.hf_folder, served_model_name=s.served_model_name,
            model_input=ModelInput.Tokens, endpoint_types="chat,completions",
            discovery_backend=s.discovery_backend, request_plane=s.request_plane,
            event_plane=s.event_plane, enable_kv_routing=True)

    async def start(self, worker_id: int) -> Any:
        import asyncio

        from ..serve.server import Server
        from . import routing_events

        # A bind address the relay cannot connect to is refused before the model loads.
        self.routing_endpoint = self.settings.routing_events_endpoint or _free_endpoint()
        self.routing_connect = routing_events.connect_endpoint(self.routing_endpoint)
        self.server = await asyncio.to_thread(Server, self.serve_settings)
        server = self.server
        bos_probe = server.host.tokenize("", add_bos=True)
        # the model's BOS when llama.cpp puts one in front by default
        bos = bos_probe[0] if bos_probe and server.host.tokenize("") else None
        self.adapter = EngineAdapter(server.runner, Vocabulary(
            n_vocab=server.host.n_vocab, n_ctx_seq=server.context.n_ctx_seq, bos=bos),
            add_bos=self.settings.add_bos)
        self.routing_events = routing_events.start(
            server.host, server.runner.engine, self.routing_endpoint,
            server.settings.kv_block_size, server.settings.kv_hash_seed,
            bos=bos if self.settings.add_bos else None, post=server.runner.post)
        state = server.runner.host_state()  # the engine thread's to read once it runs
        capacity = max(1, state.lane_cells)
        server.runner.start()
        s = server.settings
        lanes = s.max_active
        log.info("skippy engine started: %s, %d lanes of %d tokens, Dynamo's KV events on %s "
                 "(BOS %s), the server's on %s", server.context.model_name, lanes,
                 server.context.n_ctx_seq, self.routing_endpoint,
                 "left out" if bos is not None and self.settings.add_bos else "none",
                 s.kv_events_endpoint)
        return EngineConfig(
            model=self.settings.hf_folder, served_model_name=self.settings.served_model_name,
            llm=LlmRegistration(
                context_length=server.context.n_ctx_seq, kv_cache_block_size=s.kv_block_size,
                total_kv_blocks=max(1, capacity // s.kv_block_size), max_num_seqs=lanes,
                max_num_batched_tokens=server.host.n_batch))

    async def kv_event_sources(self) -> list[Any]:
        endpoint = self.routing_connect
        return [ZmqSource(endpoint=endpoint)] if endpoint else []

    def component_metrics_dp_ranks(self) -> list[int]:
        return [0]

    def attach_snapshot_publisher(self, publisher: Any) -> None:
        self._publisher = publisher
        self._snapshots = threading.Thread(target=self._publish_snapshots, daemon=True,
                                           name="skippy-dynamo-load")
        self._snapshots.start()

    def write_stats(self) -> None:
        """The engine's counters as JSON in `stats_file` (what `serve`'s /metrics carries for
        the prefix hit rate: prompt tokens restored and prefilled), replaced atomically."""
        path, server = self.settings.stats_file, self.server
        if not path or server is None:
            return
        import json
        import os

        st = server.runner.stats
        adapter = self.adapter
        data = {"restored_tokens": st.restored_tokens, "prefill_tokens": st.prefill_tokens,
                "prefix_hits": st.prefix_hits, "prefix_misses": st.prefix_misses,
                "requests": adapter.requests if adapter is not None else 0}
        try:
            with open(path + ".tmp", "w", encoding="utf-8") as f:
                json.dump(data, f)
            os.replace(path + ".tmp", path)
        except OSError:
            log.debug("stats not written", exc_info=True)

    def _publish_snapshots(self) -> None:
        ticks = 0
        while not self._stop.wait(SNAPSHOT_S):
            server = self.server
            if server is None:
                continue
            ticks += 1
            if ticks % 5 == 0:
                self.write_stats()
            st = server.runner.stats
            block = server.settings.kv_block_size
            # What the lanes may hold: the prefix holders' cells are evictable, free as vLLM
            # counts them, so a usage of 1 is the lanes full (Dynamo's busy threshold).
            total = max(1, st.kv_lane_capacity // block)
            used = min(total, -(-st.kv_tokens // block))
            looked = st.prefix_hits + st.prefix_misses
            try:
                self._publisher.publish(0, ComponentSnapshot(
                    kv_used_blocks=used, kv_total_blocks=total, gpu_cache_usage=used / total,
                    dp_rank=0,
                    kv_cache_hit_rate=(st.prefix_hits / looked) if looked else None))
            except Exception:  # the runtime is shutting down
                log.debug("load snapshot not published", exc_info=True)

    # Dynamo's own request and chunk types where it is installed (TypedDicts of these shapes).
    async def generate(  # type: ignore[override, unused-ignore]
            self, request: dict[str, Any], context: Any) -> AsyncGenerator[dict[str, Any], None]:
        adapter = self.adapter
        if adapter is None:
            raise RuntimeError("the engine is not started")
        try:
            async for chunk in adapter.stream(request, _request_id(context),
                                              stopped=context.is_stopped):
                yield chunk
        except Unsupported as exc:
            raise InvalidArgument(str(exc)) from None
        except EngineRefused as exc:
            if exc.busy:  # its queue is full: retryable, a 503 to the client (not a 500)
                raise WorkerUnavailable(f"skippy-scheduler is busy: {exc}") from None
            raise InvalidArgument(f"skippy-scheduler refused the request: {exc}") from None
        except EngineFailed as exc:
            # The engine's state, not the request's (its device memory ran out, a host failed,
            # it is shutting down): retryable, on this worker later or on another one.
            raise WorkerUnavailable(f"skippy-scheduler failed under the request: {exc}") \
                from None

    async def abort(self, context: Any) -> None:
        if self.adapter is not None:
            self.adapter.cancel(_request_id(context))

    async def cleanup(self) -> None:
        self._stop.set()
        if self._snapshots is not None:
            self._snapshots.join(timeout=1.0)
            self._snapshots = None
        self.write_stats()
        server, self.server = self.server, None
        if server is not None:
            import asyncio

            await asyncio.to_thread(server.close)
        routing, self.routing_events = self.routing_events, None
        if routing is not None:
            routing.close()


def _free_endpoint() -> str:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{sock.getsockname()[1]}"


def _request_id(context: Any) -> str:
    rid = context.id() if context is not None else None
    return str(rid) if rid else f"anon-{id(context):x}"


def run_worker(serve_settings: Any, settings: WorkerSettings) -> None:
    """Serve until SIGINT or SIGTERM (Dynamo's Worker owns the signals and the drain)."""
    from dynamo.common.backend.run import run  # type: ignore[import-not-found, unused-ignore]

    engine = SkippyEngine(serve_settings, settings)

    async def factory(argv: Optional[list[str]]) -> tuple[Any, Any]:
        return engine, engine.worker_config()

    run(SkippyEngine, [], engine_factory=factory)


__all__ = ["Context", "SkippyEngine", "WorkerSettings", "run_worker"]
