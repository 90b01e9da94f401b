"""A whole server: the llama.cpp host, the scheduler, the engine thread, the app, uvicorn.

    server = Server(ServeSettings(model="m.gguf", max_active=16))
    server.serve()                    # blocks (what `skippy-scheduler serve` runs)

    url = server.start_in_thread()    # tests and embedding: returns "http://127.0.0.1:PORT"
    ...
    server.shutdown()

Lanes: `max_active` requests run at once, each in its own llama.cpp sequence with
`ctx_size / max_active` KV cells (llama.cpp's per-sequence KV streams); a request's prompt plus
`max_tokens` must fit one lane. Plans are bounded by `batch_size` tokens, prompts are prefilled
in chunks of `prefill_chunk` tokens, and with `mixed` decode rows ride along with prefill
chunks, so running streams keep their pace while new prompts are prefilled.
"""
from __future__ import annotations

import contextlib
import os
import socket
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Optional

POLICIES = ("cache-aware", "fcfs", "priority")


@dataclass
class ServeSettings:
    model: Optional[str] = None  # None: the tiny random-weight model, written to a temp dir
    model_name: Optional[str] = None  # the id /v1/models reports (default: the file's stem)
    seed: int = 0  # of the tiny model
    host: str = "127.0.0.1"
    port: int = 8000
    max_active: int = 8
    max_waiting: int = 256
    ctx_size: int = 4096
    threads: int = 2
    batch_size: int = 512
    prefill_chunk: int = 256
    mixed: bool = True
    max_consecutive_prefill: Optional[int] = 1
    inflight: int = 1  # plans in flight (max_inflight_plans): 2 overlaps scheduling with decode
    policy: str = "cache-aware"
    prefix_cache_tokens: int = 0  # tokens the prefix store keeps for reuse (0: off); each holder
    #   gets a KV stream of ctx_size / max_active cells on top of ctx_size
    prefix_holders: int = 16  # sequence ids holding resident prefixes (with reuse)
    kv_type: str = "f32"
    flash_attn: bool = False
    log_level: str = "warning"


def _admission(policy: str):
    from .. import CacheAwareAdmission, FcfsAdmission, PriorityAdmission

    if policy == "cache-aware":
        return CacheAwareAdmission()
    if policy == "fcfs":
        return FcfsAdmission()
    if policy == "priority":
        return PriorityAdmission()
    raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")


class Server:
    def __init__(self, settings: ServeSettings) -> None:
        from .. import Scheduler, SchedulerConfig
        from ..hosts.llama import LlamaHost
        from .app import ServeContext, create_app
        from .runner import EngineRunner
        from .text import token_pieces

        s = settings
        if s.ctx_size < s.max_active:
            raise ValueError(f"ctx_size ({s.ctx_size}) must give every one of the "
                             f"{s.max_active} lanes at least one KV cell")
        self.settings = s
        self._tmp: Optional[tempfile.TemporaryDirectory] = None
        model = s.model
        if model is None:
            from ..hosts.tiny_model import write_tiny_llama

            self._tmp = tempfile.TemporaryDirectory(prefix="skippy-serve-")
            model = write_tiny_llama(os.path.join(self._tmp.name, "tiny-llama-f32.gguf"),
                                     seed=s.seed)
        name = s.model_name or ("tiny-random-llama" if s.model is None
                                else os.path.splitext(os.path.basename(model))[0])
        # With reuse every holder gets a KV stream like a lane's (each request keeps to
        # ctx_size / max_active, as without reuse).
        reuse = s.prefix_cache_tokens > 0
        n_ctx = s.ctx_size + (s.prefix_holders * (s.ctx_size // s.max_active) if reuse else 0)
        try:
            self.host = LlamaHost(model, n_ctx=n_ctx, n_seq_max=s.max_active,
                                  n_threads=s.threads, n_batch=s.batch_size, kv_type=s.kv_type,
                                  flash_attn=s.flash_attn, prefix_cache_tokens=s.prefix_cache_tokens,
                                  prefix_holders=s.prefix_holders)
        except BaseException:
            if self._tmp is not None:
                self._tmp.cleanup()
            raise
        config = SchedulerConfig(
            max_active_sequences=s.max_active, max_waiting_sequences=s.max_waiting,
            # The batch the context got (llama.cpp caps it at the context size), not the one
            # asked for: a plan above it would abort the process inside llama_decode.
            max_tokens_per_iteration=self.host.n_batch,
            prefill_chunk_tokens=min(s.prefill_chunk, self.host.n_batch),
            mixed_prefill_decode=s.mixed,
            max_consecutive_prefill_iterations=s.max_consecutive_prefill,
            max_inflight_plans=s.inflight,
            **(self.host.sequence_id_settings if reuse else {"reserved_sequence_ids": 0}))
        self.scheduler = Scheduler(config, admission=_admission(s.policy))
        self.runner = EngineRunner(self.scheduler, self.host)
        self.context = ServeContext(
            runner=self.runner, host=self.host, model_name=name,
            pieces=token_pieces(self.host.n_vocab, self.host.token_bytes),
            n_ctx_seq=(s.ctx_size // s.max_active if reuse
                       else min(self.host.n_ctx_seq, self.host.n_ctx)),
            memory_components=list(config.memory_components))
        self.app = create_app(self.context)
        self._uvicorn = None
        self._sock: Optional[socket.socket] = None
        self._thread: Optional[threading.Thread] = None
        self.url: Optional[str] = None

    # -- running ------------------------------------------------------------------------------

    def _uvicorn_server(self, sock: socket.socket):
        import uvicorn

        config = uvicorn.Config(self.app, log_level=self.settings.log_level, http="h11",
                                loop="asyncio", lifespan="off", timeout_keep_alive=30)
        server = uvicorn.Server(config)
        host, port = sock.getsockname()[:2]
        self.url = f"http://{host}:{port}"
        return server

    def _bind(self, port: Optional[int] = None) -> socket.socket:
        host = self.settings.host
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, self.settings.port if port is None else port))
        sock.listen(2048)
        sock.setblocking(False)
        return sock

    def serve(self) -> None:
        """Serve until interrupted (Ctrl-C), then stop the engine and free the model."""
        sock = self._bind()
        self.runner.start()
        server = self._uvicorn_server(sock)
        self._uvicorn = server
        try:
            server.run(sockets=[sock])
        finally:
            sock.close()
            self.close()

    def start_in_thread(self, port: int = 0, timeout_s: float = 20.0) -> str:
        """Start the engine and uvicorn on background threads; return the base URL."""
        sock = self._bind(port)
        self.runner.start()
        server = self._uvicorn_server(sock)
        server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
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
        if self.runner.running or self.runner._thread is not None:
            self.runner.stop()
        self.host.close()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
