"""The offload arithmetic (hosts/offload.py) with made-up devices: fits, partly fits, refused."""
from __future__ import annotations

import pytest

from skippy_scheduler.hosts.offload import (NO_GPU_BACKEND, GiB, MiB, Device, FitError,
                                            ModelFootprint, OffloadSpec, assign,
                                            describe_no_gpu, kv_cells, parse_layers,
                                            parse_rpc_servers, parse_tensor_split, place)

CPU = Device(0, "CPU", "host", "cpu", free=64 * GiB, total=64 * GiB)


def gpu(i: int, free_gib: float, total_gib: float = 80.0) -> Device:
    return Device(i + 1, f"CUDA{i}", "test GPU", "gpu", free=int(free_gib * GiB),
                  total=int(total_gib * GiB))


# A 16-layer model of 100 MiB per layer, a 250 MiB output layer, 250 MiB of embeddings, 2048
# K+V values per cell per layer (8 KV heads of 128, K and V).
FP = ModelFootprint(n_layer=16, n_ctx_train=32768, layer_bytes=(100 * MiB,) * 16,
                    output_bytes=250 * MiB, input_bytes=250 * MiB, kv_values=(2048,) * 16,
                    n_embd=2048, n_head=32, n_vocab=32000)


def fit(devices, spec=OffloadSpec(), n_ctx=8192, **kw):
    args = dict(streams=8, unified=False, kv_type="f16", n_ubatch=512, flash_attn=True,
                host=CPU)
    args.update(kw)
    return place(FP, [CPU, *devices], spec, n_ctx=n_ctx, **args)


def test_kv_cells_pad_every_stream_to_256():
    assert kv_cells(4096, 8, False) == 4096
    assert kv_cells(4000, 8, False) == 8 * 512
    assert kv_cells(16, 8, False) == 8 * 256
    assert kv_cells(1000, 1, False) == 1024
    assert kv_cells(1000, 8, True) == 1024


def test_everything_fits_on_one_big_gpu():
    p = fit([gpu(0, 80)])
    assert p.n_gpu_layers == 17 and p.offloadable == 17
    # 8192 cells x 16 layers x 2048 values x 2 bytes = 512 MiB of KV, all on the GPU
    assert p.kv == {"CUDA0": 512 * MiB}
    assert p.weights == {"CPU": 250 * MiB, "CUDA0": 16 * 100 * MiB + 250 * MiB}
    assert p.line() == "17/17 layers on CUDA0, KV 0.5 GiB on CUDA0"
    assert p.note == ""


def test_a_small_gpu_gets_the_most_layers_that_fit_output_layer_first():
    # 1 GiB kept free: 1.8 GiB leaves 0.8 GiB for compute, output and layers with their KV.
    p = fit([gpu(0, 1.8)])
    assert 0 < p.n_gpu_layers < 17
    layers = assign(FP, [gpu(0, 1.8)], p.n_gpu_layers, ())
    assert layers[-1] == 0  # the output layer goes first
    assert layers[:17 - p.n_gpu_layers] == [-1] * (17 - p.n_gpu_layers)
    assert "does not fit" in p.note
    # one more layer would not fit
    bigger = fit([gpu(0, 1.8)], OffloadSpec(n_gpu_layers=p.n_gpu_layers + 1))
    assert bigger.n_gpu_layers == p.n_gpu_layers + 1  # explicit counts are taken as asked...
    with pytest.raises(FitError, match="CUDA0 needs"):
        fit([gpu(0, 0.5)], OffloadSpec(n_gpu_layers="all"))  # ...unless the GPU lacks them


def test_auto_lowers_a_default_context_before_it_drops_layers():
    # The model's 32768-token context costs 2 GiB of KV; with 3.6 GiB free and 1 GiB kept,
    # the context comes down (to a multiple of 256 x 8 lanes) and every layer stays.
    p = fit([gpu(0, 3.6)], n_ctx=None, ctx_quantum=2048)
    assert p.n_gpu_layers == 17
    assert 4096 <= p.n_ctx < 32768 and p.n_ctx % 2048 == 0
    assert fit([gpu(0, 80)], n_ctx=None, ctx_quantum=2048).n_ctx == 32768


