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

The requests and the loop are `skippy_bench.loads`'s. `write-model` writes the random-weight
f32 LLaMA of the comparison (58.5 M parameters: vocab 32000, 512 wide, 8 layers, 8 heads, FFN
1408, context 2048).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys

from skippy_bench.loads import LOAD_DEFAULTS, run_load
from skippy_bench.models import write_bench_model
from skippy_bench.reports import emit


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write-model", help="write the bench model", allow_abbrev=False)
    w.add_argument("path")
    w.add_argument("--seed", type=int, default=0)
    r = sub.add_parser("run", help="run the load against a server", allow_abbrev=False)
    D = LOAD_DEFAULTS
    r.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    r.add_argument("--label", default="", help="name of the server in the output")
    r.add_argument("--model", default=None,
                   help="model field sent with each request (default: none, the served one)")
    r.add_argument("--concurrency", type=int, default=D["concurrency"])
    r.add_argument("--requests", type=int, default=D["requests"])
    r.add_argument("--prompt-tokens", type=int, default=D["prompt_tokens"])
    r.add_argument("--shared-prefix", type=int, default=D["shared_prefix"])
    r.add_argument("--shared-fraction", type=float, default=D["shared_fraction"])
    r.add_argument("--max-tokens", type=int, default=D["max_tokens"])
    r.add_argument("--seed", type=int, default=D["seed"])
    r.add_argument("--timeout", type=float, default=D["timeout"])
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
        write_bench_model(args.path, args.seed)
        return 0
    emit(asyncio.run(run_load(args)), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
