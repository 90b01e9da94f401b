"""The client side of a load: one streamed `/v1/completions` request and what it measured, and
the closed loop (clients that each send their next request when the previous one ends).

Prompts are text of single-letter words, which the bench model's SPM vocabulary turns into one
token per word, so every server sees the same token ids. Requests are greedy (`temperature` 0)
with `ignore_eos` (a server without the field ignores it: give it `extra` `{"logit_bias":
{"2": -100}}` to ban the end token). A request's tokens are its final `usage` when the server
sends one, else `max_tokens` when it finished on length, else its chunks with text (`token_ids`
per chunk counts exactly, this server's extension).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import string
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import httpx

from .reports import percentile

# `serve_load.py run`'s options and defaults: what `run_load` reads.
LOAD_DEFAULTS: dict[str, Any] = dict(
    label="", model=None, concurrency=16, requests=64, prompt_tokens=512, shared_prefix=384,
    shared_fraction=0.5, max_tokens=64, seed=0, timeout=600.0, token_ids=False, extra={},
    warmup=True, outputs=False, drain=False)


def make_prompts(n: int, tokens: int, shared_prefix: int, shared_fraction: float,
                 seed: int) -> list[str]:
    """Text prompts of `tokens` tokens (BOS + one token per single-letter word)."""
    rng = random.Random(seed)
    words = tokens - 1
    prefix = [rng.choice(string.ascii_lowercase) for _ in range(shared_prefix - 1)]
    out = []
    n_shared = round(n * shared_fraction)
    for i in range(n):
        if i < n_shared:
            body = prefix + [rng.choice(string.ascii_lowercase)
                             for _ in range(words - len(prefix))]
        else:
            body = [rng.choice(string.ascii_lowercase) for _ in range(words)]
        out.append(" ".join(body))
    # Interleave shared and private prompts so both kinds arrive throughout the run.
    rng.shuffle(out)
    return out


@dataclass
class Result:
    ok: bool = False
    status: int = 0
    sent: float = 0.0
    first: float = 0.0
    end: float = 0.0
    tokens: int = 0
    gaps: list[float] = field(default_factory=list)
    error: str = ""
    text: str = ""  # the generated text, the chunks' in order


def request_args(max_tokens: int, model: Optional[str] = None, token_ids: bool = False,
                 extra: Optional[dict] = None) -> argparse.Namespace:
    """What `one` reads of its arguments, for one request."""
    return argparse.Namespace(max_tokens=max_tokens, model=model, token_ids=token_ids,
                              extra=dict(extra or {}))


async def one(client: httpx.AsyncClient, prompt: str, args) -> Result:
    """One streamed completion of `prompt`: when it was sent, its first chunk, the gaps between
    chunks, its end, its tokens and text (`args`: max_tokens, model, token_ids, extra, and
    optionally drain: read the body to its end so the connection is kept)."""
    body = {"prompt": prompt, "max_tokens": args.max_tokens,
            "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    if args.model is not None:
        body["model"] = args.model
    if args.token_ids:
        body["return_token_ids"] = True
    body.update(args.extra)
    res = Result(sent=time.perf_counter())
    last = None
    counted = 0
    usage = None
    finish = None
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            res.status = r.status_code
            if r.status_code != 200:
                res.error = (await r.aread()).decode("utf-8", "replace")[:200]
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    if getattr(args, "drain", False):
                        continue  # read to the end of the body: the connection is kept alive
                    break
                chunk = json.loads(data)
                if chunk.get("usage"):
                    usage = chunk["usage"]
                choices = chunk.get("choices") or []
                if not choices:
                    continue
                c = choices[0]
                if c.get("finish_reason"):
                    finish = c["finish_reason"]
                res.text += c.get("text") or ""
                n = len(c["token_ids"]) if "token_ids" in c else (1 if c.get("text") else 0)
                if n == 0:
                    continue
                now = time.perf_counter()
                if last is None:
                    res.first = now
                else:
                    res.gaps.append(now - last)
                last = now
                counted += n
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
        return res
    res.end = time.perf_counter()
    if usage and usage.get("completion_tokens"):
        res.tokens = usage["completion_tokens"]
    elif finish == "length":
        # A length finish means max_tokens were generated, whatever text the chunks carried
        # (a token that ends inside a UTF-8 character streams no text of its own).
        res.tokens = args.max_tokens
    else:
        res.tokens = counted
    res.ok = res.first > 0
    return res


def client(url: str, timeout: float, connections: int,
           keepalive: Optional[int] = None) -> httpx.AsyncClient:
    """An HTTP client for `connections` requests at once (`keepalive` of them kept open:
    default all)."""
    limits = httpx.Limits(max_connections=connections,
                          max_keepalive_connections=connections if keepalive is None
                          else keepalive)
    return httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits)


def errors(results: Sequence[Optional[Result]]) -> list[str]:
    """The first five distinct failures (status and error) among `results`."""
    return sorted({f"{r.status} {r.error}" for r in results if r is not None and not r.ok})[:5]


async def closed_loop(c: httpx.AsyncClient, prompts: Sequence[str], args,
                      concurrency: int) -> tuple[list[Result], float]:
    """Every prompt sent by `concurrency` clients, each sending its next when its previous one
    ended; the results in prompt order and the wall time from the first send to the last end."""
    queue: asyncio.Queue = asyncio.Queue()
    for item in enumerate(prompts):
        queue.put_nowait(item)
    results: list = [None] * len(prompts)

    async def worker() -> None:
        while not queue.empty():
            i, prompt = queue.get_nowait()
            results[i] = await one(c, prompt, args)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results, time.perf_counter() - t0


async def run_load(args) -> dict:
    """`serve_load.py run`: the closed loop of `args` (the options of LOAD_DEFAULTS, and url)
    against one server; its figures as one result."""
    results, wall = await load_results(args)
    return load_result(args, results, wall)


async def load_results(args) -> tuple[list[Result], float]:
    """The closed loop of `args` (after its warm-up request when asked): every request's
    `Result`, in prompt order, and the loop's wall time."""
    prompts = make_prompts(args.requests, args.prompt_tokens, args.shared_prefix,
                           args.shared_fraction, args.seed)
    async with client(args.url, args.timeout, args.concurrency) as c:
        if args.warmup:
            await one(c, prompts[0][: len(prompts[0]) // 8], argparse.Namespace(
                **{**vars(args), "max_tokens": 4}))
        return await closed_loop(c, prompts, args, args.concurrency)


