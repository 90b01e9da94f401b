"""Prefix KV reuse on a real model: FCFS without reuse, FCFS with reuse, cache-aware with reuse.

Reuse runs by default with a KV stream per lane and per holder (prefixes move by whole-stream
copies); two more ways run on one unified KV cache instead (holders share cells, but every
token's attention spans every sequence's cells), with and without reuse.

Writes a random-weight f32 LLaMA of about 29 M parameters (vocabulary 4 096, 8 layers of width
512; prefilling a few hundred tokens takes tens of milliseconds on 2 cores) once, and a
shared-prefix prompt set: G groups of R requests, each prompt a group's shared P-token prefix
followed by U tokens of its own, listed round-robin over the groups (so arrival order
interleaves them) and all arriving at once. Then it serves the set with `skippy-scheduler run`
five ways and prints, per way, the prompt tokens prefilled (prefill + recompute rows) and
restored, p50/p99 time to first token and the makespan.

The prefix cache holds fewer tokens than all the groups' prefixes together, so the order of
admission decides how much is reused: FCFS takes the groups in turn and evicts each prefix
before its group comes back; cache-aware admission runs a group's requests together (its
waiting-prefix grouping) and ranks resident prefixes first.

Run: python bench/prefix_reuse.py [--model PATH] [--threads 2] [--rounds 1] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile

from skippy_bench.models import small_model  # the same model as inflight_tokens.py
from skippy_bench.servers import run_summary

WAYS = (
    ("fcfs, no reuse", ["--policy", "fcfs"]),
    ("fcfs, reuse", ["--policy", "fcfs", "--prefix-cache-tokens", "{cache}"]),
    ("cache-aware, reuse", ["--policy", "cache-aware-aging", "--prefix-cache-tokens",
                            "{cache}"]),
    ("fcfs, no reuse, unified KV", ["--policy", "fcfs", "--kv-unified"]),
    ("cache-aware, reuse, unified KV", ["--policy", "cache-aware-aging", "--prefix-cache-tokens",
                                        "{cache}", "--kv-unified"]),
)


def prompt_set(groups: int, per_group: int, prefix: int, unique: int, seed: int = 5) -> list:
    rng = random.Random(seed)
    heads = [[1] + [rng.randrange(3, 4000) for _ in range(prefix - 1)] for _ in range(groups)]
    return [heads[g] + [rng.randrange(3, 4000) for _ in range(unique)]
            for _ in range(per_group) for g in range(groups)]


def run_once(model: str, prompts: str, out: str, extra: list[str], args) -> dict:
    return run_summary(["--model", model, "--prompts", prompts,
                        "--max-tokens", str(args.max_tokens),
                        "--max-active", str(args.max_active), "--threads", str(args.threads),
                        "-b", "512", "--prefill-chunk", "512",
                        # the planning these figures were measured with (run's defaults before
                        # serve's)
                        "--no-mixed", "--max-consecutive-prefill", "0", *extra], out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--model", default=os.path.join(tempfile.gettempdir(), "skippy-29m-f32.gguf"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1, help="runs of each way (medians shown)")
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--per-group", type=int, default=8)
    ap.add_argument("--prefix", type=int, default=384, help="shared prefix tokens per group")
    ap.add_argument("--unique", type=int, default=32, help="tokens of each prompt's own")
    ap.add_argument("--cache", type=int, default=1024, help="--prefix-cache-tokens")
    ap.add_argument("--max-active", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--json", metavar="FILE", help="write the figures here")
    args = ap.parse_args(argv)
    model = small_model(args.model)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        prompts = os.path.join(tmp, "prompts.json")
        data = prompt_set(args.groups, args.per_group, args.prefix, args.unique)
        with open(prompts, "w", encoding="utf-8") as fh:
            json.dump(data, fh)
        runs: dict[str, list[dict]] = {name: [] for name, _ in WAYS}
        for _ in range(args.rounds):
            for name, extra in WAYS:  # alternating ways, so drift hits each alike
                extra = [e.format(cache=args.cache) for e in extra]
                runs[name].append(run_once(model, prompts, os.path.join(tmp, "r.json"), extra,
                                           args))
        for name, _ in WAYS:
            def med(key: str) -> float:
                return statistics.median(r.get(key, 0) for r in runs[name])
            rows.append(dict(way=name, prefilled_tokens=med("prefilled_tokens"),
                             restored_tokens=med("restored_tokens"),
                             p50_ttft_ms=med("p50_ttft_us") / 1e3,
                             p99_ttft_ms=med("p99_ttft_us") / 1e3,
                             makespan_s=med("makespan_s"), evictions=med("evictions")))
    prompt_tokens = sum(len(p) for p in data)
    print(f"# {len(data)} requests ({args.groups} groups x {args.per_group}, {args.prefix}-token "
          f"shared prefix + {args.unique} own, {prompt_tokens} prompt tokens), "
          f"{args.max_tokens} generated each, max-active {args.max_active}, prefix cache "
          f"{args.cache} tokens, {args.threads} threads, median of {args.rounds}")
    print("| admission | prefilled tokens | restored tokens | p50 TTFT ms | p99 TTFT ms | "
          "makespan s | evictions |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['way']} | {r['prefilled_tokens']:.0f} | {r['restored_tokens']:.0f} | "
              f"{r['p50_ttft_ms']:.1f} | {r['p99_ttft_ms']:.1f} | {r['makespan_s']:.2f} | "
              f"{r['evictions']:.0f} |")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(dict(settings=vars(args), rows=rows), fh, indent=2)
            fh.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