def test_a_context_that_fits_nowhere_is_refused_with_the_numbers():
    small_host = Device(0, "CPU", "host", "cpu", free=3 * GiB, total=4 * GiB)
    with pytest.raises(FitError, match=r"context of 1048576 tokens .*the host needs"):
        place(FP, [small_host], OffloadSpec(), n_ctx=1 << 20, streams=8, unified=False,
              kv_type="f16", n_ubatch=512, flash_attn=True, host=small_host)
    # With prefix holders beside the lanes, their cells are named in the hint.
    with pytest.raises(FitError, match=r"keep fewer prefix holders \(4 now: --prefix-holders"):
        place(FP, [small_host], OffloadSpec(), n_ctx=1 << 20, streams=8, unified=False,
              kv_type="f16", n_ubatch=512, flash_attn=True, host=small_host, lanes=4)


def test_cpu_only_asks_llama_cpp_for_no_device_at_all():
    """-dev none and -sm none -mg -1 give llama.cpp no device (no op of the model's goes to a
    GPU); -ngl 0 alone keeps its layers on the CPU but leaves llama.cpp its GPUs."""
    assert fit([gpu(0, 80)], OffloadSpec(devices=("none",))).cpu_only
    assert fit([gpu(0, 80)], OffloadSpec(split_mode="none", main_gpu=-1)).cpu_only
    assert not fit([gpu(0, 80)], OffloadSpec(n_gpu_layers=0)).cpu_only
    assert not fit([gpu(0, 80)]).cpu_only and not fit([]).cpu_only


def test_a_cpu_only_placement_loads_with_an_empty_device_list(tmp_path):
    pytest.importorskip("llama_cpp")
    pytest.importorskip("gguf")
    import llama_cpp

    from skippy_scheduler.hosts.llama import backend
    from skippy_scheduler.hosts.offload import footprint_from_gguf
    from skippy_scheduler.hosts.tiny_model import write_tiny_llama

    backend.init_backend()
    path = str(write_tiny_llama(str(tmp_path / "tiny.gguf"), seed=0))
    devices = backend.list_devices()
    placement = place(footprint_from_gguf(path), devices, OffloadSpec(devices=("none",)),
                      n_ctx=512, streams=1, unified=False, kv_type="f16", n_ubatch=512,
                      flash_attn=False, host=devices[0])
    assert placement.cpu_only and not placement.on_gpu
    model = backend.load_model(path, placement)
    try:
        assert llama_cpp.llama_model_n_params(model) > 0
    finally:
        llama_cpp.llama_model_free(model)


def test_no_gpu_backend_keeps_everything_on_the_cpu():
    p = fit([])
    assert p.n_gpu_layers == 0
    assert p.line() == "0 layers on a GPU: this llama.cpp has no GPU backend"
    assert fit([gpu(0, 80)], OffloadSpec(devices=("none",))).line().endswith("-dev none")
    assert fit([gpu(0, 80)], OffloadSpec(n_gpu_layers=0)).n_gpu_layers == 0


def test_a_gpu_backend_without_a_device_is_told_from_no_gpu_backend():
    # A CPU-only build, or one whose only other backends hold no GPU anyway.
    assert describe_no_gpu([("CPU", 1)]) == NO_GPU_BACKEND
    assert describe_no_gpu([("CPU", 1), ("BLAS", 1), ("RPC", 0)]) == NO_GPU_BACKEND
    # A CUDA build on a machine whose driver it cannot use: the backend is there, with no device,
    # and its last complaint in the log says why.
    log = ("load_backend: loaded CPU backend\n"
           "ggml_cuda_init: failed to initialize CUDA: CUDA driver version is insufficient for "
           "CUDA runtime version\n"
           "some later line")
    why = describe_no_gpu([("CUDA", 0), ("CPU", 1)], log)
    assert why == ("this llama.cpp's CUDA backend found no device (ggml_cuda_init: failed to "
                   "initialize CUDA: CUDA driver version is insufficient for CUDA runtime "
                   "version)")
    assert describe_no_gpu([("Vulkan", 0), ("CPU", 1)]) == \
        "this llama.cpp's Vulkan backend found no device"
    # The startup line carries it.
    p = fit([], no_gpu=why)
    assert p.n_gpu_layers == 0 and p.line() == f"0 layers on a GPU: {why}"


