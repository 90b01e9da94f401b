"""The most requests of a trace slice any server could bring within a TTFT bound on this CPU.

    python bench/trace_bound.py --trace $TRACES/mooncake-fast25-conversation_trace.jsonl \\
        --max-requests 200 --time-scale 1.5 --model bench-58m.gguf --ttft 2,3,4,5

(`$TRACES`: the folder holding the public Mooncake conversation trace, docs/measuring.md.)

The slice and its scaled lengths are `trace_load.py`'s (the same options, so the requests are
the ones the replay sends). A request can only get its first token after its unshared prompt
tokens were prefilled, and prefill on one CPU is serial. The bound relaxes everything else in
the server's favour:

- decoding costs nothing, and neither does a step's fixed cost (a pass over the weights);
- every token a request shares with an earlier request of the slice is free, even when that
  request arrived at the same instant and has not run yet;
- each group of requests that arrive at the same instant (the trace's bursts) is served as if
  nothing else were on the machine: work left over from earlier arrivals is ignored.

Within one group, all released together under one deadline, serving the cheapest prompts first
brings the most of them within it (any other choice can be exchanged for it without losing one),
and splitting prompts into chunks or preempting does not help. So the count below is an upper
bound on what any schedule on this kernel can reach; a real server, which also decodes and pays
a pass per step, gets fewer.

A prompt token's cost grows with its position (it attends to every earlier token), so the cost
of a prompt's unshared tokens, at positions `s` to `n - 1`, is `a` a token plus `b` a token per
earlier position: `a (n - s) + b (s + ... + n - 1)`. Both are measured on the model with
llama.cpp (`--model`; the fastest of three of each pass: `b` from a 256-token pass at position
512 against one at position 0, `a` from a 256- against a 128-token pass at position 0, so the
pass's own fixed cost is left out) or given (`--token-ms` for `a`, `--position-us` for `b`,
0 unless given).

Prints, for each bound in `--ttft`, the share of the slice's requests that could meet it, and
appends the same as one JSON object to `--json`.
"""
from __future__ import annotations

import argparse
import math
import sys
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Sequence

from skippy_bench import open_loop
from skippy_bench.llama_context import LlamaContext
from skippy_bench.reports import append_line


@dataclass(frozen=True)
class PrefillCost:
    """What prefilling a prompt's tokens costs on one machine, without a pass's fixed cost."""

    token_s: float  # each token (`a`)
    position_s: float = 0.0  # each token, per earlier position it attends to (`b`)

    def prompt_s(self, start: int, end: int) -> float:
        """Seconds to prefill the tokens at positions `start` .. `end - 1`."""
        n = end - start
        return n * self.token_s + self.position_s * (start + end - 1) * n / 2


def group_bound(costs: Sequence[float], ttft_s: float) -> int:
    """How many of a group released together can finish their prefill (`costs`, seconds each),
    one at a time, within `ttft_s`: the cheapest first."""
    done, clock = 0, 0.0
    for cost in sorted(costs):
        clock += cost
        if clock > ttft_s:
            break
        done += 1
    return done


def attainment_bound(plan: Sequence[open_loop.Planned], cost: PrefillCost,
                     ttft_s: float) -> int:
    """The upper bound (module docstring) on requests of `plan` within `ttft_s`."""
    groups: dict[float, list[float]] = defaultdict(list)
    for p in plan:
        start = min(p.shared_tokens, p.prompt_tokens - 1)  # at least the last token is prefilled
        groups[p.at_s].append(cost.prompt_s(start, p.prompt_tokens))
    return sum(group_bound(g, ttft_s) for g in groups.values())


