"""Whether one sequence's logits depend on the batch around it, on llama.cpp as built here.

    python bench/batch_invariance.py -m M.gguf [--kv-type f32] [-fa off] [-t 1] [--json out.jsonl]

The scheduler makes a sequence's tokens a function of its logits and its seed (docs/hosts.md,
"When the tokens are the same"); this measures the other half, the logits, with llama.cpp's own
calls and no scheduler: one prompt (41 tokens) decoded, then five tokens fed one step at a time,
in each of these shapes, each in a fresh context:

- `alone`: the prompt in one batch, then each step a batch of one token;
- `chunked`: the prompt in two chunks (17 and 24 tokens), then as `alone`;
- `with 1`, `with 2`, `with 3`: the prompt in one batch with 1-3 other sequences' prompts,
  then each step beside their steps (2-4 tokens a batch, one per sequence);
- `padded`: as `alone`, but each step's batch also holds a second token of the same sequence
  (the next position, no logits, removed after the step);
- `filler`: as `alone`, but each step's batch also holds one token of an empty sequence
  (position 0, no logits, removed after the step).

It prints, for each shape against `with 1`, the largest absolute difference of the prompt's
last logits and of each step's logits (0 when bit-identical). Greedy tokens differ only where
the two best logits are closer than that; a seeded draw only where its uniform falls that
close to a boundary between two tokens.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import numpy as np

STEPS = (7, 9, 11, 13, 15)  # the tokens fed after the prompt (any in the vocabulary)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("-m", "--model", required=True, help="GGUF model file")
    p.add_argument("--kv-type", choices=("f32", "f16"), default="f32")
    p.add_argument("-fa", "--flash-attn", choices=("on", "off"), default="off")
    p.add_argument("-t", "--threads", type=int, default=1)
    p.add_argument("-ngl", "--n-gpu-layers", type=int, default=0)
    p.add_argument("--json", help="append the figures as one JSON line to this file")
    args = p.parse_args(argv)

    import llama_cpp as ll

    from skippy_scheduler.hosts.llama.backend import init_backend

    init_backend()
    mp = ll.llama_model_default_params()
    mp.n_gpu_layers = args.n_gpu_layers
    model = ll.llama_model_load_from_file(args.model.encode(), mp)
    if not model:
        print(f"batch_invariance: cannot load {args.model}", file=sys.stderr)
        return 1
    n_vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(model))
    kv = {"f32": 0, "f16": 1}[args.kv_type]

    def context() -> Any:
        cp = ll.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = 1024, 512, 512, 4
        cp.n_threads = cp.n_threads_batch = args.threads
        cp.type_k = cp.type_v = kv
        cp.flash_attn_type = 1 if args.flash_attn == "on" else 0
        ctx = ll.llama_init_from_model(model, cp)
        if not ctx:
            raise SystemExit("batch_invariance: cannot create a context")
        return ctx

    def decode(ctx: Any, rows: list[tuple[int, int, int, bool]]) -> dict[tuple[int, int], Any]:
        """Decode (token, position, sequence, logits?) rows; the logits by (sequence, pos)."""
        batch = ll.llama_batch_init(len(rows), 0, 1)
        try:
            for i, (token, pos, seq, want) in enumerate(rows):
                batch.token[i], batch.pos[i] = token, pos
                batch.n_seq_id[i], batch.seq_id[i][0], batch.logits[i] = 1, seq, want
            batch.n_tokens = len(rows)
            if ll.llama_decode(ctx, batch) != 0:
                raise SystemExit("batch_invariance: llama_decode failed")
            return {(seq, pos): np.ctypeslib.as_array(ll.llama_get_logits_ith(ctx, i),
                                                      shape=(n_vocab,)).copy()
                    for i, (_, pos, seq, want) in enumerate(rows) if want}
        finally:
            ll.llama_batch_free(batch)

    rng = np.random.default_rng(1)
    top = min(n_vocab, 380)
    prompt = [1] + [int(t) for t in rng.integers(3, top, 40)]
    others = [[1] + [int(t) for t in rng.integers(3, top, 20 + j)] for j in range(3)]
    last = len(prompt) - 1

    def prompt_rows(seq: int, tokens: list[int], first: int = 0) -> list[Any]:
        return [(t, first + i, seq, seq == 0 and first + i == last)
                for i, t in enumerate(tokens)]

    def run(shape: str) -> list[Any]:
        ctx = context()
        try:
            mem = ll.llama_get_memory(ctx)
            n_with = int(shape[-1]) if shape.startswith("with") else 0
            if shape == "chunked":
                decode(ctx, prompt_rows(0, prompt[:17]))
                out = [decode(ctx, prompt_rows(0, prompt[17:], 17))[(0, last)]]
            else:
                rows = prompt_rows(0, prompt)
                for j in range(n_with):
                    rows += prompt_rows(1 + j, others[j])
                out = [decode(ctx, rows)[(0, last)]]
            for k, token in enumerate(STEPS):
                pos = len(prompt) + k
                rows = [(token, pos, 0, True)]
                rows += [(token + 1 + j, len(others[j]) + k, 1 + j, False) for j in range(n_with)]
                if shape == "padded":
                    rows.append((token, pos + 1, 0, False))
                elif shape == "filler":
                    rows.append((token, 0, 1, False))
                out.append(decode(ctx, rows)[(0, pos)])
                if shape == "padded":
                    ll.llama_memory_seq_rm(mem, 0, pos + 1, -1)
                elif shape == "filler":
                    ll.llama_memory_seq_rm(mem, 1, -1, -1)
            return out
        finally:
            ll.llama_free(ctx)

    shapes = ("alone", "chunked", "with 1", "with 2", "with 3", "padded", "filler")
    logits = {shape: run(shape) for shape in shapes}
    ref = logits["with 1"]
    figures: dict[str, Any] = {"model": args.model, "kv_type": args.kv_type,
                               "flash_attn": args.flash_attn, "n_gpu_layers": args.n_gpu_layers}
    print(f"# largest |logit difference| against 'with 1' ({args.kv_type} KV, flash attention "
          f"{args.flash_attn}): the prompt's last token, then each step")
    for shape in shapes:
        diffs = [float(np.abs(a - b).max()) for a, b in zip(logits[shape], ref)]
        figures[shape] = diffs
        print(f"{shape:8}  prompt {diffs[0]:.3g}  steps " + " ".join(f"{d:.3g}" for d in diffs[1:]))
    if args.json:
        with open(args.json, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(figures) + "\n")
    ll.llama_model_free(model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
