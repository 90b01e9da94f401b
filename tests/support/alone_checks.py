"""Checks of engine runs against each request's alone tokens, and the random memory spikes and
cancels that disturb them (tests of hosts that must give every request its alone tokens)."""
from __future__ import annotations

from typing import Any, Callable


def check_records(requests: list, records: list, alone: Callable[..., list[int]],
                  counters: dict, where: Any = None) -> None:
    """Every request got its alone tokens: all of them on a length finish, all but the end
    token on a stop, a prefix of them when cancelled. Counts the completed ones."""
    for req, res in zip(requests, records):
        expected = alone(req.prompt_tokens, req.max_tokens, req.sampling)
        if res.finish_reason == "cancelled":
            assert res.tokens == expected[:len(res.tokens)], (where, req.id)
        elif res.finish_reason == "stop":
            assert res.tokens + expected[len(res.tokens):][:1] == expected, (where, req.id)
            counters["completed"] += 1
        else:
            assert res.finish_reason == "length", (where, req.id, res.finish_reason)
            assert res.tokens == expected, (where, req.id)
            counters["completed"] += 1


def disturbances(rng: Any, scheduler: Any, reserved: dict[str, int], capacity: int,
                 p_preempt: float, p_cancel: float, counters: dict) -> Callable[[Any], None]:
    """A `before_step` hook: now and then a usage spike over `capacity` preempts a sequence
    (then the usage is reported as it is), now and then an open request is cancelled."""
    def disturb(engine: Any) -> None:
        if rng.random() < p_preempt:
            victims = engine.preempt([capacity + 1])
            active = scheduler.snapshot().active_ids
            engine.preempt([sum(reserved[a] for a in active)])
            counters["preempted"] += len(victims)
        if rng.random() < p_cancel:
            open_ids = engine.open_ids()
            if open_ids and engine.cancel(rng.choice(open_ids)):
                counters["cancelled"] += 1
    return disturb
