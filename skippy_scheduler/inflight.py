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

import numpy as np


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
    steps = np.asarray(plan.deferred_source_steps)
    indexes = np.asarray(plan.deferred_source_indexes).astype(np.intp)
    targets = np.asarray(plan.row_offsets)[np.asarray(rows)]  # a decode row's one token
    tokens = plan.tokens
    first = int(steps[0])
    # NOTE: the usual case (always at depth 2) is one source, the plan made just before.
    groups = [first] if n == 1 or (steps == first).all() else np.unique(steps).tolist()
    for step in groups:
        source = sources.get(int(step))
        if source is None:
            raise ValueError(f"deferred inputs come from plan step {step}, which is not among "
                             "the earlier plans given")
        out = source.outputs
        k = int(out.count)
        # Token sampled at each work index of the source plan; -1 where nothing was sampled.
        sampled = np.full(len(source), -1, dtype=np.int32)
        sampled[np.asarray(out.request_indexes[:k], dtype=np.intp)] = out.predicted_tokens[:k]
        if len(groups) == 1:
            values = sampled[indexes]
            tokens[targets] = np.maximum(values, 0)
        else:
            mine = steps == step
            tokens[targets[mine]] = np.maximum(sampled[indexes[mine]], 0)
    return n


__all__ = ["resolve_deferred"]
