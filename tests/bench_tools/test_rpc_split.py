"""skippy_bench.rpc_split (stages_load.py's `rpc` part): the tensor split that gives llama.cpp's
RPC devices our stages' layers, and, when a llama.cpp build with RPC is at hand
(SKIPPY_LLAMA_RPC_BIN: the directory holding ggml-rpc-server and llama-server), that split
really running on the tiny model."""
from __future__ import annotations

import argparse
import bisect
import os

import httpx
import numpy as np
import pytest
from skippy_bench import rpc_split

from skippy_scheduler.hosts.tiny_model import TinyModelShape, write_tiny_llama
from skippy_scheduler.hosts.stages.split import even_ranges


def _llama_device(layer: int, shares: list[int], n_layer: int) -> int:
    """llama.cpp's layer placement (llama-model.cpp, all layers offloaded): the first device
    whose cumulative float32 share exceeds layer / (n_layer + 1)."""
    total = np.float32(sum(shares))
    points = [np.float32(c) / total for c in np.cumsum(shares, dtype=np.float32)]
    return bisect.bisect_right(points, np.float32(layer) / np.float32(n_layer + 1))


@pytest.mark.parametrize("n_layer,p", [(8, 2), (8, 3), (4, 3), (7, 2), (12, 5)])
def test_the_split_puts_each_stage_s_layers_and_the_head_on_its_device(n_layer, p):
    ranges = even_ranges(n_layer, p)
    shares = rpc_split.tensor_split(ranges)
    for k, (lo, hi) in enumerate(ranges):
        assert [_llama_device(i, shares, n_layer) for i in range(lo, hi)] == [k] * (hi - lo)
    assert _llama_device(n_layer, shares, n_layer) == p - 1  # the output head


def test_expected_bytes_and_the_placement_check(tmp_path):
    model = str(write_tiny_llama(tmp_path / "m.gguf", seed=3, shape=TinyModelShape(n_layer=4)))
    ranges = even_ranges(4, 2)
    want = rpc_split.expected_bytes(model, ranges)
    from gguf import GGUFReader

    sizes = {t.name: int(t.n_bytes) for t in GGUFReader(model).tensors}
    assert sum(want) == sum(n for name, n in sizes.items() if name != "token_embd.weight")
    assert want[1] - want[0] == sizes["output.weight"] + sizes["output_norm.weight"]
    kv = rpc_split.kv_layer_bytes(model, 256)
    assert kv == 2 * 256 * 16 * 2 * 4  # K and V, head 16 wide, 2 KV heads, f32
    ports = [5001, 5002]

    def log(model_mib, kv_mib):
        return "".join(
            f"load_tensors: RPC0[127.0.0.1:{port}] model buffer size = {m:8.2f} MiB\n"
            f"llama_kv_cache: RPC0[127.0.0.1:{port}] KV buffer size = {v:8.2f} MiB\n"
            for port, m, v in zip(ports, model_mib, kv_mib))

    right = log([w / 2**20 for w in want], [2 * kv / 2**20] * 2)
    got = rpc_split.check_placement(right, ports, model, ranges, kv)
    assert got["model_mib"] == pytest.approx([w / 2**20 for w in want], abs=0.01)
    swapped = log([w / 2**20 for w in reversed(want)], [2 * kv / 2**20] * 2)
    with pytest.raises(RuntimeError, match="did not land as planned"):
        rpc_split.check_placement(swapped, ports, model, ranges, kv)


@pytest.mark.skipif(not os.environ.get("SKIPPY_LLAMA_RPC_BIN"),
                    reason="SKIPPY_LLAMA_RPC_BIN (a llama.cpp build with -DGGML_RPC=ON) not set")
def test_the_rpc_split_runs_the_load_on_the_tiny_model(tmp_path):
    bin_dir = os.environ["SKIPPY_LLAMA_RPC_BIN"]
    model = str(write_tiny_llama(tmp_path / "m.gguf", seed=3, shape=TinyModelShape(n_layer=4)))
    args = argparse.Namespace(
        rpc_server=os.path.join(bin_dir, "ggml-rpc-server"),
        rpc_llama_server=os.path.join(bin_dir, "llama-server"), model=model, threads=1,
        concurrency=2, lane_tokens=128, start_timeout=120)
    with rpc_split.RpcSplit(args, 2, str(tmp_path)) as split:
        assert split.placement["ranges"] == [[0, 2], [2, 4]]
        assert all(m > 0 for m in split.placement["model_mib"])
        # (Direct requests: the tiny model's tokens often carry no text of their own, which
        # the streaming client counts by.)
        for prompt in ("a b c d", "e f g h i j"):
            r = httpx.post(split.url + "/v1/completions", timeout=60, json={
                "prompt": prompt, "max_tokens": 3, "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 3
    assert split.procs == []  # every process stopped
