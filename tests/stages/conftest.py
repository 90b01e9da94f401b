"""Fixtures of the staged-serving tests: a 4-layer tiny f32 model, its stage splits, the
unsplit model's alone runs as the reference."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from skippy_scheduler.hosts.tiny_model import write_tiny_llama  # noqa: E402
from stages_common import MAX_GEN, N_SEQ, SHAPE  # noqa: E402


@pytest.fixture(scope="session")
def model4(tmp_path_factory):
    pytest.importorskip("gguf")
    return write_tiny_llama(tmp_path_factory.mktemp("model4") / "tiny4-f32.gguf", seed=5,
                            shape=SHAPE)


@pytest.fixture(scope="session")
def splits(model4, tmp_path_factory):
    """Stage directories of the model: P = 2 (even) and P = 3 (layers 0 | 1-2 | 3)."""
    from skippy_scheduler.hosts.stages.split import split_model

    out = {}
    d2 = tmp_path_factory.mktemp("p2")
    split_model(model4, d2, 2)
    out[2] = str(d2)
    d3 = tmp_path_factory.mktemp("p3")
    split_model(model4, d3, [(0, 1), (1, 3), (3, 4)])
    out[3] = str(d3)
    return out


@pytest.fixture(scope="session")
def unsplit(model4):
    pytest.importorskip("llama_cpp")
    from skippy_scheduler.hosts.llama import LlamaHost

    with LlamaHost(model4, n_ctx=N_SEQ * 512, n_seq_max=N_SEQ, n_batch=512, n_threads=1) as h:
        yield h


@pytest.fixture(scope="session")
def alone(unsplit):
    """prompt, n -> the unsplit model's first n greedy tokens of the prompt run alone."""
    cache: dict[tuple[int, ...], list[int]] = {}

    def tokens(prompt, max_tokens: int) -> list[int]:
        key = tuple(prompt)
        if key not in cache:
            cache[key] = unsplit.generate_alone(list(key), MAX_GEN)
        return cache[key][:max_tokens]
    return tokens
