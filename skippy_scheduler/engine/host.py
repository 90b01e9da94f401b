"""`CostModelHost`: the model-free host of the lab, the benchmarks and the tests.

The contract every host implements (two verbs, optional capabilities) is in
engine/contract.py; docs/hosts.md describes it for runtime authors.
"""
from __future__ import annotations

from typing import Optional

from ..types import ReleaseReason
from .contract import Plan


class CostModelHost:
    """A stand-in runtime: samples a fixed token (or echoes each row's last input token).

    `token=None` makes the "model" predict each sampling row's last input token, which keeps a
    token that a workload planted at the end of a prompt flowing through the decode rows. The
    host itself takes no time: run it under `VirtualClock(cost_model)`, which charges each plan.
    """

    def __init__(self, token: Optional[int] = 1) -> None:
        if token is not None and (isinstance(token, bool) or not isinstance(token, int)):
            raise TypeError(f"token must be an int or None, got {type(token).__name__}")
        self.token = token

    def execute(self, plan: Plan) -> None:
        rows = plan.sample_rows
        k = len(rows)
        out = plan.outputs
        out.request_indexes[:k] = rows
        if self.token is None:
            if k == len(plan) and plan.token_count == k:
                out.predicted_tokens[:k] = plan.tokens  # one token per row (decode)
            elif k:
                out.predicted_tokens[:k] = plan.tokens[plan.row_offsets[1:][rows] - 1]
        else:
            out.predicted_tokens[:k] = self.token
        out.count = k

    def release(self, sequence_id: str,
                reason: ReleaseReason = ReleaseReason.FINISHED) -> None:
        return None
