"""The random-weight f32 LLaMA models the benchmarks run on (`skippy_scheduler.hosts.tiny_model`
layouts at other sizes)."""
from __future__ import annotations

import os

# The serving comparisons' model: 58.5 M parameters (`serve_load.py write-model`).
BENCH_SHAPE = dict(n_vocab=32000, n_embd=512, n_layer=8, n_head=8, n_head_kv=8, n_ff=1408,
                   context_length=2048, rope_dimension=64)
# The offline runs' model: about 29 M parameters, decode in ms (`inflight_tokens.py`,
# `prefix_reuse.py`).
SMALL_SHAPE = dict(n_vocab=4096, n_embd=512, n_layer=8, n_head=8, n_head_kv=4, n_ff=1536,
                   context_length=4096, rope_dimension=64)


def write_bench_model(path: str, seed: int) -> None:
    """Write the 58.5 M-parameter bench model to `path` and say its size."""
    from skippy_scheduler.hosts.tiny_model import TinyModelShape, parameter_count, write_tiny_llama

    shape = TinyModelShape(**BENCH_SHAPE)
    write_tiny_llama(path, seed=seed, shape=shape)
    print(f"{path}: {parameter_count(shape) / 1e6:.1f} M parameters")


def small_model(path: str) -> str:
    """The 29 M-parameter model at `path`, written once (seed 1); returns `path`."""
    from skippy_scheduler.hosts.tiny_model import TinyModelShape, write_tiny_llama

    if not os.path.exists(path):
        write_tiny_llama(path, seed=1, shape=TinyModelShape(**SMALL_SHAPE))
    return path