def test_two_gpus_split_by_free_memory_or_by_the_tensor_split():
    p = fit([gpu(0, 40), gpu(1, 40)])
    assert p.n_gpu_layers == 17 and set(p.kv) == {"CUDA0", "CUDA1"}
    # equal free memory: layers 0-8 on CUDA0, 9-15 and the output layer on CUDA1
    assert 7 * p.kv["CUDA0"] == 9 * p.kv["CUDA1"]
    q = fit([gpu(0, 40), gpu(1, 40)], OffloadSpec(tensor_split=(3, 1)))
    # split points at 3/4 of the 17 offloaded layers: 13 repeating layers on CUDA0, the last
    # 3 and the output layer on CUDA1 (llama.cpp's upper_bound over the normalised split)
    assert 3 * q.kv["CUDA0"] == 13 * q.kv["CUDA1"]
    one = fit([gpu(0, 40), gpu(1, 40)], OffloadSpec(split_mode="none", main_gpu=1))
    assert one.gpus == ("CUDA1",) and set(one.kv) == {"CUDA1"}
    with pytest.raises(FitError, match="-mg 2"):
        fit([gpu(0, 40), gpu(1, 40)], OffloadSpec(split_mode="none", main_gpu=2))
    with pytest.raises(FitError, match="no device named CUDA7"):
        fit([gpu(0, 40)], OffloadSpec(devices=("CUDA7",)))
    # Names match whatever their case, as llama.cpp matches them.
    assert fit([gpu(0, 40), gpu(1, 40)], OffloadSpec(devices=("cuda1",))).gpus == ("CUDA1",)
    # -sm none -mg -1: no GPU at all (llama.cpp's reading); -mg -1 means nothing otherwise.
    cpu_only = fit([gpu(0, 40)], OffloadSpec(split_mode="none", main_gpu=-1))
    assert cpu_only.n_gpu_layers == 0 and cpu_only.line().endswith("-sm none -mg -1")
    with pytest.raises(FitError, match="only with -sm none"):
        fit([gpu(0, 40)], OffloadSpec(main_gpu=-1))
    # Proportions past the last GPU are not read, and all 0 splits by free memory.
    extra = fit([gpu(0, 40)], OffloadSpec(tensor_split=(3, 1)))
    assert extra.gpus == ("CUDA0",) and extra.n_gpu_layers == 17 and extra.tensor_split == (3,)
    zeros = fit([gpu(0, 40), gpu(1, 40)], OffloadSpec(tensor_split=(0, 0)))
    assert zeros.kv == p.kv


def test_without_dev_the_gpus_are_the_ones_llama_cpp_picks():
    """RPC servers first, one device per id, integrated GPUs only without a discrete one."""
    cuda = Device(1, "CUDA0", "card", "gpu", 8 * GiB, 8 * GiB, "CUDA", "0000:01:00.0")
    same_card = Device(2, "Vulkan0", "card", "gpu", 8 * GiB, 8 * GiB, "Vulkan",
                       "0000:01:00.0")
    igpu = Device(3, "Vulkan1", "integrated", "igpu", 16 * GiB, 16 * GiB, "Vulkan", "")
    rpc = Device(4, "RPC0", "remote", "gpu", 8 * GiB, 8 * GiB, "RPC", "")
    p = place(FP, [CPU, cuda, same_card, igpu, rpc], OffloadSpec(), n_ctx=4096, streams=1,
              unified=False, kv_type="f16", n_ubatch=512, flash_attn=True, host=CPU)
    assert p.gpus == ("RPC0", "CUDA0")
    only_igpu = place(FP, [CPU, igpu], OffloadSpec(), n_ctx=4096, streams=1, unified=False,
                      kv_type="f16", n_ubatch=512, flash_attn=True, host=CPU)
    assert only_igpu.gpus == ("Vulkan1",)