def load_result(args, results: Sequence[Result], wall: float) -> dict:
    """`run_load`'s result: the outputs when `args.outputs`, and `load_figures`."""
    outputs = ({"outputs": [r.text if r.ok else None for r in results]}
               if getattr(args, "outputs", False) else {})
    return {**outputs, **load_figures(args, results, wall)}


def decode_window(results: Sequence[Optional[Result]]) -> Optional[tuple[float, float]]:
    """Of one wave of requests (all sent at once, none sent after): the stretch in which every
    one of them was decoding, from the last first token to the first last token (each
    request's chunks arrive at `first` and its gaps after; `time.perf_counter` seconds); None
    when a request failed or the stretch is empty."""
    done = [r for r in results if r is not None and r.ok]
    if not done or len(done) < len(results):
        return None
    start = max(r.first for r in done)
    end = min(r.first + sum(r.gaps) for r in done)
    return (start, end) if end > start else None


def chunks_within(results: Sequence[Optional[Result]], start: float, end: float) -> int:
    """How many streamed chunks with tokens arrived in (`start`, `end`]: each request's first
    chunk at `first`, the next ones its gaps after it."""
    n = 0
    for r in results:
        if r is None or not r.ok:
            continue
        t = r.first
        n += start < t <= end
        for g in r.gaps:
            t += g
            n += start < t <= end
    return n


def load_figures(args, results: Sequence[Result], wall: float) -> dict:
    """A closed loop's figures (`run_load`'s keys but the outputs): what `args` asked and what
    the `results` of its requests measured over `wall` seconds."""
    good = [r for r in results if r.ok]
    tokens = sum(r.tokens for r in good)
    ttft = [r.first - r.sent for r in good]
    gaps = [g for r in good for g in r.gaps]
    chunks = sum(len(r.gaps) + 1 for r in good if r.first)  # the streamed chunks with tokens
    return {
        "label": args.label, "url": args.url, "concurrency": args.concurrency,
        "requests": args.requests, "completed": len(good),
        "errors": errors(results),
        "prompt_tokens": args.prompt_tokens, "shared_prefix": args.shared_prefix,
        "shared_fraction": args.shared_fraction, "max_tokens": args.max_tokens,
        "output_tokens": tokens, "short_outputs": sum(r.tokens < args.max_tokens for r in good),
        "token_chunks": chunks, "tokens_per_chunk": tokens / chunks if chunks else None,
        "wall_s": wall, "output_tokens_per_s": tokens / wall,
        "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
        "itl_p50_s": percentile(gaps, 50), "itl_p99_s": percentile(gaps, 99),
    }


def load_args(url: str, label: str = "", **given: Any) -> argparse.Namespace:
    """`run_load`'s arguments: LOAD_DEFAULTS with `given` over them."""
    unknown = set(given) - set(LOAD_DEFAULTS)
    if unknown:
        raise TypeError(f"load_args: no option {sorted(unknown)}")
    return argparse.Namespace(**{**LOAD_DEFAULTS, "extra": {}, **given, "url": url,
                                 "label": label})


def closed_args(args: argparse.Namespace, url: str, label: str, c: int) -> argparse.Namespace:
    """The comparison rounds' closed loop at concurrency `c` (serve_rounds.py, gpu_rounds.py):
    half the prompts share the prefix, the served model is `bench`, every output is kept."""
    return load_args(url, label, model="bench", concurrency=c, requests=args.requests,
                     prompt_tokens=args.prompt_tokens, shared_prefix=args.shared_prefix,
                     max_tokens=args.max_tokens, seed=args.seed, timeout=args.timeout,
                     outputs=True)
