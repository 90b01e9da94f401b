"""A runtime of your own on the engine: implement `execute` and `release`, and run.

The two verbs are the `Host` contract of skippy_scheduler/engine/contract.py; a real runtime
sets a sequence's state up at its new row (`plan.new_rows`) and frees it at `release`, whose
reason says why (finished, preempted, cancelled, failed).

The "model" here predicts the row's last input token + 1 and ends a sequence (a negative
token) once it reaches 60; time is virtual, charged by a cost model, so the output is the same
on every machine. Run: python examples/engine_host.py
"""
from __future__ import annotations

from skippy_scheduler import Scheduler, SchedulerConfig
from skippy_scheduler.cost_model import LAB_COST
from skippy_scheduler.engine import (Engine, Event, Plan, ReleaseReason, Request, TokenEvent,
                                     VirtualClock)


class CountingHost:
    """Writes one output per sampling row into the plan's output block, as a runtime does."""

    def __init__(self) -> None:
        self.released: list[tuple[str, str]] = []

    def execute(self, plan: Plan) -> None:
        rows = plan.sample_rows
        last = plan.tokens[plan.row_offsets[1:][rows] - 1]  # each sampling row's last token
        nxt = last + 1
        nxt[nxt >= 60] = -1  # the end signal: the sequence finishes ("stop")
        out = plan.outputs
        out.request_indexes[: len(rows)] = rows
        out.predicted_tokens[: len(rows)] = nxt
        out.count = len(rows)

    def release(self, sequence_id: str, reason: ReleaseReason) -> None:
        # A real runtime frees the sequence's KV here.
        self.released.append((sequence_id, reason.value))


def main() -> None:
    config = SchedulerConfig(max_active_sequences=2, max_tokens_per_iteration=64,
                             prefill_chunk_tokens=16)
    host = CountingHost()
    engine = Engine(Scheduler(config), host, clock=VirtualClock(LAB_COST))
    streamed: list[int] = []

    def on_event(event: Event) -> None:
        if isinstance(event, TokenEvent) and event.request_id == "a":
            streamed.append(event.token)

    engine.add_listener(on_event)
    report = engine.run([
        Request("a", list(range(40, 50)), max_tokens=20, arrival_us=0),
        Request("b", list(range(20)), max_tokens=4, arrival_us=0),
        Request("c", [1, 2, 3], max_tokens=3, arrival_us=500),
    ])
    for r in report.records:
        print(f"{r.id}: {r.finish_reason:<6} tokens={r.tokens} ttft={r.ttft_us} µs "
              f"latency={r.latency_us} µs")
    print("streamed for a:", streamed)
    print("released:", host.released)
    summary = report.summary()
    print(f"{summary['iterations']} iterations, {summary['generated_tokens']} tokens, "
          f"makespan {summary['makespan_s'] * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
