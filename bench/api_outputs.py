"""What the API's output fields cost on a running server: `n` choices sharing one prefill, and
log-probabilities per token.

    python bench/serve_load.py write-model bench-58m.gguf
    skippy-scheduler serve -m bench-58m.gguf -np 8 -c 16384 --port 8000 &
    python bench/api_outputs.py --url http://127.0.0.1:8000 --json api_outputs.json

Two comparisons, each over `--rounds` rounds run one after the other (nothing else should load
the machine):

* **n choices**: one request with `n` = `--n` choices of a `--prompt-tokens` prompt, against
  `--n` separate requests sent at once, each with a prompt of its own of the same length (the
  same work without anything to share: requests of one prompt admitted together are forked by
  this server's host as well). Reported: wall time per round and time to the first token of
  the last choice, and, from the server's `/metrics`, the batch entries it decoded and the ones
  a fork's KV copy replaced (this server only; other servers report none).
* **logprobs**: `--concurrency` streams of `--max-tokens` tokens without logprobs, then with
  `logprobs` = `--logprobs`; reported: output tokens/s of each and their ratio.

Prompts are text of single-letter words (one token each on the bench model, as in
serve_load.py); sampling is seeded (temperature 0.8) with `ignore_eos`, so every round does the
same work.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import string
import sys
import time
from typing import Any

import httpx


def _prompt(tokens: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(string.ascii_lowercase) for _ in range(tokens - 1))


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


async def _scrape(client: httpx.AsyncClient) -> tuple[float, float]:
    r = await client.get("/metrics")
    text = r.text if r.status_code == 200 else ""
    return (_metric(text, "skippy:decoded_tokens_total"),
            _metric(text, "skippy:shared_prefill_tokens_total"))


async def _stream(client: httpx.AsyncClient, body: dict[str, Any]) -> tuple[int, float, float]:
    """Tokens received (chunks with text or logprobs), time to the first, time to the end."""
    t0 = time.perf_counter()
    first = None
    tokens = 0
    async with client.stream("POST", "/v1/completions", json=dict(body, stream=True)) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                lp = choice.get("logprobs")
                ids = choice.get("token_ids")  # this server's extension: exact counts
                n = (len(ids) if ids is not None else len(lp["tokens"]) if lp
                     else 1 if choice.get("text") else 0)
                if n and first is None:
                    first = time.perf_counter() - t0
                tokens += n
    return tokens, first or 0.0, time.perf_counter() - t0


async def n_choices(client: httpx.AsyncClient, args: argparse.Namespace) -> dict[str, Any]:
    prompt = _prompt(args.prompt_tokens, 1)
    base = {"prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0.8,
            "ignore_eos": True, "return_token_ids": True}
    out: dict[str, Any] = {}
    for mode in ("n", "separate"):
        walls, decoded, shared = [], 0.0, 0.0
        for r in range(args.rounds):
            d0, s0 = await _scrape(client)
            t0 = time.perf_counter()
            if mode == "n":
                await _stream(client, dict(base, n=args.n, seed=100 * r))
            else:
                await asyncio.gather(*[_stream(client, dict(
                    base, seed=100 * r + j, prompt=_prompt(args.prompt_tokens, 2 + j)))
                    for j in range(args.n)])
            walls.append(time.perf_counter() - t0)
            await asyncio.sleep(0.2)  # the engine publishes its counters at its next step
            d1, s1 = await _scrape(client)
            decoded += d1 - d0
            shared += s1 - s0
        out[mode] = {"wall_s_mean": sum(walls) / len(walls), "wall_s_min": min(walls),
                     "decoded_tokens_per_round": decoded / args.rounds,
                     "shared_tokens_per_round": shared / args.rounds}
        print(f"n_choices {mode:9s} wall {out[mode]['wall_s_mean']:.3f} s (min "
              f"{out[mode]['wall_s_min']:.3f}), decoded {decoded / args.rounds:.0f}, "
              f"shared {shared / args.rounds:.0f} per round", flush=True)
    out["speedup"] = out["separate"]["wall_s_mean"] / out["n"]["wall_s_mean"]
    return out


async def logprobs(client: httpx.AsyncClient, args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for label, extra in (("plain", {}), ("logprobs", {"logprobs": args.logprobs})):
        t0 = time.perf_counter()
        total = 0
        for r in range(args.rounds):
            results = await asyncio.gather(*[
                _stream(client, {"prompt": _prompt(args.prompt_tokens, 1000 * r + c),
                                 "max_tokens": args.max_tokens, "temperature": 0.8,
                                 "seed": c, "ignore_eos": True, "return_token_ids": True,
                                 **extra})
                for c in range(args.concurrency)])
            total += sum(tokens for tokens, _, _ in results)
        wall = time.perf_counter() - t0
        out[label] = {"tokens": total, "wall_s": wall, "tokens_per_s": total / wall}
        print(f"logprobs  {label:9s} {total / wall:.1f} tok/s ({total} tokens in {wall:.2f} s)",
              flush=True)
    out["ratio"] = out["logprobs"]["tokens_per_s"] / out["plain"]["tokens_per_s"]
    return out


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=args.url, timeout=args.timeout) as client:
        result: dict[str, Any] = {"settings": vars(args)}
        if args.only in (None, "n"):
            result["n_choices"] = await n_choices(client, args)
        if args.only in (None, "logprobs"):
            result["logprobs"] = await logprobs(client, args)
        return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--n", type=int, default=4, help="choices per request (default 4)")
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--logprobs", type=int, default=5)
    p.add_argument("--only", choices=["n", "logprobs"])
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    result = asyncio.run(main_async(args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