def measure_prefill_cost(model: str, threads: int) -> PrefillCost:
    """`a` and `b` (module docstring) of `model` on llama.cpp, f32 KV, one sequence."""
    c = LlamaContext(model, threads, n_seq=1, n_ctx=1024, name="trace_bound")

    def prefill(start: int, n: int) -> float:
        """One pass of `n` tokens at positions `start`.., after the ones before it (untimed)."""
        c.clear(0)
        if start:
            c.decode([(0, 0, start)])
        return c.decode([(0, start, n)])

    try:
        prefill(0, 64)  # warm up
        short = min(prefill(0, 128) for _ in range(3))
        near = min(prefill(0, 256) for _ in range(3))
        far = min(prefill(512, 256) for _ in range(3))
    finally:
        c.close()
    # near - short = 128 a + b (128 + ... + 255); far - near = b * 256 * 512
    b = max(far - near, 0.0) / (256 * 512)
    a = max(near - short - b * (128 + 255) * 128 / 2, 1e-12) / 128
    return PrefillCost(a, b)


def build_parser() -> argparse.ArgumentParser:
    ap = open_loop.build_parser((__doc__ or "").split("\n\n")[0])
    for action in ap._actions:  # the slice options are trace_load's; no server is asked
        if action.dest == "url":
            action.required = False
    ap.add_argument("--token-ms", type=float, default=None,
                    help="prefill cost per token in ms (default: measured with --model)")
    ap.add_argument("--position-us", type=float, default=None,
                    help="prefill cost per token per earlier position in µs (default: measured "
                         "with --model; 0 with --token-ms)")
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp threads (with --model)")
    ap.add_argument("--ttft", default="1,2,3,4,5", metavar="S,...",
                    help="TTFT bounds in seconds")
    return ap


def parse_bounds(ap: argparse.ArgumentParser, text: str) -> list[float]:
    try:
        bounds = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--ttft takes seconds separated by commas, got {text!r}")
    if not bounds or not all(math.isfinite(b) and b > 0 for b in bounds):
        ap.error(f"--ttft bounds must be finite numbers > 0, got {text!r}")
    return bounds


def main(argv: Sequence[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.url is None:
        args.url = "http://127.0.0.1:9"
    open_loop.check_args(ap, args)
    bounds = parse_bounds(ap, args.ttft)
    if args.token_ms is None and args.model is None:
        ap.error("give --model GGUF (to measure the prefill cost) or --token-ms")
    if args.token_ms is not None and not (math.isfinite(args.token_ms) and args.token_ms > 0):
        ap.error(f"--token-ms must be a finite number > 0, got {args.token_ms}")
    if args.position_us is not None:
        if args.token_ms is None:
            ap.error("--position-us goes with --token-ms (without them both are measured)")
        if not (math.isfinite(args.position_us) and args.position_us >= 0):
            ap.error(f"--position-us must be a finite number >= 0, got {args.position_us}")
    if args.threads < 1:
        ap.error(f"--threads must be >= 1, got {args.threads}")
    plan = open_loop.plan_requests(args)
    measured = args.token_ms is None
    if measured:
        cost = measure_prefill_cost(args.model, args.threads)
    else:
        cost = PrefillCost(args.token_ms / 1e3, (args.position_us or 0.0) / 1e6)
    groups = len({p.at_s for p in plan})
    biggest = max(sum(1 for q in plan if q.at_s == p.at_s) for p in plan)
    longest = max(p.prompt_tokens for p in plan)
    print(f"{len(plan)} requests in {groups} arrival groups (largest {biggest}), prefill "
          f"{cost.token_s * 1e3:.3f} ms a token + {cost.position_s * 1e6:.3f} µs a token per "
          f"earlier position" + (" (measured)" if measured else "") +
          f": a {longest}-token prompt {cost.prompt_s(0, longest):.3f} s")
    rows: list[dict[str, Any]] = []
    for b in bounds:
        n = attainment_bound(plan, cost, b)
        rows.append({"ttft_s": b, "within": n, "pct": 100.0 * n / len(plan)})
        print(f"  TTFT <= {b:g} s: at most {n} of {len(plan)} ({100.0 * n / len(plan):.1f} %)")
    append_line({"trace": args.trace, "start_s": args.start_s, "max_requests": args.max_requests,
                 "time_scale": args.time_scale, "requests": len(plan),
                 "token_ms": cost.token_s * 1e3, "position_us": cost.position_s * 1e6,
                 "bounds": rows}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
