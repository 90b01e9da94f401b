"""What reading a step's device-sampled tokens costs the llama.cpp host, beside a busy thread.

    python bench/device_reads.py --rows 64 --reads 400 --json reads.jsonl
    python bench/device_reads.py --what step --rows 64 --reads 200 --json steps.jsonl

With sampling on the device (`--backend-sampling`, the default with layers on a GPU), the host
reads every sampling row's token after the decode (`DeviceChains.read`). This loads a model
(`--model`, default: the tiny model written to a temporary file), attaches a greedy backend
chain to `--rows` lanes (`--seeded`: a seeded draw at temperature 0.9 instead), decodes one
entry per lane once, and then times `--reads` reads of those rows' tokens (with `--seeded`,
each read preceded by the reseed of the rows' draws that precedes every decode), one read every
`--gap-ms`, while another thread stands in for the server's
event loop (`--busy`):

- `none`: nothing else runs;
- `io`: Python work in 10 µs slices with a socket send and receive after each (an event loop
  writing streams: it gives the GIL up at every system call);
- `cpu`: Python work without pause (an event loop encoding a long run of chunks).

With `--what step` each timed step is the host's whole decode of the rows instead: the
decode (`Decoder.decode`: `llama_decode`, the wait for its outputs, the logits pointer) and the
read of the device's tokens, the same token at position 1 of every lane each time (the cells
past the first removed before each step, untimed).

Each ctypes call releases the GIL and has to take it back; with a busy thread that can take as
long as the busy thread keeps it (up to the interpreter's switch interval, 5 ms). Reported:
the read's (or step's) wall time in µs, median, p90 and p99, per busy mode; run it with two
packages (the installed one is imported) to compare them.
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import socket
import sys
import tempfile
import threading
import time
from typing import Any

import numpy as np


def _busy(mode: str, stop: threading.Event) -> None:
    a, b = socket.socketpair()
    x = 0
    try:
        while not stop.is_set():
            for i in range(200):
                x += i
            if mode == "io":
                a.send(b"x")
                b.recv(16)
    finally:
        a.close()
        b.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--model", default=None, help="GGUF (default: the tiny model)")
    ap.add_argument("--rows", type=int, default=64, help="lanes, one sampling row each")
    ap.add_argument("--reads", type=int, default=400)
    ap.add_argument("--gap-ms", type=float, default=1.0, help="between two reads")
    ap.add_argument("--busy", default="none,io,cpu", help="comma-separated: none, io, cpu")
    ap.add_argument("--seeded", action="store_true",
                    help="seeded draws (reseeded before each read) instead of greedy chains")
    ap.add_argument("--what", choices=("read", "step"), default="read",
                    help="time the read of the device's tokens (default) or the whole decode "
                         "step (decode, wait, logits, read)")
    ap.add_argument("--json", default=None, help="append the result as one JSON line")
    a = ap.parse_args(argv)
    if a.what == "step" and a.seeded:
        ap.error("--seeded times the reads only")

    import llama_cpp as ll

    import skippy_scheduler
    from skippy_scheduler.hosts.llama.backend import create_context, init_backend, load_model
    from skippy_scheduler.hosts.llama.backend_sampling import DeviceChains
    from skippy_scheduler.hosts.llama.decode import Decoder
    from skippy_scheduler.hosts.llama.tokenizer import Tokenizer
    from skippy_scheduler.hosts.kit import LlamaBatch
    from skippy_scheduler.sampling import SamplingParams

    path = a.model
    tmp = None
    if path is None:
        from skippy_scheduler.hosts.tiny_model import write_tiny_llama
        tmp = tempfile.TemporaryDirectory()
        path = os.path.join(tmp.name, "tiny.gguf")
        write_tiny_llama(path)
    n = a.rows
    init_backend()
    model = load_model(path)
    ctx = create_context(model, n_ctx=max(256, 4 * n), n_batch=max(64, n), n_ubatch=max(64, n),
                         sequence_ids=n, n_threads=1, kv_type="f32", flash_attn=False,
                         unified=True)
    if not ctx:
        raise SystemExit("could not create a context")
    tok = Tokenizer(model)
    chains = DeviceChains(ctx, tok.n_vocab, tok.eog_ids)
    for lane in range(n):
        params = SamplingParams(temperature=0.9, seed=1000 + lane) if a.seeded else None
        if chains.start(lane, params) is None:
            raise SystemExit("llama.cpp refused a backend chain")
    batch = LlamaBatch(n)
    batch.tok[:n] = 1
    batch.pos[:n] = 0
    lanes = np.arange(n, dtype=np.int32)
    rc = batch.decode(ctx, n, lanes, None)
    if rc != 0:
        raise SystemExit(f"llama_decode returned {rc}")
    row_lanes = np.arange(n, dtype=np.int64)
    sample_rows = np.arange(n, dtype=np.int64)
    out_rows = np.arange(n, dtype=np.int64)
    device_rows = list(range(n))
    tokens = np.zeros(n, dtype=np.int32)

    decoder = Decoder(ctx, n, tok.n_vocab)
    # The package's own read after its own decode (an older one's read takes no keyword).
    after_decode = ({"synchronized": True}
                    if "synchronized" in inspect.signature(chains.read).parameters else {})
    memory = ll.llama_get_memory(ctx)

    def reset() -> None:
        """Before each timed step (untimed): every lane back to its first cell, so that each
        step decodes position 1 over the same cache."""
        ll.llama_memory_seq_rm(memory, -1, 1, -1)

    def read() -> None:
        if a.seeded:
            chains.prepare(row_lanes, sample_rows, device_rows, out_rows, batch.pos)
        chains.read(tokens, row_lanes, sample_rows, device_rows, out_rows, batch.pos)

    def decode_step() -> None:
        decoder.tok[:n] = 1
        decoder.pos[:n] = 1
        decoder.decode(n, lanes, out_rows)
        chains.read(tokens, row_lanes, sample_rows, device_rows, out_rows, decoder.pos,
                    **after_decode)

    step = read if a.what == "read" else decode_step
    reset()
    step()
    want = tokens.copy()

    result: dict[str, Any] = {"package": skippy_scheduler.__file__, "rows": n, "what": a.what,
                              "reads": a.reads, "gap_ms": a.gap_ms, "seeded": a.seeded,
                              "switch_interval_ms": sys.getswitchinterval() * 1e3}
    for mode in a.busy.split(","):
        stop = threading.Event()
        thread = None
        if mode != "none":
            thread = threading.Thread(target=_busy, args=(mode, stop), daemon=True)
            thread.start()
            time.sleep(0.05)
        times = []
        for _ in range(a.reads):
            reset()
            t = time.perf_counter_ns()
            step()
            times.append((time.perf_counter_ns() - t) / 1e3)
            if not np.array_equal(tokens, want):
                raise SystemExit("the tokens read changed between reads")
            time.sleep(a.gap_ms / 1e3)
        stop.set()
        if thread is not None:
            thread.join()
        q = np.percentile(times, [50, 90, 99])
        result[mode] = {"p50_us": round(float(q[0]), 1), "p90_us": round(float(q[1]), 1),
                        "p99_us": round(float(q[2]), 1)}
        print(f"busy {mode:>4}: {a.what} of {n} rows  p50 {q[0]:8.1f} µs  p90 {q[1]:8.1f} µs  "
              f"p99 {q[2]:8.1f} µs", flush=True)
    chains.close()
    ll.llama_free(ctx)
    ll.llama_model_free(model)
    if tmp is not None:
        tmp.cleanup()
    if a.json:
        with open(a.json, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
