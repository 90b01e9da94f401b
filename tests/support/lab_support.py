"""Helpers of the lab tests: small trace files, the traces folder, prefix-store pictures."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from skippy_scheduler.lab.traces import BLOCK_TOKENS

REPO = Path(__file__).resolve().parents[2]  # the source tree
TRACES = Path(os.environ.get("SKIPPY_TRACES_DIR") or REPO.parent / "shared" / "traces")
MOONCAKE_CONV = TRACES / "mooncake-fast25-conversation_trace.jsonl"


def mooncake_file(tmp_path, rows, name="t.jsonl") -> str:
    """rows: (timestamp ms, blocks, output tokens[, tenant]); input = 512 per block, except a
    last block given as (id, tokens)."""
    lines = []
    for row in rows:
        ts, blocks, out = row[:3]
        ids, n = [], 0
        for b in blocks:
            if isinstance(b, tuple):
                ids.append(b[0])
                n += b[1]
            else:
                ids.append(b)
                n += BLOCK_TOKENS
        record = {"timestamp": ts, "input_length": n, "output_length": out, "hash_ids": ids}
        if len(row) > 3:
            record["tenant"] = row[3]
        lines.append(json.dumps(record))
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def conversation_rows(n=120, seed=3):
    """Sessions that grow turn by turn (each turn extends the previous prompt), several at
    once, with shared first blocks and some whole-prompt repeats."""
    rng = np.random.default_rng(seed)
    sessions: list[list] = []
    rows = []
    next_id = 1000
    for k in range(n):
        if not sessions or rng.random() < 0.3:
            sessions.append([0])  # every prompt starts with block 0
        s = sessions[int(rng.integers(len(sessions)))]
        if rng.random() < 0.15:
            blocks = list(s)  # the same prompt again
        else:
            for _ in range(int(rng.integers(1, 4))):
                s.append(next_id)
                next_id += 1
            blocks = list(s)
        if rng.random() < 0.3:
            # A partial last block: its id covers fewer tokens, so it is never reused as a
            # full block (as in the Mooncake traces: an id always covers the same tokens).
            blocks = blocks + [(next_id, int(rng.integers(1, BLOCK_TOKENS)))]
            next_id += 1
        rows.append((k * 7, blocks, int(rng.integers(1, 40))))
    return rows


# -- prefix stores -----------------------------------------------------------------------------


def kt(entry):
    """An entry by its key (entry objects differ between stores), None for None."""
    return None if entry is None else tuple(entry.key.tolist())


def picture(store):
    """Everything observable about a store, by key."""
    return {
        "stats": (store.used_tokens, store.entries, store.inserts, store.evictions,
                  store.evicted_tokens, store.refused_inserts, store.epoch),
        "resident": [(kt(e), kt(e.parent), e.pins, e.children, e.holder, e.last_used, e.serial)
                     for e in store.resident()],
        "lru": [kt(e) for e in store.lru_order()],
    }


def random_key(rng, prefix=(), low=1, high=4):
    return np.asarray(list(prefix) + [rng.randrange(3) for _ in range(rng.randint(low, high))],
                      dtype=np.int32)


def capture_figures(monkeypatch) -> dict:
    """Each `lab` figure as it is saved, by file name (closed by the plot code afterwards):
    its axes, the axes with a legend and each legend's left edge in its panel's coordinates
    (beyond 1: beside the panel), its titles joined by " | ", each panel's line data and
    y limits."""
    from skippy_scheduler.lab import plot

    seen: dict = {}
    real_save = plot._save

    def save(fig, path, series):
        fig.canvas.draw()
        axes = fig.axes
        legends = [ax for ax in axes if ax.get_legend() is not None]
        seen[path.rsplit("/", 1)[1]] = {
            "axes": axes,
            "legends": legends,
            "legend_x0": [ax.get_legend().get_window_extent().transformed(
                ax.transAxes.inverted()).x0 for ax in legends],
            "titles": " | ".join([t.get_text() for t in fig.texts]
                                 + [ax.get_title() for ax in axes]),
            "lines": [[line.get_ydata() for line in ax.get_lines()] for ax in axes],
            "ylim": [ax.get_ylim() for ax in axes],
        }
        return real_save(fig, path, series)

    monkeypatch.setattr(plot, "_save", save)
    return seen
