"""Plans in flight: filling deferred input tokens from earlier plans' sampled outputs (§2.11).

A decode row whose input token is still being sampled by an earlier plan holds -1 in the plan's
token arena; the plan's deferred table says where the token will come from: row
`deferred_rows[j]` takes the token that plan step `deferred_source_steps[j]` sampled at work
index `deferred_source_indexes[j]`. A native host fills these on its device; a Python host calls
`resolve_deferred` once the earlier plans have run (their output blocks written) and before it
runs this one.
"""
from __future__ import annotations

from typing import Any, Iterable


def resolve_deferred(plan: Any, earlier_plans: Iterable[Any]) -> int:
    """Write every deferred input token of `plan` from `earlier_plans`' output blocks; returns
    how many were written. A source whose output is the end signal (or missing) ended its
    sequence: that row's output will be discarded, and its input is written as token 0 so the
    row is still a valid row for the runtime. Raises ValueError when a source plan is not given.
    """
    rows = plan.deferred_rows
    n = len(rows)
    if n == 0:
        return 0
    sources = {int(p.step): p for p in earlier_plans}
    steps = plan.deferred_source_steps.tolist()
    indexes = plan.deferred_source_indexes.tolist()
    targets = plan.row_offsets[rows]  # a decode row is one token: its first is its input
    tokens = plan.tokens
    by_step: dict[int, dict[int, int]] = {}
    for j, (step, index) in enumerate(zip(steps, indexes)):
        sampled = by_step.get(step)
        if sampled is None:
            source = sources.get(step)
            if source is None:
                raise ValueError(f"deferred input of row {int(rows[j])} comes from plan step "
                                 f"{step}, which is not among the earlier plans given")
            out = source.outputs
            k = int(out.count)
            sampled = dict(zip(out.request_indexes[:k].tolist(),
                               out.predicted_tokens[:k].tolist()))
            by_step[step] = sampled
        token = sampled.get(index, -1)
        tokens[int(targets[j])] = token if token >= 0 else 0
    return n


__all__ = ["resolve_deferred"]
