"""The endpoints and metric names routers expect of a vLLM replica, and llama-server's own.

vLLM's router (`vllm-router`), llm-d and dashboards built for vLLM call more than the OpenAI
API: `vllm-router --policy kv_aware` posts each request to `/v1/completions/render` (or
`/v1/chat/completions/render`) to learn its token ids, falling back to `/tokenize`, and scores
the replicas' KV events against them; dashboards and load-aware policies read `vllm:` metrics.
`install(app, ctx)` adds, beside the server's own routes:

* `POST /v1/completions/render`: a list with one vLLM `GenerateRequest` (`request_id`,
  `token_ids`, `sampling_params`, `model`, `stream`, ...) for the body, which is validated as
  `/v1/completions` validates it, and tokenized the same way, so the ids are the ones the
  prompt will run with (and match the KV events);
* `POST /v1/chat/completions/render`: that object for a chat body (the chat template applied);
* `POST /tokenize` (`prompt` or `messages`; answers `count`, `max_model_len`, `tokens`) and
  `POST /detokenize` (`tokens`; answers `prompt`, and llama-server's `content` beside it);
  `/tokenize` with llama-server's `content` (and its `add_special`, `parse_special`,
  `with_pieces`) answers as llama-server does, `{"tokens": [...]}`;
* `GET /props`: llama-server's properties that clients and its web UI read (`total_slots`,
  `default_generation_settings.n_ctx`, `model_path`, `chat_template`, `modalities`,
  `build_info`);
* `GET /v1/models/{id}`: the served model, or a 404 naming the id;
* metrics under vLLM's names, labelled `model_name` and `engine` as vLLM labels them:
  `vllm:num_requests_running`, `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc` (0-1),
  `vllm:prefix_cache_queries` and `vllm:prefix_cache_hits` (counters of prompt tokens: looked
  up in the prefix store, and found there; per admitted sequence, so each choice of `n` counts,
  as each of vLLM's child requests does), read from the same `EngineStats` as the `skippy:`
  ones.
"""
from __future__ import annotations

import asyncio
import json
import uuid
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.responses import Response

from .body import decode_json, read_body
from .errors import RequestError
from .protocol import GenerationRequest, parse_chat, parse_completion

if TYPE_CHECKING:  # pragma: no cover
    from .app import ServeContext

__all__ = ["install", "sampling_params"]


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def _json(obj: Any) -> Response:
    return Response(_dumps(obj), media_type="application/json")


def _reader(ctx: "ServeContext") -> Any:
    """Bodies read as the server's own routes read them: within its size and time limits,
    decoded on a worker thread with its checks (depth, lone surrogates)."""

    async def body(request: Request) -> Any:
        raw = await read_body(request, ctx.limits.max_body_bytes, ctx.limits.body_timeout_s)
        return await asyncio.to_thread(decode_json, raw)

    return body


def sampling_params(gen: GenerationRequest) -> dict[str, Any]:
    """The request's sampling as vLLM's `SamplingParams` fields name it (greedy: temperature
    0)."""
    s = gen.sampling
    out: dict[str, Any] = {"n": 1, "max_tokens": gen.max_tokens, "stop": list(gen.stop),
                           "stop_token_ids": sorted(gen.stop_token_ids),
                           "include_stop_str_in_output": gen.include_stop_str_in_output,
                           "min_tokens": gen.min_tokens, "skip_special_tokens": True}
    if s is None:
        out.update(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, seed=None,
                   presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0,
                   ignore_eos=False)
    else:
        out.update(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, min_p=s.min_p,
                   seed=s.seed, presence_penalty=s.presence_penalty,
                   frequency_penalty=s.frequency_penalty,
                   repetition_penalty=s.repetition_penalty, ignore_eos=s.ignore_eos)
        if s.logit_bias:
            out["logit_bias"] = {str(k): v for k, v in s.logit_bias.items()}
    return out


