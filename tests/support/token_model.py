"""A deterministic stand-in model and the runtime state it keeps, shared by the plans-in-flight
tests: the next token is a function of the sequence's whole history (a negative one ends it),
so a sequence's tokens are its "alone" tokens exactly when the runtime saw the right history."""
from __future__ import annotations

VOCAB = 50


def model_token(history: list[int]) -> int:
    h = 7
    for t in history:
        h = (h * 31 + t + 1) % 1_000_003
    return -1 if h % 11 == 0 else h % VOCAB


def alone_tokens(prompt: list[int], max_tokens: int) -> list[int]:
    """The tokens `prompt` gets run alone, up to `max_tokens` (the end signal excluded)."""
    history = list(prompt)
    out: list[int] = []
    while len(out) < max_tokens:
        t = model_token(history)
        if t < 0:
            break
        out.append(t)
        history.append(t)
    return out


def run_rows(kv: dict[str, list[int]], plan) -> None:
    """Run `plan` against per-sequence histories `kv` (the runtime's KV) and write one
    `model_token` output per sampling row. Every row must start where its history ends, or
    rewrite it from an earlier position (a replay or a recompute)."""
    ids = plan.sequence_ids
    offsets = plan.row_offsets
    out = plan.outputs
    k = 0
    for r, sid in enumerate(ids):
        a, b = int(offsets[r]), int(offsets[r + 1])
        toks = plan.tokens[a:b].tolist()
        assert min(toks) >= 0, "a deferred input was not filled"
        pos = plan.positions[a:b].tolist()
        seq_kv = kv.setdefault(sid, [])
        del seq_kv[pos[0]:]
        assert len(seq_kv) == pos[0], (sid, len(seq_kv), pos)
        seq_kv.extend(toks)
        if plan.sample_last[r]:
            out.request_indexes[k] = r
            out.predicted_tokens[k] = model_token(seq_kv)
            k += 1
    out.count = k
