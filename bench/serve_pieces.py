"""What each piece of the streaming path costs per token, timed alone (no network, no threads).

    python bench/serve_pieces.py [--number 20000] [--rows 64] [--json FILE]

`serve_overhead.py` measures the whole server; this splits a streamed token's CPU time into its
pieces, each timed in a loop on this thread (best of `--repeat` rounds of `--number` calls, in
µs per call), so the split holds on a busy machine better than a load run does:

- engine thread: `TokenEvent` (the engine's event per sample), `deliver` (the runner's
  listener: the subscription's queue and the step's wake-up list), `flush` (the hand-over of a
  step with `--rows` requests, per request);
- event loop: `feed` (a generation takes one token: detokenisation, the TTFT/ITL histograms,
  the token lists), `detok` (the incremental UTF-8 decoder alone), `itl_observe` (one histogram
  observation alone), `chunk_template` / `chunk_object` (one text chunk from the prebuilt
  template, and encoded from its object as before), `h11_data` (h11's framing of one body write);
- scheduler: `plan_complete` (one `plan_iteration` + `complete_iteration` of `--rows` decode
  rows, per row), on the native core;
- llama.cpp host (with llama-cpp-python installed): `greedy_pick` (the host's pick for greedy
  rows that never end on an end token, as the bench loads ask, over a 32 000-token
  vocabulary, per row of a step of `--rows`), between two decodes when the host samples.

The costs not here: the event loop's own wake-ups and task switches, the ASGI layers of a write
(starlette's wrappers, uvicorn's send), the socket write itself (a system call per write).
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import timeit
from typing import Any, Callable, Optional

from skippy_bench.reports import emit


def _best(fn: Callable[[], Any], number: int, repeat: int) -> float:
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6


def measure(number: int, repeat: int, rows: int) -> dict[str, Any]:
    import h11

    from instant_host import InstantHost, build_server
    from skippy_scheduler import Scheduler, SchedulerConfig, Sequence
    from skippy_scheduler.engine import TokenEvent
    from skippy_scheduler.serve import ServeSettings
    from skippy_scheduler.serve.generation import Generation
    from skippy_scheduler.serve.protocol import parse_completion
    from skippy_scheduler.serve.runner import Subscription
    from skippy_scheduler.serve.stream import Chunks
    from skippy_scheduler.serve.text import Detokenizer

    out: dict[str, Any] = {"number": number, "repeat": repeat, "rows": rows}
    server = build_server(ServeSettings(max_active=rows), InstantHost(n_seq_max=rows))
    ctx, runner = server.app.state.ctx, server.runner
    loop = asyncio.new_event_loop()
    token = 3 + ord("a")
    gen = parse_completion({"model": "instant", "prompt": "a b", "stream": True,
                            "max_tokens": 1 << 30}, ctx.n_vocab)
    subs = [Subscription(f"r{i}", loop, 0.0) for i in range(rows)]
    for s in subs:
        runner._subs[s.request_id] = s
    out["token_event_us"] = _best(lambda: TokenEvent("r0", token, 1.0), number, repeat)
    event = TokenEvent("r0", token, 1.0)

    def deliver() -> None:
        runner._deliver(event)
        subs[0]._items.clear()
        subs[0].inbox._queued = False
        runner._touched.clear()

    out["deliver_us"] = _best(deliver, number, repeat)
    events = [TokenEvent(s.request_id, token, 1.0) for s in subs]

    def flush() -> None:  # a step: every request's token, then the hand-over (nobody waits)
        for e in events:
            runner._deliver(e)
        runner._flush()
        for s in subs:
            s._items.clear()

    out["deliver_and_flush_per_row_us"] = _best(flush, max(1, number // rows), repeat) / rows
    generation = Generation(ctx, subs[0], gen, 3)
    feeds = iter([[TokenEvent("r0", token, float(i))] for i in range(number * repeat + 1)])
    out["feed_us"] = _best(lambda: generation.feed(next(feeds)), number, repeat)
    detok = Detokenizer(ctx.pieces)
    out["detok_us"] = _best(lambda: detok.add(token), number, repeat)
    itl = ctx.metrics.itl
    out["itl_observe_us"] = _best(lambda: itl.observe(0.001), number, repeat)
    head = {"id": "cmpl-" + "0" * 32, "created": 1700000000, "model": "instant"}
    enc = Chunks(gen, head)
    out["chunk_template_us"] = _best(lambda: enc.text(0, "a"), number, repeat)
    out["chunk_object_us"] = _best(lambda: enc.chunk("a", [token], None), number, repeat)
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
    conn.next_event()
    conn.next_event()
    conn.send(h11.Response(status_code=200, headers=[("content-type", "text/event-stream")]))
    body = enc.text(0, "a")
    out["h11_data_us"] = _best(lambda: conn.send(h11.Data(data=body)), number, repeat)
    config = SchedulerConfig(max_active_sequences=rows, max_waiting_sequences=rows,
                             max_tokens_per_iteration=max(512, rows), prefill_chunk_tokens=256,
                             reserved_sequence_ids=0)
    sched = Scheduler(config)
    for i in range(rows):
        sched.submit(Sequence(f"s{i}", [1, 2, 3], 1 << 20))
    first = sched.plan_iteration()
    first.outputs.request_indexes[:len(first)] = range(len(first))
    first.outputs.predicted_tokens[:len(first)] = token
    first.outputs.count = len(first)
    sched.complete_iteration(first)

    def step() -> None:
        plan = sched.plan_iteration()
        k = len(plan)
        o = plan.outputs
        o.request_indexes[:k] = plan.sample_rows
        o.predicted_tokens[:k] = token
        o.count = k
        sched.complete_iteration(plan)

    out["plan_complete_per_row_us"] = _best(step, max(1, number // rows), repeat) / rows
    loop.close()
    pick = _greedy_pick(rows)
    if pick is not None:
        out["greedy_pick_per_row_us"] = _best(pick, max(1, number // rows), repeat) / rows
    return out


def _greedy_pick(rows: int, n_vocab: int = 32000) -> Optional[Callable[[], None]]:
    """One step's host pick of `rows` greedy rows with `ignore_eos` (None without
    llama-cpp-python)."""
    try:
        from skippy_scheduler.hosts.llama.samplers import Samplers
    except ImportError:
        return None
    import numpy as np

    from skippy_scheduler.sampling import SamplingParams

    eog_ids = np.array([2], dtype=np.int32)
    eog = np.zeros(n_vocab, dtype=np.bool_)
    eog[eog_ids] = True
    samplers = Samplers(n_vocab, eog, eog_ids)
    params = samplers.resolve(SamplingParams(temperature=0.0, ignore_eos=True))
    for lane in range(rows):
        samplers.start(lane, params)
    logits = np.random.default_rng(0).standard_normal((rows, n_vocab)).astype(np.float32)
    logits[:, eog_ids] = -1.0  # the rows' argmax is not an end token, as it seldom is
    tokens = logits.argmax(axis=1).astype(np.int32)
    lanes = np.arange(rows, dtype=np.int32)
    positions = np.zeros(rows, dtype=np.int32)
    return lambda: samplers.pick(None, tokens, logits, None, lanes, lanes, lanes, positions)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--number", type=int, default=20000, help="calls per round")
    ap.add_argument("--repeat", type=int, default=5, help="rounds (the best is reported)")
    ap.add_argument("--rows", type=int, default=64, help="requests in a step")
    ap.add_argument("--json", help="append the result as one JSON line to this file")
    args = ap.parse_args(argv)
    if args.number < 1 or args.repeat < 1 or args.rows < 1:
        ap.error("need --number, --repeat and --rows >= 1")
    emit(measure(args.number, args.repeat, args.rows), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
