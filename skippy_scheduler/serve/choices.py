"""Several choices in one answer: one engine request per choice (a completions request's
prompts, times `n`), their events merged as they arrive, usage summed.

With `n` > 1 choice j of a prompt samples with seed `seed + j` (mod 2**64): choice 0 is the
request itself, choice j the same request sent alone with `seed + j`. (An unseeded request drew
its seed when parsed, so its choices differ as well.) A greedy request's choices are equal.

A choice is the app's `_Generation`: it has `sub` (the engine subscription), `finish` (None
while running), `index` and `usage()`.
"""
from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, AsyncGenerator, Optional, Sequence

from ..sampling import SamplingParams

_U64 = (1 << 64) - 1


def choice_sampling(sampling: Optional[SamplingParams], j: int) -> Optional[SamplingParams]:
    """The sampling of choice `j` of a prompt: its own seed stream, `seed + j`."""
    if sampling is None or j == 0 or sampling.seed is None:
        return sampling
    return dataclasses.replace(sampling, seed=(sampling.seed + j) & _U64)


def usage(outs: Sequence[Any]) -> dict[str, Any]:
    """Usage summed over the choices (the prompt tokens' details too)."""
    total = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    cached = 0
    for out in outs:
        one = out.usage()
        for key in total:
            total[key] += one[key]
        cached += one.get("prompt_tokens_details", {}).get("cached_tokens", 0)
    return dict(total, prompt_tokens_details={"cached_tokens": cached})


async def batches(outs: Sequence[Any], stop: Optional[asyncio.Future[None]] = None,
                  ) -> AsyncGenerator[list[tuple[Any, list[Any]]], None]:
    """At each wake-up, the new events of every choice that got some, in index order, until
    every choice has finished (or `stop` is done: the client left, and the caller cancels the
    rest). The choices' subscriptions share one inbox (`EngineRunner.open`), so one wait covers
    them all, however many there are."""
    inbox = outs[0].sub.inbox
    if stop is not None:
        stop.add_done_callback(lambda _: inbox._fire())
    live = [out for out in outs if out.finish is None]
    while live:
        await inbox.wait([out.sub for out in live])
        if stop is not None and stop.done():
            return
        got = []
        for out in live:
            events = out.sub.take()
            if events:
                got.append((out, events))
        if got:
            yield got  # the consumer feeds them: a choice that ended has its finish set
            live = [out for out in live if out.finish is None]
