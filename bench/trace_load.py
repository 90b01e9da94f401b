"""Open-loop trace load for OpenAI-compatible completion servers (this one, llama-server, vLLM).

    python bench/trace_load.py --url http://127.0.0.1:8301 \\
        --trace $TRACES/mooncake-fast25-conversation_trace.jsonl \\
        --start-s 600 --time-scale 4 --max-requests 200 --json trace.jsonl

(`$TRACES`: the folder holding the public Mooncake conversation trace, docs/measuring.md.)
Requests arrive when the trace says, whether or not earlier ones have finished (open loop):
the trace is read with the package's importer (`skippy_scheduler.lab.traces`), the rows from
`--start-s` seconds into the trace (for `--duration-s`, at most `--max-requests`) are replayed
from the slice's first arrival, with every gap multiplied by `--time-scale`. Lengths are scaled
down to what a small CPU model serves: prompt tokens × `--input-scale` within [`--min-input`,
`--max-input`] (BOS included), output tokens × `--output-scale` within [1, `--max-output`].

Prefix sharing follows the trace's `hash_ids`: each 512-token block of the trace becomes a run
of `--block-tokens` words (default 512 × input scale) drawn from the block id alone, and a
prompt is its blocks' runs in order, cut to its scaled length. Requests that share leading block
ids therefore share exactly those token prefixes, and nothing else. Words are single letters,
one token each on the bench model's SPM vocabulary (as in `serve_load.py`), so every server
sees the same token ids. Requests stream, greedy, with `ignore_eos` (a server without it gets
`--extra '{"logit_bias": {"2": -100}}'`).

Reported (one JSON object, appended to `--json`): the SLO (a request meets it when its TTFT is
at most `--ttft-slo-s` and its `--itl-stat` inter-token gap at most `--itl-slo-s`; in ms, as
`serve` is told it, `--slo-ttft-ms` and `--slo-itl-ms`), requests within it (attainment % of
those sent), goodput (requests and output tokens per second of the replay's wall time, of
requests within it), the misses by reason (`slo_missed_ttft`: only the first token late,
`slo_missed_gaps`: only a gap over, `slo_missed_both`, `slo_missed_unserved`: failed, a 503
of a server that sheds included, or cut off), the requests refused with a 503
(`refused_503`), p50/p99 TTFT and inter-token gap, max gap, stalls (gaps above the ITL target)
per request, output tokens/s, offered vs achieved load, and how late the client sent
(a generator that cannot keep up shows here, not in the server's figures). `serve_load.py`
defines the measures of one request (`skippy_bench.loads.one` sends each request here; the
replay itself is `skippy_bench.open_loop`).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Optional

from skippy_bench import open_loop
from skippy_bench.reports import emit


def build_parser() -> argparse.ArgumentParser:
    return open_loop.build_parser((__doc__ or "").split("\n\n")[0])


def main(argv: Optional[list[str]] = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    open_loop.check_args(ap, args)
    plan = open_loop.plan_requests(args)
    outcomes, wall = asyncio.run(open_loop.replay(plan, args))
    emit(open_loop.report(plan, outcomes, wall, args), args.json)
    if args.requests_out:
        with open(args.requests_out, "w", encoding="utf-8") as fh:
            fh.writelines(json.dumps(row) + "\n" for row in open_loop.request_rows(outcomes, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
