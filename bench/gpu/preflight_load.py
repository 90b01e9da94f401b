"""Loads a model with every layer on the GPU through this package's own llama.cpp backend, as
`serve` does: `init_backend()` (which installs the package's llama.cpp log sink, unless
`SKIPPY_LLAMA_LOG=raw`), then `load_model()`; then frees it.

    python3 bench/gpu/preflight_load.py --model bench-0.85b-f16.gguf

Run it from outside the checkout (so that the installed package is imported). It prints one
line: where the layers went and how long the load took ("loaded on CUDA0 in 2.1 s"; "loaded
on the CPU ... (llama.cpp sees no GPU ...)" where there is none) and exits 0, or exits 1 with
llama.cpp's complaint. A crash inside llama.cpp kills the process with a signal (the exit
status of a shell's `$?` is then 128 + the signal); faulthandler prints the Python stack on
stderr first. On a GPU machine the same load once crashed with a segmentation fault after the
log sink was installed and not without it, so a crash here is the cue to run the rest with
`SKIPPY_LLAMA_LOG=raw` (bench/gpu/device_run.sh does).
"""
from __future__ import annotations

import argparse
import faulthandler
import os
import sys
import time
import types
from typing import Optional


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--model", required=True, help="GGUF model file")
    ap.add_argument("--ngl", type=int, default=999,
                    help="layers on the GPU (default 999: every one)")
    args = ap.parse_args(argv)
    if not os.path.isfile(args.model):
        ap.error(f"--model: no such file: {args.model}")
    faulthandler.enable()
    import llama_cpp
    from skippy_scheduler.hosts.llama import backend

    sink = os.environ.get("SKIPPY_LLAMA_LOG", "").strip().lower() or "the package's sink"
    backend.init_backend()
    gpus = [d for d in backend.list_devices() if d.is_gpu]
    # What load_model reads of a Placement: every layer on the first GPU, no split.
    placement = types.SimpleNamespace(on_gpu=True, n_gpu_layers=args.ngl, split_mode="none",
                                      gpus=(gpus[0].name,), main_gpu=0,
                                      tensor_split=()) if gpus else None
    where = f"on {gpus[0].name}" if gpus else "on the CPU"
    note = "" if gpus else "llama.cpp sees no GPU; "
    print(f"loading {args.model} {where} (log: {sink})", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    try:
        model = backend.load_model(args.model, placement)  # type: ignore[arg-type]
    except RuntimeError as exc:
        print(f"not loaded: {exc}", flush=True)
        return 1
    took = time.perf_counter() - t0
    llama_cpp.llama_model_free(model)
    print(f"loaded {where} in {took:.1f} s ({note}log: {sink})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
