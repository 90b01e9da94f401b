"""Where preemption for priority spends work: counts, not times, on one schedule.

    python bench/priority_counts.py                      # the tiny model (seconds)
    python bench/priority_counts.py --model bench-58m.gguf --json counts.jsonl

In process, on one `LlamaHost` configured as `skippy-scheduler serve` configures it (lanes,
a KV stream of `--lane-cells` per lane and per holder, the serve defaults for chunking and
mixing), the same closed-loop load as `priority_load.py run` but clocked in engine steps:
`--background` clients, each submitting its next priority-0 request (`--prompt-tokens`,
`--background-tokens`) when the previous one ends, and after `--settle` steps `--urgent`
priority-10 requests (`--urgent-prompt-tokens`, `--urgent-tokens`), one every
`--urgent-interval` steps. The clients stop after `--background-requests` in all, so every mode
does the same work (choose it so that the background still saturates the lanes when the last
urgent request ends: `urgent_done_step` at most `saturated_until_step`). The schedule is the
same for every mode and no wall clock is read, so the counts are the same on any machine (the
tokens too: greedy, equal alone or batched). Plans are prefill-only or decode-only by default,
as `serve` plans under this load (its mixed plans stop once one with a long prefill slowed
decoding past the margin of docs/behaviour.md §2.6); `--mixed` keeps mixed plans (durations
from the cost model's virtual clock).

Modes: preemption with the prefix store (the serve default with `--prefix-cache-tokens`),
admission order with the same store, admission order without one. Reported per mode: steps,
batch entries decoded, those per output token, prefill / recompute / restored tokens,
preemptions, sampling rows discarded, whole-stream KV copies (each moves a lane's
`--lane-cells` cells: the copies into holders when a sequence lets go of its lane and back
when a row restores from one), lane-steps left idle while requests waited, and the urgent
requests' TTFT in steps (p50 / max), and, over the window of `priority_load.py` counted in steps
(`--urgent` x `--urgent-interval` + `--drain-steps` from the first urgent arrival), the
background's tokens per step and the prefill-only steps (every running stream paused); the old
window (to the last urgent end) beside it. The extra work of preemption is the difference
between the first two modes inside the window; the whole run's `steps` also hold the drain of
the last requests on few lanes, whose length depends on how the lanes' ends line up, not on
the work.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
from typing import Any

from skippy_bench.reports import emit

MODES = (("preempt", True, True), ("admission-order-reuse", False, True),
         ("admission-order", False, False))


def run_mode(args, model: str, preemption: bool, reuse: bool) -> dict[str, Any]:
    from skippy_scheduler import Scheduler, SchedulerConfig
    from skippy_scheduler.engine import Engine, FinishEvent, Request, TokenEvent, VirtualClock
    from skippy_scheduler.cost_model import LAB_COST
    from skippy_scheduler.hosts.llama import LlamaHost
    from skippy_scheduler.sampling import SamplingParams

    holders = args.prefix_holders if reuse else 0
    with LlamaHost(model, n_ctx=(args.lanes + holders) * args.lane_cells, n_seq_max=args.lanes,
                   n_threads=args.threads, n_batch=512,
                   prefix_cache_tokens=args.prefix_cache_tokens if reuse else 0,
                   prefix_holders=max(holders, 1)) as host:
        config = SchedulerConfig(
            max_active_sequences=args.lanes, max_waiting_sequences=4 * args.background,
            max_tokens_per_iteration=host.n_batch, prefill_chunk_tokens=min(256, host.n_batch),
            mixed_prefill_decode=True, max_consecutive_prefill_iterations=1,
            priority_preemption=preemption,
            **(host.sequence_id_settings if reuse else {"reserved_sequence_ids": 0}))
        sched = Scheduler(config)
        # Without a clock no duration is observed, so mixed planning never starts: every plan
        # is prefill-only or decode-only, as in `serve` once a mixed plan with a long prefill
        # has slowed decoding past its margin (docs/behaviour.md §2.6) -- this load's case. With
        # `--mixed` a virtual clock charges the cost model's durations, under which mixing stays.
        clock = VirtualClock(LAB_COST) if args.mixed else None
        engine = Engine(sched, host, clock=clock, record=False)

        def prompt(n: int, key: int) -> list[int]:  # BOS, then random tokens of the vocabulary
            rng = random.Random(args.seed * 1_000_003 + key)
            return [1] + [rng.randrange(3, host.n_vocab) for _ in range(n - 1)]

        urgent_prompts = [prompt(args.urgent_prompt_tokens, -1 - j) for j in range(args.urgent)]
        ended: list[str] = []
        first_token: dict[str, int] = {}
        end_step: dict[str, int] = {}
        tokens_of: dict[str, int] = {}
        output_tokens = [0]
        bg_per_step: list[int] = []  # background tokens sampled at each step

        def listen(event: Any) -> None:
            if isinstance(event, FinishEvent):
                ended.append(event.request_id)
                end_step[event.request_id] = engine.iterations
            elif isinstance(event, TokenEvent):
                output_tokens[0] += 1
                tokens_of[event.request_id] = tokens_of.get(event.request_id, 0) + 1
                if event.request_id.startswith("bg"):
                    while len(bg_per_step) <= engine.iterations:
                        bg_per_step.append(0)
                    bg_per_step[engine.iterations] += 1
                first_token.setdefault(event.request_id, engine.iterations)

        engine.add_listener(listen)
        greedy = SamplingParams(temperature=0.0, ignore_eos=True)  # as the load: every token
        sent: dict[str, int] = {}
        next_bg = 0

        def background() -> None:
            nonlocal next_bg
            rid = f"bg{next_bg}"
            engine.submit(Request(rid, prompt(args.prompt_tokens, next_bg), args.background_tokens,
                                  priority=0, sampling=greedy))
            next_bg += 1

        for _ in range(args.background):
            background()
        urgent_done = 0
        idle_lane_steps = step = 0
        urgent_done_step = saturated_until = 0
        prefill_only: list[int] = []
        while engine.outstanding:
            k = step - args.settle
            if 0 <= k < args.urgent * args.urgent_interval and k % args.urgent_interval == 0:
                j = k // args.urgent_interval
                rid = f"urgent{j}"
                sent[rid] = engine.iterations
                engine.submit(Request(rid, urgent_prompts[j], args.urgent_tokens, priority=10,
                                      sampling=greedy))
            decoded = sched.metrics().decode_tokens
            engine.step()
            step += 1
            m = sched.metrics()
            if m.decode_tokens == decoded:
                prefill_only.append(step - 1)  # no decode row: every running stream paused
            if m.waiting_sequences:
                idle_lane_steps += args.lanes - m.active_sequences
                saturated_until = step
            for rid in ended:
                if rid.startswith("urgent"):
                    urgent_done += 1
                    urgent_done_step = step
                elif next_bg < args.background_requests:
                    background()  # closed loop: the client sends its next request
            ended.clear()
            if step > args.max_steps:
                raise RuntimeError(f"no end after {step} steps")
        m = sched.metrics()
        ttft = [first_token[r] - sent[r] for r in sent if r in first_token]
        first = min(sent.values())
        span = args.urgent * args.urgent_interval + args.drain_steps
        old_span = max(urgent_done_step - first, 1)
        sched.attach_prefix_store(None)
        return {
            "steps": m.iterations, "output_tokens": output_tokens[0],
            "decoded_entries": host.decoded_tokens,
            "entries_per_output_token": host.decoded_tokens / max(output_tokens[0], 1),
            "prefill_tokens": m.prefill_tokens, "recompute_tokens": m.recompute_tokens,
            "restored_tokens": m.restored_tokens, "decode_tokens": m.decode_tokens,
            "preemptions_priority": m.preempted_priority,
            "preemptions_memory": m.preempted - m.preempted_priority,
            "discarded_rows": m.discarded_rows, "kv_stream_copies": host.host_state().kv_copies,
            "kept_prefixes": host.kept_prefixes, "idle_lane_steps": idle_lane_steps,
            "background_requests": next_bg, "urgent_done_step": urgent_done_step,
            "saturated_until_step": saturated_until,
            # Background tokens per step over [first urgent sent, last urgent done] (the old
            # window of priority_load.py) and over the fixed window of `span` steps.
            "background_per_step_old_window": sum(bg_per_step[first:first + old_span]) / old_span,
            "background_per_step_fixed_window": sum(bg_per_step[first:first + span]) / span,
            "fixed_window_steps": span, "old_window_steps": old_span,
            "prefill_only_steps_in_window": sum(1 for k in prefill_only
                                                if first <= k < first + span),
            # The old script's estimate: each request's tokens spread evenly over its life.
            "background_per_step_old_window_spread": sum(
                n * max(0, min(end_step[r], first + old_span) - max(first_token[r], first))
                / max(end_step[r] - first_token[r], 1)
                for r, n in tokens_of.items() if r.startswith("bg")) / old_span,
            "urgent_ttft_steps_p50": statistics.median(ttft) if ttft else None,
            "urgent_ttft_steps_max": max(ttft) if ttft else None,
        }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--model", default=None, help="GGUF (default: the tiny random model)")
    ap.add_argument("--lanes", type=int, default=8)
    ap.add_argument("--lane-cells", type=int, default=1024)
    ap.add_argument("--prefix-cache-tokens", type=int, default=8192)
    ap.add_argument("--prefix-holders", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--background", type=int, default=16)
    ap.add_argument("--background-requests", type=int, default=96,
                    help="background requests in all (the same work in every mode)")
    ap.add_argument("--background-tokens", type=int, default=256)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--urgent", type=int, default=20)
    ap.add_argument("--urgent-tokens", type=int, default=16)
    ap.add_argument("--urgent-prompt-tokens", type=int, default=64)
    ap.add_argument("--urgent-interval", type=int, default=24, metavar="STEPS")
    ap.add_argument("--settle", type=int, default=48, metavar="STEPS")
    ap.add_argument("--drain-steps", type=int, default=96, metavar="STEPS",
                    help="the fixed window's tail after the last urgent arrival")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-steps", type=int, default=100_000)
    ap.add_argument("--mixed", action="store_true",
                    help="plans that mix prefill and decode (the cost model's virtual clock)")
    ap.add_argument("--json", help="append each mode's counts as one JSON line to this file")
    args = ap.parse_args(argv)
    if args.background_requests < args.background:
        ap.error(f"--background-requests ({args.background_requests}) must be at least "
                 f"--background ({args.background}): each client sends one request first")
    with tempfile.TemporaryDirectory(prefix="priority-counts-") as tmp:
        model = args.model
        if model is None:
            from skippy_scheduler.hosts.tiny_model import write_tiny_llama
            model = str(write_tiny_llama(os.path.join(tmp, "tiny-f32.gguf"), seed=7))
        for label, preemption, reuse in MODES:
            out = {"label": f"counts {label}", **run_mode(args, model, preemption, reuse)}
            emit(out, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
