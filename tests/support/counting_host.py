"""`CountingHost`: the engine tests' exact host (next token = last input token + 1), which
records every release, so a sequence whose runtime state is lost or released twice shows up."""
from __future__ import annotations


class CountingHost:
    """Next token = last input token + 1; `stop_at[id]` is the token value that ends that
    sequence; `skip` leaves one sampling row without an output (its sequence fails). Tracks
    which sequences hold state."""

    def __init__(self, stop_at: dict[str, int] | None = None, skip: str | None = None) -> None:
        self.stop_at = stop_at
        self.skip = skip
        self.holding: set[str] = set()
        self.released: list[str] = []

    def execute(self, plan) -> None:
        ids = plan.sequence_ids
        self.holding.update(ids)
        rows = plan.sample_rows.tolist()
        ends = plan.row_offsets[1:]
        out = plan.outputs
        k = 0
        for r in rows:
            if ids[r] == self.skip:
                continue
            token = int(plan.tokens[ends[r] - 1]) + 1
            if self.stop_at is not None and token >= self.stop_at.get(ids[r], 1 << 31):
                token = -1
            out.request_indexes[k] = r
            out.predicted_tokens[k] = token
            k += 1
        out.count = k

    def release(self, sequence_id: str, reason: object = None) -> None:
        self.holding.discard(sequence_id)
        self.released.append(sequence_id)