class _VllmCollector:
    """The engine's figures under vLLM's metric names."""

    def __init__(self, ctx: "ServeContext") -> None:
        self._ctx = ctx

    def collect(self):  # type: ignore[no-untyped-def]
        s = self._ctx.runner.stats
        labels = ["model_name", "engine"]
        values = [self._ctx.model_name, "0"]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(values, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(values, value)
            return c

        yield gauge("vllm:num_requests_running", "Requests running (in the active set).",
                    s.running)
        yield gauge("vllm:num_requests_waiting", "Requests waiting to be admitted.", s.waiting)
        # As vLLM counts it, prefix-cache cells no request holds are free: the share of what
        # the lanes may hold (1: they are full).
        yield gauge("vllm:kv_cache_usage_perc", "KV cache usage (1 means 100 percent).",
                    s.kv_tokens / s.kv_lane_capacity if s.kv_lane_capacity else 0.0)
        yield counter("vllm:prefix_cache_queries",
                      "Prompt tokens looked up in the prefix cache, per admitted sequence "
                      "(each choice of n): those found plus those computed.",
                      s.restored_tokens + s.prefill_tokens)
        yield counter("vllm:prefix_cache_hits",
                      "Prompt tokens found in the prefix cache (a whole-prompt hit counts its "
                      "last token, computed again for its logits, here and as computed).",
                      s.restored_tokens)
        yield counter("vllm:num_preemptions", "Preemptions.", s.preemptions)


def install(app: FastAPI, ctx: "ServeContext") -> None:
    """Add the routes and metrics above to the server's `app` (whose context is `ctx`)."""
    from .access import served_model
    from .app import _check_fit

    ctx.metrics.registry.register(_VllmCollector(ctx))
    _body = _reader(ctx)

    def completion_tokens(prompt: Any) -> list[int]:
        if isinstance(prompt, str):
            return list(ctx.host.tokenize(prompt, special=True))
        return list(prompt)

    def one_choice(gen: GenerationRequest) -> GenerationRequest:
        if gen.n != 1:  # a rendered request is one sequence per prompt
            raise RequestError("'n' must be 1 on a render route (one sequence per prompt)",
                               param="n")
        return gen

    def chat_tokens(gen: GenerationRequest) -> list[int]:
        return list(ctx.host.tokenize(ctx.chat.render(gen.messages), special=True))

    def generate_request(gen: GenerationRequest, tokens: list[int],
                         prefix: str) -> dict[str, Any]:
        return {"request_id": f"{prefix}-{uuid.uuid4().hex}", "token_ids": tokens,
                "sampling_params": sampling_params(gen), "model": gen.model or ctx.model_name,
                "stream": gen.stream, "priority": gen.priority, "token_offsets": None}

    @app.post("/v1/completions/render")
    async def render_completion(request: Request) -> Response:
        gen = one_choice(parse_completion(await _body(request), ctx.n_vocab,
                                          ctx.strict_request_fields))
        gen.model = served_model(ctx.model_names, gen.model)  # as the generation routes
        prompts = [await asyncio.to_thread(completion_tokens, p) for p in gen.prompts]
        for tokens in prompts:
            _check_fit(ctx, gen, len(tokens), "prompt")
        return _json([generate_request(gen, tokens, "cmpl") for tokens in prompts])

    @app.post("/v1/chat/completions/render")
    async def render_chat(request: Request) -> Response:
        gen = one_choice(parse_chat(await _body(request), ctx.n_vocab,
                                    ctx.strict_request_fields))
        gen.model = served_model(ctx.model_names, gen.model)
        tokens = await asyncio.to_thread(chat_tokens, gen)
        _check_fit(ctx, gen, len(tokens), "messages")
        return _json(generate_request(gen, tokens, "chatcmpl"))

    def flag(body: dict[str, Any], name: str, default: bool) -> bool:
        value = body.get(name, default)
        if not isinstance(value, bool):
            raise RequestError(f"'{name}' must be a boolean", param=name)
        return value

    def llama_server_tokens(body: dict[str, Any]) -> dict[str, Any]:
        """llama-server's /tokenize: `content`, BOS only with `add_special` (default false),
        special tokens parsed unless `parse_special` is false; pieces with `with_pieces` (the
        text when it is UTF-8, else its bytes)."""
        if not isinstance(body["content"], str):
            raise RequestError("'content' must be a string", param="content")
        add, special = flag(body, "add_special", False), flag(body, "parse_special", True)
        pieces = flag(body, "with_pieces", False)
        tokens = list(ctx.host.tokenize(body["content"], add_bos=None if add else False,
                                        special=special))
        if not pieces:
            return {"tokens": tokens}

        def piece(t: int) -> Any:
            raw = ctx.pieces[t]
            try:
                return raw.decode("utf-8")
            except UnicodeDecodeError:
                return list(raw)
        return {"tokens": [{"id": t, "piece": piece(t)} for t in tokens]}

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        body = await _body(request)
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object")
        if body.get("content") is not None and body.get("prompt") is None:
            return _json(await asyncio.to_thread(llama_server_tokens, body))
        if body.get("messages") is not None:
            gen = parse_chat({"messages": body["messages"]}, ctx.n_vocab)
            tokens = await asyncio.to_thread(chat_tokens, gen)
        elif isinstance(body.get("prompt"), str):
            add = flag(body, "add_special_tokens", True)
            tokens = list(await asyncio.to_thread(
                ctx.host.tokenize, body["prompt"], add_bos=None if add else False, special=True))
        else:
            raise RequestError("'prompt' (a string), 'messages' or llama-server's 'content' is "
                               "required", param="prompt")
        return _json({"count": len(tokens), "max_model_len": ctx.n_ctx_seq, "tokens": tokens,
                      "token_strs": None})

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        body = await _body(request)
        tokens = body.get("tokens") if isinstance(body, dict) else None
        if not isinstance(tokens, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < ctx.n_vocab
                for t in tokens):
            raise RequestError(f"'tokens' must be an array of token ids in [0, {ctx.n_vocab})",
                               param="tokens")
        text = b"".join(ctx.pieces[t] for t in tokens).decode("utf-8", "replace")
        return _json({"prompt": text, "content": text})

    @app.get("/props")
    async def props() -> Response:
        from .._version import __version__

        return _json({
            "default_generation_settings": {"n_ctx": ctx.n_ctx_seq},
            "total_slots": ctx.lanes, "model_path": ctx.model_name,
            "model_alias": ctx.model_name,
            "chat_template": ctx.chat.text if ctx.chat.text is not None else ctx.chat.source,
            "modalities": {"vision": False, "audio": False},
            "build_info": f"skippy-scheduler {__version__}"})

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Response:
        if model_id not in ctx.model_names:  # (the 404 of a request naming it)
            raise RequestError(f"The model `{model_id}` does not exist.", status=404,
                               param="model", code="model_not_found")
        return _json(ctx.model_card(model_id))
