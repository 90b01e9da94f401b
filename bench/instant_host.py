"""A host that answers every plan at once, and the real server app built on it.

`InstantHost` runs no model: every sampling row of a plan gets the same fixed next token, written
into `plan.outputs` the way any host writes them (it is the engine's `CostModelHost` with a fixed
token, plus the vocabulary the HTTP layer needs). With it, what a request costs is only what the
server, the engine and the scheduler spend on it: HTTP, SSE, detokenisation, events, planning.

Its vocabulary is bytes: token 0 is unknown, 1 the start token (BOS), 2 the end token, and token
3 + b is the byte b. A prompt is BOS followed by one token per UTF-8 byte of its text; the end
token is never sampled, so every request runs to its `max_tokens`. It is a `ServingHost` (the
serving seam, engine/contract.py): no chat template (chats are ChatML) and no grammar check, so
it serves without llama-cpp-python.

`build_server(settings, host)` wires the package's own pieces (scheduler, `EngineRunner`,
`ServeContext`, `create_app`) around a host the way `skippy_scheduler.serve.Server` does around
llama.cpp, with the scheduler settings (the planning rule included) and admission policy of
`ServeSettings` (no prefix reuse: the host keeps no KV); `serve(...)`
runs it under uvicorn with the HTTP protocol `Server` uses (h11 with the connection guard of
`serve/connections.py`).
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

from skippy_scheduler import PlanningRule, ReleaseReason, Scheduler, SchedulerConfig
from skippy_scheduler.engine import CostModelHost, Plan
from skippy_scheduler.inflight import HostWorker
from skippy_scheduler.selection import make_admission
from skippy_scheduler.serve import ServeSettings
from skippy_scheduler.serve.app import ServeContext, create_app
from skippy_scheduler.serve.runner import EngineRunner
from skippy_scheduler.serve.text import token_pieces

BYTE_BASE = 3  # token of byte 0


class InstantHost(CostModelHost):
    """No model: the fixed `token` for every sampling row (default: the byte "a").

    `step_s` > 0 makes every plan take that long, asleep (the GIL released, as llama_decode
    releases it), so that requests get one token per step, as they do on a real model, and each
    streamed chunk carries one token; at 0 the plan is answered at once. `execute_async` runs a
    plan on one worker thread, as the llama.cpp host runs its decodes, so with plans in flight
    (`--inflight 2`) the engine completes and plans while a plan "runs"; `execute_after` queues
    the next plan behind it, and a plan's handle is said done as the next one starts, as the
    llama.cpp host does.
    """

    def __init__(self, n_seq_max: int = 64, n_ctx_seq: int = 4096,
                 token: int = BYTE_BASE + ord("a"), step_s: float = 0.0) -> None:
        super().__init__(token)
        self.step_s = step_s
        self.n_vocab = BYTE_BASE + 256
        self.n_seq_max = n_seq_max
        self.n_ctx_seq = n_ctx_seq
        self.n_ctx = n_seq_max * n_ctx_seq
        self.n_batch = self.n_ctx  # decodes nothing: a plan may hold the whole context
        self.releases = 0
        self._worker = HostWorker(self.execute, "instant-step", hold_until_launch=True)

    def execute(self, plan: Plan) -> None:
        self._worker.launching()  # the "device" starts: the plan before is said done now
        if self.step_s > 0:
            time.sleep(self.step_s)
        super().execute(plan)

    def execute_async(self, plan: Plan) -> "Future[None]":
        """`execute` on the host's one worker thread."""
        return self._worker.start(plan)

    def execute_after(self, plan: Plan, earlier: list[Plan]) -> "Future[None]":
        """`execute` on the worker behind the plans started, deferred inputs filled there."""
        return self._worker.after(plan, earlier)

    def call_after(self, fn: Callable[[], object]) -> "Future[object]":
        """`fn()` on the worker behind the plans started (the engine's releases)."""
        return self._worker.call(fn)

    @property
    def sequence_id_settings(self) -> Mapping[str, int]:
        """One sequence id per lane, none reserved (it keeps no prefixes)."""
        return {"sequence_id_limit": self.n_seq_max, "reserved_sequence_ids": 0}

    def token_bytes(self, token: int, *, special: bool = False) -> bytes:
        return bytes([token - BYTE_BASE]) if BYTE_BASE <= token < self.n_vocab else b""

    def tokenize(self, text: str, *, add_bos: Optional[bool] = None,
                 special: bool = True) -> list[int]:
        start = [] if add_bos is False else [1]  # BOS unless told otherwise
        return start + [BYTE_BASE + b for b in text.encode("utf-8")]

    def chat_template(self) -> Optional[str]:
        return None

    def release(self, sequence_id: str,
                reason: ReleaseReason = ReleaseReason.FINISHED) -> None:
        self.releases += 1

    def close(self) -> None:
        self._worker.close()


class FailingHost(InstantHost):
    """An `InstantHost` whose `at`-th plan raises `error` (a step that fails once, for a
    server's recovery); `failed` is set when it does."""

    def __init__(self, at: int, error: BaseException, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.at = at
        self.error = error
        self.plans = 0
        self.failed = threading.Event()

    def execute(self, plan: Plan) -> None:
        self.plans += 1
        if self.plans == self.at:
            self.failed.set()
            raise self.error
        super().execute(plan)


@dataclass
class InstantServer:
    """The app and the engine thread behind it (start the runner before serving)."""

    app: Any
    runner: EngineRunner
    host: InstantHost


def build_server(settings: ServeSettings, host: InstantHost) -> InstantServer:
    s = settings
    batch = s.batch_size if s.batch_size is not None else 512  # the server's CPU default
    config = SchedulerConfig(
        max_active_sequences=s.max_active, max_waiting_sequences=s.max_waiting,
        max_tokens_per_iteration=batch,
        prefill_chunk_tokens=min(s.prefill_chunk, batch), mixed_prefill_decode=s.mixed,
        max_consecutive_prefill_iterations=s.max_consecutive_prefill,
        max_inflight_plans=s.inflight or 1,
        planning_rule=PlanningRule.SLACK if s.planning_rule == "slack" else PlanningRule.REFERENCE,
        itl_target=s.itl_target_ms / 1e3, priority_preemption=s.priority_preemption,
        reserved_sequence_ids=0)
    runner = EngineRunner(Scheduler(config, admission=make_admission(s.policy)), host)
    context = ServeContext(runner=runner, host=host, model_name="instant",
                           pieces=token_pieces(host.n_vocab, host.token_bytes),
                           n_ctx_seq=host.n_ctx_seq, lanes=s.max_active,
                           memory_components=list(config.memory_components))
    return InstantServer(create_app(context), runner, host)


def serve(server: InstantServer, sock: Any, log_level: str = "warning") -> None:
    """Serve on the bound, listening socket `sock` until interrupted, then stop the engine."""
    import uvicorn

    from skippy_scheduler.serve.connections import protocol_class

    s = ServeSettings()  # the HTTP protocol `Server` runs (h11, with its connection guard)
    config = uvicorn.Config(server.app, log_level=log_level,
                            http=protocol_class(s.header_timeout_s, s.max_connections),
                            loop="asyncio", lifespan="off", timeout_keep_alive=30)
    server.runner.start()
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        server.runner.stop()