def test_a_default_context_is_the_models_own_shared_by_the_lanes():
    """No -c: the training context (not more: each lane's share never exceeds it), at least
    the quantum that gives every lane its padded cells."""
    small = ModelFootprint(n_layer=2, n_ctx_train=512, layer_bytes=(MiB,) * 2, output_bytes=MiB,
                           input_bytes=MiB, kv_values=(64,) * 2, n_embd=64, n_head=4,
                           n_vocab=100)
    one = place(small, [CPU], OffloadSpec(), n_ctx=None, streams=1, unified=False,
                kv_type="f16", n_ubatch=512, flash_attn=True, host=CPU, ctx_quantum=256)
    assert one.n_ctx == 512
    four = place(small, [CPU], OffloadSpec(), n_ctx=None, streams=4, unified=False,
                 kv_type="f16", n_ubatch=512, flash_attn=True, host=CPU, lanes=4,
                 ctx_quantum=1024)
    assert four.n_ctx == 1024  # 256 a lane: the floor, under the training context


def test_flag_values_parse_as_llama_server_takes_them():
    assert parse_layers("auto") == "auto" and parse_layers("ALL") == "all"
    # llama.cpp's reading of negative counts: -1 is auto, -2 or less all.
    assert parse_layers("-1") == "auto" and parse_layers("-2") == "all"
    assert parse_layers("-99") == "all" and parse_layers("99") == 99
    with pytest.raises(ValueError):
        parse_layers("many")
    assert parse_tensor_split("3,1") == (3.0, 1.0) == parse_tensor_split("3/1")
    # Runs of separators are one, as llama-server splits on [,/]+; all 0 is by free memory.
    assert parse_tensor_split("3,,1") == (3.0, 1.0) == parse_tensor_split("3,1,")
    assert parse_tensor_split("0,0") == (0.0, 0.0)
    for bad in ("", ",", ",3,1", "a,b", "-1,2", "1,inf"):
        with pytest.raises(ValueError):
            parse_tensor_split(bad)
    assert parse_rpc_servers("10.0.0.2:50052, box:1,10.0.0.2:50052") == ("10.0.0.2:50052",
                                                                         "box:1")
    for bad in ("", "box", ":50052", "box:", "box:65536", "box:-1", "box:5x", "::1:50052"):
        with pytest.raises(ValueError, match="host:port"):
            parse_rpc_servers(bad)


def test_the_footprint_of_a_gguf_matches_its_tensors(tmp_path):
    pytest.importorskip("gguf")
    from skippy_scheduler.hosts.offload import ModelFileError, footprint_from_gguf
    from skippy_scheduler.hosts.tiny_model import write_tiny_llama

    import pathlib

    path = pathlib.Path(write_tiny_llama(str(tmp_path / "tiny.gguf"), seed=0))
    fp = footprint_from_gguf(path)
    assert fp.n_layer == 2 and fp.offloadable == 3
    size = path.stat().st_size
    assert 0 < fp.weight_bytes <= size
    assert fp.kv_values[0] > 0 and fp.n_vocab > 0
    data = path.read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) * 2 // 3])
    with pytest.raises(ModelFileError, match="not a whole GGUF model"):
        footprint_from_gguf(tmp_path / "cut.gguf")
    # A tensor type newer than the gguf package is named as that, not as a damaged file.
    import struct

    raw = bytearray(data)
    name = b"blk.0.attn_q.weight"
    at = raw.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    n_dims = struct.unpack_from("<I", raw, at)[0]
    struct.pack_into("<I", raw, at + 4 + 8 * n_dims, 250)  # its type
    (tmp_path / "new-type.gguf").write_bytes(bytes(raw))
    with pytest.raises(ModelFileError, match="tensors of type 250, which the gguf package "
                                             r"\(version [^)]+\) .* does not know"):
        footprint_from_gguf(tmp_path / "new-type.gguf")


def test_layers_on_rpc_servers_only_are_over_rpc():
    rpc = Device(3, "RPC0", "10.0.0.2:50052", "gpu", free=40 * GiB, total=40 * GiB)
    assert fit([rpc]).over_rpc
    assert not fit([gpu(0, 40)]).over_rpc and not fit([]).over_rpc
    # A local GPU and an RPC server: not every layer crosses the network.
    both = fit([gpu(0, 40), rpc])
    assert set(both.kv) == {"CUDA0", "RPC0"} and not both.over_rpc
    # Only the RPC server's share chosen (-dev RPC0): over RPC again.
    assert fit([gpu(0, 40), rpc], OffloadSpec(devices=("RPC0",))).over_rpc
