"""What one llama.cpp step costs by its shape: decode rows, a prefill chunk, the two mixed.

    python bench/llama_step_shapes.py --model bench-58m.gguf --threads 2 --json shapes.json

`llama_decode` timed alone (no scheduler, no server), on a context laid out as `serve` lays it
out by default: a KV stream per sequence (`kv_unified` off), f32 KV, flash attention off,
`--lanes` lanes and as many prefix holders (`--ctx-size` cells for the lanes and as many again).
First `--rows-max` sequences get a `--context`-token prompt; then, each shape the median of
`--repeats` calls:

- decode: 1, 4, 8, ... rows (one token each, a sequence per row, at that context);
- prefill: a chunk of 32 ... 448 tokens of a fresh sequence (from position 0);
- mixed: a chunk beside `--rows-max` decode rows, in one `llama_decode` call;
- order: `--rows-max` decode rows with their sequence ids ascending in the batch, rotated
  (the second half first) and reversed: llama.cpp takes a micro-batch of consecutive ids in
  batch order, a pass over the weights each (docs/hosts.md, "Batch order"); then the rows but
  the middle one ("gap": the ids break around it), and the same with a filler entry on the
  middle sequence whose cell is dropped after the call ("gap filled": the host's gap fill).

On a context with a KV stream per sequence llama.cpp splits a batch into sub-batches in which
every sequence has the same number of tokens, so a mixed step is the decode rows' pass plus the
chunk's pass; the "mixed − (decode + prefill)" column shows what mixing saved (about nothing on
such a context). Each decode row reads its own stream's KV (`--context` cells, rounded up to 256):
the per-row cost grows with the context. These figures are what the slack rule's cost model
(docs/behaviour.md §2.13) fits online, and why docs/serving.md gives its default target.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any, Sequence

from skippy_bench.llama_context import LlamaContext


CHUNKS = (32, 64, 128, 256, 448)  # with up to 64 decode rows beside them, within one 512 batch
SHAPE_STEPS = (1, 4, 8, 12) + CHUNKS + (1, 1, 1, 1, 1)  # calls that advance decode rows, per repeat


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--model", required=True, help="GGUF file")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lanes", type=int, default=16, help="sequences (serve's --max-active)")
    ap.add_argument("--ctx-size", type=int, default=16384,
                    help="cells for the lanes (as many again for the holders), as serve's -c")
    ap.add_argument("--context", type=int, default=500,
                    help="prompt tokens of the decoding sequences")
    ap.add_argument("--rows-max", type=int, default=12, help="decode rows of the largest shape")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", help="write the figures here")
    return ap


def check(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for name in ("threads", "lanes", "ctx_size", "context", "rows_max", "repeats"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.rows_max > min(args.lanes - 1, 64):
        ap.error(f"--rows-max must be at most 64 and leave a lane for the chunk "
                 f"(at most {min(args.lanes - 1, 64)})")
    per_lane = args.ctx_size // args.lanes
    if per_lane < max(CHUNKS):
        ap.error(f"a lane's {per_lane} cells (--ctx-size / --lanes) do not hold the largest "
                 f"chunk, {max(CHUNKS)} tokens")
    if args.context + args.repeats * len(SHAPE_STEPS) + 1 > per_lane:
        ap.error(f"--context {args.context} does not fit a lane's {per_lane} cells "
                 f"(--ctx-size / --lanes) with room to decode")


def measure(args: argparse.Namespace) -> dict[str, Any]:
    c = LlamaContext(args.model, args.threads, n_seq=2 * args.lanes, n_ctx=2 * args.ctx_size,
                     name="llama_step_shapes")
    try:
        rows_max, chunk_seq = args.rows_max, args.rows_max
        for s in range(rows_max):
            for at in range(0, args.context, 512):
                c.decode([(s, at, min(512, args.context - at))])
        pos = [args.context] * rows_max

        def decode_rows(r: int) -> float:
            took = c.decode([(s, pos[s], 1) for s in range(r)])
            for s in range(r):
                pos[s] += 1
            return took

        def decode_order(order: Sequence[int], filler: int = -1) -> float:
            items = [(s, pos[s], 1) for s in order]
            if filler >= 0:
                items.insert(filler, (filler, pos[filler], 1))
            took = c.decode(items)
            if filler >= 0:
                c.clear(filler, pos[filler])
            for s in order:
                pos[s] += 1
            return took

        def chunk(n: int, rows: int = 0) -> float:
            c.clear(chunk_seq)
            took = c.decode([(s, pos[s], 1) for s in range(rows)] + [(chunk_seq, 0, n)])
            for s in range(rows):
                pos[s] += 1
            return took

        def median_ms(f: Any, *a: int) -> float:
            return statistics.median(f(*a) for _ in range(args.repeats)) * 1e3

        sizes = sorted({1, 4, 8, rows_max} & set(range(1, rows_max + 1)))
        chunks = list(CHUNKS)
        decode = {r: median_ms(decode_rows, r) for r in sizes}
        prefill = {n: median_ms(chunk, n) for n in chunks}
        mixed = {n: median_ms(chunk, n, rows_max) for n in chunks}
        half = rows_max // 2
        orders = {"ascending": list(range(rows_max)),
                  "rotated": list(range(half, rows_max)) + list(range(half)),
                  "reversed": list(range(rows_max - 1, -1, -1))}
        by_order = {name: statistics.median(decode_order(o) for _ in range(args.repeats)) * 1e3
                    for name, o in orders.items()}
        around = [s for s in range(rows_max) if s != half]
        by_order["gap"] = statistics.median(
            decode_order(around) for _ in range(args.repeats)) * 1e3
        by_order["gap filled"] = statistics.median(
            decode_order(around, half) for _ in range(args.repeats)) * 1e3
    finally:
        c.close()
    return {"model": args.model, "threads": args.threads, "lanes": args.lanes,
            "context": args.context, "rows_max": rows_max, "repeats": args.repeats,
            "decode_ms": decode, "prefill_ms": prefill, "mixed_ms": mixed,
            "decode_order_ms": by_order}


def main(argv: Sequence[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    check(ap, args)
    doc = measure(args)
    print(f"llama_decode alone, {args.threads} threads, a KV stream per sequence, f32 KV, "
          f"decode rows at {args.context} tokens of context, medians of {args.repeats}:")
    for r, ms in doc["decode_ms"].items():
        print(f"  decode {r:3d} rows            {ms:7.1f} ms")
    rows_ms = doc["decode_ms"][doc["rows_max"]]
    for n, ms in doc["prefill_ms"].items():
        mixed = doc["mixed_ms"][n]
        print(f"  prefill {n:3d} tokens {ms:7.1f} ms; mixed with {doc['rows_max']} rows "
              f"{mixed:7.1f} ms (mixed - (decode + prefill) {mixed - rows_ms - ms:+6.1f} ms)")
    print(f"  {doc['rows_max']} decode rows by the order of their sequence ids in the batch:")
    for name, ms in doc["decode_order_ms"].items():
        print(f"    {name:10s} {ms:7.1f} ms")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(doc, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
