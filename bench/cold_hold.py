"""Prompt tokens a burst prefills with and without the cold prefix hold (behaviour.md §2.3a).

The first burst of `serve_load.py run --concurrency 16`: 16 requests arriving at once, 512
prompt tokens each, half of them sharing a 384-token prefix nobody has computed yet, on a
LlamaHost configured as `skippy-scheduler serve -np 16 -c 16384` configures it with its
defaults (reuse sized from the KV cache: 16 holders of 1 024 tokens, a KV stream per lane and
holder; chunk 256, batch 512; the slack rule at a 100 ms target, `--planning-rule reference`
for the reference's gate with mixed plans and one prefill plan in a row while decoding). The engine runs on a virtual clock: what is
reported are counts, which do not depend on the machine's load, so this runs anywhere:

    python bench/cold_hold.py [--model bench-58m.gguf] [--requests 16] [--inflight 2] [--json FILE]

With `--arrival-ms G` the requests arrive G ms apart on the virtual clock instead of at once,
so that most of a prefix's sharers arrive while an earlier one is decoding (a late leader,
§2.3a) rather than with it.

Per way (hold off, hold on): prompt tokens prefilled (the scheduler's prefill + recompute
tokens), restored, batch entries the host decoded, prompts kept early (`keep_prompt`), and the
burst's median and p99 time to first token on a virtual clock whose step times model the
58.5 M model on this CPU (MEDIUM below: a model, not a measurement). The tokens of every request are checked equal between the two ways.

Without `--model` a tiny random-weight model is written to a temporary directory.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile

from skippy_bench.reports import append_line, percentile
from skippy_scheduler import PlanningRule, Scheduler, SchedulerConfig, StepCost
from skippy_scheduler.cli._common import non_negative_ms
from skippy_scheduler.engine import Engine, Request, VirtualClock
from skippy_scheduler.hosts.llama import LlamaHost
from skippy_scheduler.hosts.tiny_model import write_tiny_llama
from skippy_scheduler.sampling import SamplingParams
from skippy_scheduler.serve.server import COLD_PREFIX_HOLD_TOKENS, default_reuse


# The 58.5 M-parameter model on this 2-core CPU, roughly (issue 20: about 0.57 ms per prompt
# token, 8.5-19 ms per decode step): the virtual clock's step times, for the modelled TTFT.
MEDIUM = StepCost(base_us=2000, per_prefill_token_us=570, decode_base_us=6000,
                  per_decode_row_us=700)


def burst(n: int, tokens: int, shared: int, fraction: float, vocab: int,
          seed: int) -> list[list[int]]:
    """serve_load.py's prompt mix as token ids: BOS, then a shared prefix or not, shuffled."""
    rng = random.Random(seed)
    prefix = [1] + [rng.randrange(3, vocab) for _ in range(shared - 1)]
    n_shared = round(n * fraction)
    out = []
    for i in range(n):
        head = prefix if i < n_shared else [1]
        out.append(head + [rng.randrange(3, vocab) for _ in range(tokens - len(head))])
    rng.shuffle(out)
    return out


