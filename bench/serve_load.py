"""Load benchmark for OpenAI-compatible completion servers (this one, llama.cpp's, others).

    python bench/serve_load.py write-model bench-58m.gguf
    python bench/serve_load.py run --url http://127.0.0.1:8000 --concurrency 16 --json out.json

`run` sends `--requests` streaming `/v1/completions` requests from `--concurrency` clients
that each send their next request when the previous one ends. Prompts are `--prompt-tokens`
tokens long (BOS included) and `--shared-fraction` of them start with the same
`--shared-prefix` tokens; every request asks for exactly `--max-tokens` tokens, greedy
(`temperature` 0) with `ignore_eos` (servers that do not know the field ignore it: give them
`--extra '{"logit_bias": {"2": -100}}'` to ban the end token; `short_outputs` counts requests
that stopped early). Prompts are text of single-letter words, which the
bench model's SPM vocabulary turns into one token per word, so every server sees the same
token ids.

Reported: output tokens/s over the run (tokens received / wall time from the first request
to the last end), TTFT p50/p99 (request sent → first token received) and the p99 inter-token
gap (between consecutive streamed chunks of a request), nearest-rank percentiles. A request's
tokens are its final `usage` when the server sends one, else `max_tokens` when it finished on
length, else its chunks with text (`token_ids` per chunk counts exactly, this server's
extension).

`write-model` writes the random-weight f32 LLaMA of the comparison (58.5 M parameters: vocab
32000, 512 wide, 8 layers, 8 heads, FFN 1408, context 2048).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import string
import sys
import time
from dataclasses import dataclass, field

import httpx


def percentile(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    v = sorted(values)
    return v[min(max(math.ceil(len(v) * p / 100) - 1, 0), len(v) - 1)]


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


async def one(client: httpx.AsyncClient, prompt: str, args) -> Result:
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


async def run_load(args) -> dict:
    prompts = make_prompts(args.requests, args.prompt_tokens, args.shared_prefix,
                           args.shared_fraction, args.seed)
    queue: asyncio.Queue = asyncio.Queue()
    for i, p in enumerate(prompts):
        queue.put_nowait((i, p))
    results: list[Result] = []
    by_prompt: list[Result | None] = [None] * len(prompts)
    limits = httpx.Limits(max_connections=args.concurrency,
                          max_keepalive_connections=args.concurrency)
    async with httpx.AsyncClient(base_url=args.url, timeout=args.timeout, limits=limits) as c:
        if args.warmup:
            await one(c, prompts[0][: len(prompts[0]) // 8], argparse.Namespace(
                **{**vars(args), "max_tokens": 4}))

        async def worker() -> None:
            while not queue.empty():
                i, prompt = queue.get_nowait()
                results.append(r := await one(c, prompt, args))
                by_prompt[i] = r

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        t1 = time.perf_counter()
    good = [r for r in results if r.ok]
    tokens = sum(r.tokens for r in good)
    ttft = [r.first - r.sent for r in good]
    gaps = [g for r in good for g in r.gaps]
    outputs = ({"outputs": [r.text if r is not None and r.ok else None for r in by_prompt]}
               if getattr(args, "outputs", False) else {})
    return {
        **outputs,
        "label": args.label, "url": args.url, "concurrency": args.concurrency,
        "requests": args.requests, "completed": len(good),
        "errors": sorted({f"{r.status} {r.error}" for r in results if not r.ok})[:5],
        "prompt_tokens": args.prompt_tokens, "shared_prefix": args.shared_prefix,
        "shared_fraction": args.shared_fraction, "max_tokens": args.max_tokens,
        "output_tokens": tokens, "short_outputs": sum(r.tokens < args.max_tokens for r in good),
        "wall_s": t1 - t0, "output_tokens_per_s": tokens / (t1 - t0),
        "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
        "itl_p50_s": percentile(gaps, 50), "itl_p99_s": percentile(gaps, 99),
    }


def emit(result: dict, path: str | None) -> None:
    """Print `result` as one JSON line, and append the line to `path` when one is given."""
    line = json.dumps(result)
    print(line)
    if path:
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(line + "\n")


def write_model(path: str, seed: int) -> None:
    from skippy_scheduler.hosts.tiny_model import TinyModelShape, parameter_count, write_tiny_llama

    shape = TinyModelShape(n_vocab=32000, n_embd=512, n_layer=8, n_head=8, n_head_kv=8,
                           n_ff=1408, context_length=2048, rope_dimension=64)
    write_tiny_llama(path, seed=seed, shape=shape)
    print(f"{path}: {parameter_count(shape) / 1e6:.1f} M parameters")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write-model", help="write the bench model", allow_abbrev=False)
    w.add_argument("path")
    w.add_argument("--seed", type=int, default=0)
    r = sub.add_parser("run", help="run the load against a server", allow_abbrev=False)
    r.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    r.add_argument("--label", default="", help="name of the server in the output")
    r.add_argument("--model", default=None,
                   help="model field sent with each request (default: none, the served one)")
    r.add_argument("--concurrency", type=int, default=16)
    r.add_argument("--requests", type=int, default=64)
    r.add_argument("--prompt-tokens", type=int, default=512)
    r.add_argument("--shared-prefix", type=int, default=384)
    r.add_argument("--shared-fraction", type=float, default=0.5)
    r.add_argument("--max-tokens", type=int, default=64)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--timeout", type=float, default=600)
    r.add_argument("--token-ids", action="store_true",
                   help="ask for token_ids per chunk (this server's extension) to count tokens")
    r.add_argument("--extra", type=json.loads, default={}, metavar="JSON",
                   help="fields merged into every request body, e.g. "
                        "'{\"logit_bias\": {\"2\": -100}}' for a server without ignore_eos")
    r.add_argument("--no-warmup", dest="warmup", action="store_false")
    r.add_argument("--outputs", action="store_true",
                   help="add each request's generated text, in prompt order, to the result")
    r.add_argument("--json", help="append the result as one JSON line to this file")
    args = ap.parse_args(argv)
    if args.cmd == "write-model":
        write_model(args.path, args.seed)
        return 0
    emit(asyncio.run(run_load(args)), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
