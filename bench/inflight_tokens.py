"""Tokens/s of `skippy-scheduler run` at depth 1 and 2 on a model whose decode takes ms.

Writes a random-weight f32 LLaMA of about 29 M parameters (vocabulary 4 096, 8 layers of width
512) once, then runs the same prompts through `skippy-scheduler run` with `--inflight 1` and
`--inflight 2`, alternating, and prints each run's generated tokens/s and their ratio. At depth 2
the engine makes the next plan and completes the previous one while llama_decode runs on the
host's worker thread.

Run: python bench/inflight_tokens.py [--model PATH] [--rounds 3] [--threads 2]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

from skippy_bench.models import small_model
from skippy_bench.servers import run_summary


def run_once(model: str, depth: int, prompts: str, out: str, threads: int, max_active: int,
             max_tokens: int) -> dict:
    return run_summary(["--model", model, "--prompts", prompts, "--max-tokens", str(max_tokens),
                        "--max-active", str(max_active), "--threads", str(threads),
                        "--inflight", str(depth), "--mixed", "--max-consecutive-prefill", "0"],
                       out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--model", default=os.path.join(tempfile.gettempdir(), "skippy-29m-f32.gguf"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-active", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args(argv)
    model = small_model(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        prompts = os.path.join(tmp, "prompts.json")
        with open(prompts, "w", encoding="utf-8") as fh:
            json.dump([[1] + [(17 * i + 5 * k) % 4000 + 3 for k in range(24 + 8 * (i % 4))]
                       for i in range(16)], fh)
        rates: dict[int, list[float]] = {1: [], 2: []}
        for r in range(args.rounds):
            for depth in (1, 2):
                s = run_once(model, depth, prompts, os.path.join(tmp, f"r{depth}.json"),
                             args.threads, args.max_active, args.max_tokens)
                rates[depth].append(s["tokens_per_s"])
                print(f"round {r} depth {depth}: {s['generated_tokens']} tokens, "
                      f"{s['tokens_per_s']:.1f} tok/s, {s['iterations']} iterations",
                      file=sys.stderr)
    m1, m2 = statistics.median(rates[1]), statistics.median(rates[2])
    print(f"depth 1: {m1:.1f} tok/s, depth 2: {m2:.1f} tok/s (median of {args.rounds}); "
          f"depth 2 / depth 1 = {m2 / m1:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