def run_way(host: LlamaHost, prompts: list[list[int]], hold: int, max_tokens: int,
            lanes: int, inflight: int, rule: str, arrival_ms: float = 0.0) -> dict:
    config = SchedulerConfig(
        max_active_sequences=lanes, max_waiting_sequences=256 + lanes,
        max_tokens_per_iteration=host.n_batch, prefill_chunk_tokens=min(256, host.n_batch),
        mixed_prefill_decode=True, max_consecutive_prefill_iterations=1,
        planning_rule=PlanningRule.SLACK if rule == "slack" else PlanningRule.REFERENCE,
        itl_target=0.1,
        cold_prefix_hold_tokens=hold, max_inflight_plans=inflight,
        priority_preemption=True,  # on in serve; the hold must hold with it
        **host.sequence_id_settings)
    scheduler = Scheduler(config)
    decoded, keeps = host.decoded_tokens, host.holders.prompt_keeps
    engine = Engine(scheduler, host, clock=VirtualClock(MEDIUM), max_iterations=100000)
    greedy = SamplingParams(temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.submit(Request(f"r{i}", p, max_tokens, sampling=greedy,
                              arrival_us=i * arrival_ms * 1e3))
    report = engine.run()
    scheduler.attach_prefix_store(None)
    store = host.prefix_store
    while store.evict_one() is not None:  # the next way starts cold too
        pass
    m = scheduler.metrics()
    ttft = [(r.first_token_us - r.arrival_us) / 1e6 for r in report.records]
    return {"prefilled": m.prefill_tokens + m.recompute_tokens, "restored": m.restored_tokens,
            "decoded": host.decoded_tokens - decoded,
            "prompt_keeps": host.holders.prompt_keeps - keeps,
            "modelled_ttft_p50_s": percentile(ttft, 50),
            "modelled_ttft_p99_s": percentile(ttft, 99),
            "tokens": [r.tokens for r in report.records]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    ap.add_argument("--model", help="a GGUF (default: a tiny random model)")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--shared-prefix", type=int, default=384)
    ap.add_argument("--shared-fraction", type=float, default=0.5)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--lanes", type=int, default=16)
    ap.add_argument("--ctx-size", type=int, default=16384)
    ap.add_argument("--prefix-cache-tokens", type=int, default=None,
                    help="default: serve's, sized from the KV cache")
    ap.add_argument("--planning-rule", choices=("slack", "reference"), default="slack")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--inflight", type=int, default=1, help="plans in flight (serve --inflight)")
    ap.add_argument("--arrival-ms", type=non_negative_ms, default=0.0,
                    help="ms between arrivals on the virtual clock (default 0: one burst)")
    ap.add_argument("--json", help="append the result as one JSON line to this file")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or write_tiny_llama(os.path.join(tmp, "tiny.gguf"), seed=3)
        lane = args.ctx_size // args.lanes
        cache, holders = default_reuse(args.lanes, args.ctx_size)
        if args.prefix_cache_tokens is not None:
            cache = args.prefix_cache_tokens
        with LlamaHost(model, n_ctx=args.ctx_size + holders * lane, n_seq_max=args.lanes,
                       n_threads=args.threads, n_batch=512, prefix_cache_tokens=cache,
                       prefix_holders=holders) as host:
            prompts = burst(args.requests, args.prompt_tokens, args.shared_prefix,
                            args.shared_fraction, host.n_vocab, seed=0)
            ways = {name: run_way(host, prompts, hold, args.max_tokens, args.lanes,
                                  args.inflight, args.planning_rule, args.arrival_ms)
                    for name, hold in (("hold off", 0), ("hold on", COLD_PREFIX_HOLD_TOKENS))}
    same = ways["hold off"]["tokens"] == ways["hold on"]["tokens"]
    when = f"{args.arrival_ms:g} ms apart" if args.arrival_ms else "at once"
    print(f"{args.requests} requests x {args.prompt_tokens} prompt tokens arriving {when}, "
          f"{args.shared_fraction:.0%} sharing {args.shared_prefix}; outputs identical: {same}")
    print(f"{'way':10} {'prefilled':>10} {'restored':>9} {'decoded':>8} {'kept early':>10} "
          f"{'modelled TTFT s: p50':>21} {'p99':>6}")
    for name, w in ways.items():
        print(f"{name:10} {w['prefilled']:>10} {w['restored']:>9} {w['decoded']:>8} "
              f"{w['prompt_keeps']:>10} {w['modelled_ttft_p50_s']:>21.2f} "
              f"{w['modelled_ttft_p99_s']:>6.2f}")
    append_line({"args": vars(args), "identical": same,
                 **{k: {n: v for n, v in w.items() if n != "tokens"} for k, w in ways.items()}},
                args.json)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
