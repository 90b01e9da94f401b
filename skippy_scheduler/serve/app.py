"""The HTTP face: FastAPI routes, request translation, SSE streaming.

`POST /v1/completions` and `POST /v1/chat/completions` (streamed or not), `GET /v1/models`,
`GET /health` (and `HEAD`), `GET /metrics`. A handler reads the body within its limits
(`body`), decodes and validates it (`protocol`) and tokenizes the prompt on a worker thread (after a bound on its
length in bytes that needs no tokenizer: a prompt longer than `max_piece_bytes` per token of
context can never fit), checks that it can ever run in one lane's context, refuses it with a 503
when `capacity` requests are already open or (with `--slo-shed`) when the cost model predicts
its first token cannot make its TTFT budget (`slo`), hands it to the engine thread (`EngineRunner.open`)
and waits for the scheduler's verdict: queued (200, then tokens), or refused (503 with
Retry-After). Only then does it answer, so a client learns about overload from the status code,
streamed or not. Everything before the verdict is done before any stream starts: a bad body is
a 400, never a cut stream.

A request whose client goes away (a closed stream, or a dropped connection while a
non-streamed request runs) is cancelled at once: the engine frees its lane and KV at the start
of its next step.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from contextlib import aclosing
from dataclasses import dataclass, field
from functools import partial
from typing import Any, AsyncIterator, Callable, Optional

from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from ..engine import Request as EngineRequest
from ..engine.contract import GrammarCheckingHost, RoutesHost
from ..types import MemoryComponent, RejectReason
from .access import AccessGuard, AccessSettings, served_model
from .body import decode_json, read_body
from .chat import ChatTemplate
from .choices import batches as _batches, choice_sampling, usage as _usage
from .answer import best_of as _best_of, echo_text, logprobs_of, sampling_of
from .errors import ClientGone, RequestError, internal, queue_full, unavailable
from .generation import Generation as _Generation
from .guard import HttpGuard
from .metrics import CONTENT_TYPE, ServeMetrics
from .protocol import GenerationRequest, parse_chat, parse_completion, with_min_tokens
from .runner import EngineRunner, EngineUnavailable, Inbox, Subscription
from .slo import Slo, planned_gap_ms
from .stream import BODY_WRITER, Direct, dumps as _dumps, sse

log = logging.getLogger("skippy_scheduler.serve")


@dataclass(frozen=True)
class Limits:
    """What one request may take (the server's settings; defaults for an app built alone)."""

    capacity: int = 1 << 30  # requests open at once (running + waiting) before a 503
    max_body_bytes: int = 8 << 20
    body_timeout_s: float = 30.0
    max_piece_bytes: int = 1 << 30  # bytes of text one token may stand for (the length bound)


@dataclass
class ServeContext:
    """What the routes need: the engine thread, the model's vocabulary and limits.

    The host is used from the event loop and its worker threads for what reads only the
    vocabulary (engine/contract.py, "the serving seam"): tokenizing, its chat template and, when
    it is a `GrammarCheckingHost`, checking a grammar."""

    runner: EngineRunner
    host: RoutesHost
    model_name: str
    pieces: list[bytes]  # bytes of every token
    n_ctx_seq: int  # tokens one request may hold (prompt + generated)
    lanes: int = 1  # requests that run at once (llama-server's slots)
    memory_components: list[MemoryComponent] = field(default_factory=list)
    limits: Limits = field(default_factory=Limits)
    model_aliases: tuple[str, ...] = ()  # further names requests may use (docs: access)
    strict_request_fields: bool = False  # refuse fields nobody defined instead of ignoring them
    slo: Slo = field(default_factory=Slo)  # the SLO the server was told (serve/slo.py)
    created: int = field(default_factory=lambda: int(time.time()))
    shutting_down: bool = False  # set before the engine is stopped for good
    metrics: ServeMetrics = field(init=False)
    chat: ChatTemplate = field(init=False)
    # The host's grammar check (None: it has none, its prepare_sequence judges alone).
    check_grammar: Optional[Callable[[str], None]] = field(init=False)

    def __post_init__(self) -> None:
        self.metrics = ServeMetrics(lambda: self.runner.stats)
        self.slo.metrics = self.metrics
        self.chat = ChatTemplate(self.host.chat_template())
        host = self.host
        self.check_grammar = (host.check_grammar if isinstance(host, GrammarCheckingHost)
                              else None)

    @property
    def n_vocab(self) -> int:
        return len(self.pieces)

    @property
    def model_names(self) -> tuple[str, ...]:
        return (self.model_name,) + tuple(n for n in self.model_aliases if n != self.model_name)

    def model_card(self, name: str) -> dict[str, Any]:
        """One served name as `/v1/models` lists it and `/v1/models/{name}` gives it."""
        return {"id": name, "object": "model", "created": self.created,
                "owned_by": "skippy-scheduler", "root": self.model_name, "parent": None,
                "max_model_len": self.n_ctx_seq, "chat_template": self.chat.source}


def _error_response(err: RequestError, metrics: Optional[ServeMetrics]) -> Response:
    if metrics is not None:
        metrics.request_errors.labels(str(err.status)).inc()
    return Response(_dumps(err.body()), status_code=err.status, headers=err.headers(),
                    media_type="application/json")


class _RequestIds:
    """Request ids of this process: 64 random bits drawn at start (again in a forked child)
    then a counter, 32 hex digits as a uuid4's (which costs a system call per request)."""

    def __init__(self) -> None:
        self._draw()
        os.register_at_fork(after_in_child=self._draw)

    def _draw(self) -> None:
        self._prefix = os.urandom(8).hex()
        self._count = itertools.count()

    def __call__(self) -> str:
        return f"{self._prefix}{next(self._count):016x}"


_request_id = _RequestIds()


def _engine_id(rid: str, i: int, count: int) -> str:
    """The engine request id of the i-th of a request's `count` engine requests (one per
    choice of each prompt)."""
    return rid if count == 1 else f"{rid}-{i}"

# Work this small is done on the event loop: a worker thread's round trip costs more than it
# (docs/measuring.md, "The server's own cost"); anything larger goes to a worker thread.
INLINE_BODY_BYTES = 8 << 10  # a request body decoded and parsed at once
INLINE_TEXT_CHARS = 2 << 10  # a prompt (or all of a chat's message text) tokenized at once


async def _off_loop(small: bool, fn: Callable[[], Any]) -> Any:
    """`fn()`: at once when `small`, else on a worker thread."""
    return fn() if small else await asyncio.to_thread(fn)


async def _read_request(request: Request, limits: Limits, parse: Any, n_vocab: int) -> Any:
    """The body read within `limits`, then decoded and parsed (on a worker thread unless
    small)."""
    raw = await read_body(request, limits.max_body_bytes, limits.body_timeout_s)
    return await _off_loop(len(raw) <= INLINE_BODY_BYTES,
                           lambda: parse(decode_json(raw), n_vocab))


def _tokenize(ctx: ServeContext, text: str, prompt_field: str) -> list[int]:
    """`text`'s tokens, after the length bound (on a worker thread: both take time)."""
    _bound_length(ctx, text, prompt_field)
    tokens: list[int] = ctx.host.tokenize(text, special=True)
    return tokens


def _bound_length(ctx: ServeContext, text: str, prompt_field: str) -> None:
    """A 400 for a prompt too long to fit whatever it tokenizes to (no tokenizer needed)."""
    limit = ctx.n_ctx_seq
    most = limit * ctx.limits.max_piece_bytes
    if 4 * len(text) <= most:  # UTF-8 takes at most 4 bytes a character
        return
    if len(text) > most:  # at least a byte a character: no need to encode it all
        size = f"at least {len(text)}"
    else:
        n = len(text.encode("utf-8"))
        if n <= most:
            return
        size = str(n)
    raise RequestError(
        f"This model's maximum context length is {limit} tokens, but the prompt ({size} "
        f"bytes) is longer than {limit} tokens can hold (at most "
        f"{ctx.limits.max_piece_bytes} bytes each).",
        param=prompt_field, code="context_length_exceeded")


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class _EventStream(StreamingResponse):
    """Server-sent events from an async iterator of byte chunks, cancelled when the client
    disconnects (watched directly, whatever the ASGI server's spec version)."""

    def __init__(self, chunks: AsyncIterator[bytes], on_close: Callable[[], None],
                 direct: Optional[Direct] = None) -> None:
        super().__init__(chunks, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._chunks = chunks
        self._on_close = on_close
        self._direct = direct

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # The server's direct writer (connections.BodyWriter), when it has one: the chunks
        # then skip the send chain whenever it can write at once.
        writer = scope.get("extensions", {}).get(BODY_WRITER)
        if self._direct is not None:
            self._direct.writer = writer

        async def produce() -> None:
            async for chunk in self._chunks:
                if writer is not None and writer.ready():
                    writer.write(chunk)
                else:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        tasks: list[asyncio.Future[None]] = []
        try:  # (the head's send too: a client gone before it must still close the answer)
            await send({"type": "http.response.start", "status": 200,
                        "headers": self.raw_headers})
            tasks = [asyncio.ensure_future(produce()),
                     asyncio.ensure_future(_wait_disconnect(receive))]
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                if not task.done():
                    task.cancel()
            ended = await asyncio.gather(*tasks, return_exceptions=True)
            # The client going away ends the sends with OSError (or cancels them); anything
            # else the producer raised is a fault of the answer's own, which the response
            # cannot carry any more (it is cut): the log says what it was.
            if ended and isinstance(ended[0], Exception) and not isinstance(ended[0], OSError):
                log.error("a streamed answer ended on an error", exc_info=ended[0])
            await self._chunks.aclose()  # type: ignore[attr-defined]
            self._on_close()


def create_app(ctx: ServeContext, allowed_hosts: Optional[tuple[str, ...]] = None,
               access: AccessSettings = AccessSettings()) -> FastAPI:
    """The routes, behind `access.AccessGuard` (key, CORS) inside `guard.HttpGuard`
    (`allowed_hosts` None: any `Host`)."""
    app = FastAPI(title="skippy-scheduler", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.ctx = ctx
    runner = ctx.runner
    errors = ctx.metrics.request_errors
    app.add_middleware(AccessGuard, settings=access,
                       on_error=lambda status: errors.labels(str(status)).inc())
    app.add_middleware(HttpGuard, allowed_hosts=allowed_hosts,
                       on_error=lambda status: errors.labels(str(status)).inc())

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, exc: RequestError) -> Response:
        return _error_response(exc, ctx.metrics)

    @app.exception_handler(ClientGone)
    async def _client_gone(request: Request, exc: ClientGone) -> Response:
        return Response(status_code=400)  # nobody reads it: the connection is gone

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        response = _error_response(RequestError(str(exc.detail), status=exc.status_code,
                                                type=kind), ctx.metrics)
        response.headers.update(exc.headers or {})  # Allow on a 405
        return response

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        log.exception("unexpected error answering %s", request.url.path)
        return _error_response(internal(f"{type(exc).__name__}: {exc}"), ctx.metrics)

    @app.api_route("/health", methods=["GET", "HEAD"])  # HEAD: what load balancers probe with
    async def health() -> dict[str, str]:
        if not runner.running:
            raise unavailable(runner.unavailable_reason)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [ctx.model_card(name) for name in ctx.model_names]}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(ctx.metrics.render(), media_type=CONTENT_TYPE)

    # The two generation routes are plain Starlette routes: they read and check their own
    # bodies, and FastAPI's per-request dependency solving (query parameters parsed, an exit
    # stack, endpoint telemetry) cost a tenth of a streamed request's server CPU for nothing.
    # The app's middleware and exception handlers apply to them as to every route.
    async def completions(request: Request) -> Response:
        received_us = runner.now_us()  # its arrival: TTFT and the SLO count from here
        gen = await _read_request(request, ctx.limits, partial(
            parse_completion, strict=ctx.strict_request_fields), ctx.n_vocab)
        gen.model = served_model(ctx.model_names, gen.model)
        prompts = [await _off_loop(len(p) <= INLINE_TEXT_CHARS,
                                   partial(_tokenize, ctx, p, "prompt"))
                   if isinstance(p, str) else p for p in gen.prompts]
        return await _generate(request, gen, prompts, "prompt", received_us)

    async def chat_completions(request: Request) -> Response:
        received_us = runner.now_us()
        gen = await _read_request(request, ctx.limits, partial(
            parse_chat, strict=ctx.strict_request_fields), ctx.n_vocab)
        gen.model = served_model(ctx.model_names, gen.model)

        def render_and_tokenize() -> list[int]:
            _bound_length(ctx, "".join(text for _, text in gen.messages), "messages")
            return _tokenize(ctx, ctx.chat.render(gen.messages), "messages")

        small = sum(len(text) for _, text in gen.messages) <= INLINE_TEXT_CHARS
        tokens = await _off_loop(small, render_and_tokenize)
        return await _generate(request, gen, [tokens], "messages", received_us)

    app.add_route("/v1/completions", completions, methods=["POST"])
    app.add_route("/v1/chat/completions", chat_completions, methods=["POST"])

    async def _generate(request: Request, gen: GenerationRequest, prompts: list[list[int]],
                        prompt_field: str, received_us: float) -> Response:
        """`n` choices per prompt (index in order: prompt by prompt), all admitted or none. The
        request arrived at `received_us` (the engine's clock): reading, tokenizing and checking
        it count against its first-token budget and in its TTFT."""
        n = gen.outputs.best_of or gen.n  # engine requests per prompt
        if gen.outputs.grammar is not None and ctx.check_grammar is not None:
            await asyncio.to_thread(_check_grammar, ctx.check_grammar, gen.outputs.grammar)
        samplings = [choice_sampling(sampling_of(gen, len(tokens)), j) for tokens in prompts
                     for j in range(n)]
        texts = ([echo_text(p, tokens, ctx.pieces) for p, tokens in zip(gen.prompts, prompts)]
                 if gen.outputs.echo else [])
        prompts = [tokens for tokens in prompts for _ in range(n)]
        budgets = [_check_fit(ctx, gen, len(tokens), prompt_field) for tokens in prompts]
        samplings = [with_min_tokens(gen, s, len(t), b)
                     for s, t, b in zip(samplings, prompts, budgets)]
        if len(prompts) > ctx.limits.capacity:  # no wait would make room for them
            raise RequestError(
                f"the request asks for {len(prompts)} sequences at once ({n} a prompt), more "
                f"than this server holds (lanes and waiting places: {ctx.limits.capacity})",
                param=("best_of" if gen.outputs.best_of else "n") if n > 1 else "prompt")
        if runner.open_subscriptions + len(prompts) > ctx.limits.capacity:
            # Every lane and waiting place is taken (the engine's own queue is sized to hold a
            # whole burst, so this is where the server's capacity is kept).
            raise queue_full("The server is busy: every lane and waiting place is taken; "
                             "retry later.")
        # Its SLO: its own budgets, else the server's; shed (503) when the cost model predicts
        # its first token cannot make its budget, before anything reaches the engine. Its
        # prompts count as waiting for prefill from here (no await in between) until their
        # first token (serve/slo.py).
        slo = ctx.slo
        gen.ttft_ms, gen.itl_ms = slo.budgets(gen.ttft_ms, gen.itl_ms)
        # Its budget counts from its arrival, as the engine's deadline does: the time spent
        # reading it is spent.
        spent_ms = max(runner.now_us() - received_us, 0.0) / 1e3
        own = [len(tokens) for tokens in prompts[::n]]
        slo.admit(sum(own), gen.ttft_ms, gen.priority, spent_ms)
        prefix = "cmpl" if gen.kind == "completion" else "chatcmpl"
        rid = f"{prefix}-{_request_id()}"
        held = slo.hold(own, gen.ttft_ms, [_engine_id(rid, i, len(prompts)) for i in
                                           range(0, len(prompts), n)]  # each first choice
                        if slo.shedding else None, gen.priority, spent_ms)
        try:
            subs = await _open_all(rid, gen, prompts, budgets, samplings, received_us)
        except BaseException:
            for key in held:
                slo.release(key)
            raise
        for tokens in prompts[::n]:  # each prompt once, as usage counts it
            ctx.metrics.prompt_tokens.inc(len(tokens))
        # Usage counts each prompt once, as OpenAI does with n > 1.
        outs = [_Generation(ctx, sub, gen, len(tokens) if i % n == 0 else 0, index=i,
                            prompt=tokens, echo=texts[i // n] if texts else None)
                for i, (sub, tokens) in enumerate(zip(subs, prompts))]
        for out, key in zip(outs[::n], held):
            out.held = key
        head = {"id": rid, "created": int(time.time()), "model": gen.model or ctx.model_name,
                "system_fingerprint": None}  # the key OpenAI always sends (null: none)
        if gen.return_token_ids and gen.kind == "chat":  # (a completion's: in each choice)
            head["prompt_token_ids"] = list(prompts[0])
        if gen.stream:
            direct = Direct()
            return _EventStream(sse(outs, head, ctx.pieces, _failure, direct),
                                lambda: _close_all(outs), direct)
        try:
            await _collect(request, outs)
        finally:
            _close_all(outs)
        for out in outs:
            if out.finish == "error":
                raise _failure(out)
        usage = _usage(outs)
        chosen = _best_of(outs, n, gen.n) if gen.outputs.best_of else outs
        if all(out.finish is not None for out in outs):  # whole, its client still there
            for out in chosen:  # its choices are judged (the candidates dropped are not)
                out.judge_slo()
        choices = []
        for out in chosen:
            text = (out.echo or "") + "".join(out.text)
            logprobs = logprobs_of(out, ctx.pieces)
            if gen.kind == "completion":
                choice: dict[str, Any] = {"index": out.index, "text": text,
                                          "logprobs": logprobs, "finish_reason": out.finish}
            else:
                choice = {"index": out.index,
                          "message": {"role": "assistant", "content": text, "refusal": None},
                          "logprobs": logprobs, "finish_reason": out.finish}
            if gen.return_token_ids:
                choice["token_ids"] = list(out.tokens)
                if gen.kind == "completion":  # as vLLM: a choice's own prompt
                    choice["prompt_token_ids"] = list(out.prompt)
            choices.append(choice)
        obj = "text_completion" if gen.kind == "completion" else "chat.completion"
        body = {"id": rid, "object": obj, **head, "choices": choices, "usage": usage}
        return Response(_dumps(body), media_type="application/json")

    def _client_message(error: Optional[str]) -> Optional[str]:
        """The engine's reason for a refusal without the Python exception class it names
        (`ValueError: ...`): a client reads the reason."""
        if error is None:
            return None
        head, sep, rest = error.partition(": ")
        return rest if sep and head.isidentifier() and head.endswith("Error") else error

    async def _open_all(rid: str, gen: GenerationRequest, prompts: list[list[int]],
                        budgets: list[int], samplings: list[Any],
                        arrival_us: float) -> list[Subscription]:
        """Every prompt's subscription once the scheduler queued them all; if it refused one,
        the others are cancelled and closed before the error is raised."""
        loop = asyncio.get_running_loop()
        inbox = Inbox(loop)  # the choices are waited for together
        subs: list[Subscription] = []
        try:
            for i, (tokens, max_tokens, sampling) in enumerate(zip(prompts, budgets,
                                                                   samplings)):
                subs.append(runner.open(EngineRequest(_engine_id(rid, i, len(prompts)),
                                                      tokens, max_tokens,
                                                      arrival_us=arrival_us,
                                                      sampling=sampling,
                                                      priority=gen.priority,
                                                      ttft_ms=gen.ttft_ms,
                                                      itl_ms=planned_gap_ms(gen.itl_ms)),
                                        loop, inbox))
            rejections = [await sub.verdict for sub in subs]
        except EngineUnavailable as exc:
            _abandon(subs)
            raise unavailable(str(exc)) from None
        except BaseException:  # (the client left while the verdicts were awaited, say)
            _abandon(subs)
            raise
        refused = [r for r in rejections if r is not None]
        if refused:
            _abandon(subs)
            if refused[0].rejection is RejectReason.QUEUE_FULL:
                raise queue_full("The server is busy: its waiting queue is full; retry later.")
            raise RequestError(_client_message(refused[0].error) or "the request was refused")
        return subs

    def _abandon(subs: list[Subscription]) -> None:
        for sub in subs:
            runner.cancel(sub.request_id)
            runner.close(sub)

    def _failure(out: _Generation) -> RequestError:
        if out.sub.out_of_memory:  # the device was full, not the request wrong: retry later
            return unavailable(out.error or "the device ran out of memory")
        if ctx.shutting_down:  # the engine stopped under it: the server's state, not the request's
            return unavailable(out.error or "the engine stopped")
        return internal(out.error or "the request failed")

    def _close_all(outs: list[_Generation]) -> None:
        for out in outs:
            if out.held:  # ended (or gone) before its first token
                out.release_hold()
            if out.finish is None or out.finish == "stop":
                # Gone before the end, or stopped on a string: the engine may still run it.
                runner.cancel(out.sub.request_id)
            if out.finish is None and not out.failed_beside:  # the client left first
                ctx.metrics.request_success.labels("abort").inc()
            runner.close(out.sub)

    async def _collect(request: Request, outs: list[_Generation]) -> None:
        watcher = asyncio.ensure_future(_wait_disconnect(request.receive))
        try:
            async with aclosing(_batches(outs, watcher)) as wakeups:
                async for got in wakeups:
                    for out, events in got:
                        text, _ = out.feed(events)
                        out.text.append(text)
        finally:
            watcher.cancel()

    return app


def _check_grammar(check: Callable[[str], None], grammar: str) -> None:
    """A 400 unless the host's grammar sampler parses `grammar` (serve/structured.py)."""
    try:
        check(grammar)
    except ValueError as exc:
        raise RequestError(f"'response_format' gives a grammar llama.cpp cannot use: {exc}",
                           param="response_format") from None


def _check_fit(ctx: ServeContext, gen: GenerationRequest, prompt: int, prompt_field: str) -> int:
    """The request's max_tokens, or a 400 when it could never run (docs: a lane holds
    `n_ctx_seq` tokens; a memory component must hold the request's reservation)."""
    limit = ctx.n_ctx_seq
    if prompt == 0:
        raise RequestError("the prompt is empty", param=prompt_field)
    if prompt >= limit:
        raise RequestError(
            f"This model's maximum context length is {limit} tokens, but the prompt has "
            f"{prompt} tokens, which leaves no room to generate.", param=prompt_field,
            code="context_length_exceeded")
    if gen.max_tokens is None:
        max_tokens = (limit - prompt if gen.kind == "chat" or gen.rest_of_lane
                      else min(16, limit - prompt))
    else:
        # A scored prompt (max_tokens 0) runs to its first token, which is not answered (as
        # vLLM scores one): it needs a place for that token.
        max_tokens = max(gen.max_tokens, 1)
        if prompt + max_tokens > limit:
            name = gen.max_tokens_field
            raise RequestError(
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {prompt + max_tokens} tokens ({prompt} in the prompt, "
                f"{max_tokens} for the completion). Please reduce the prompt or "
                f"'{name}'.", param=name, code="context_length_exceeded")
    for component in ctx.memory_components:
        need = component.reservation_bytes(prompt + max_tokens)
        if need > component.available_bytes():
            raise RequestError(
                f"the request needs {need} of memory component {component.name!r}, which "
                f"holds {component.available_bytes()}: it could never be admitted",
                param=gen.max_tokens_field if gen.max_tokens is not None else prompt_field)
    return max_tokens
