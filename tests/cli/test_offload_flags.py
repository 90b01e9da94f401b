"""The offload flags, spelled as llama-server spells them, on every command that loads a model;
`--list-devices`; the startup line saying where the layers went."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from skippy_scheduler.cli import build_parser

# Outside the checkout: `python -m` puts the working directory first on sys.path, and the
# checkout's uncompiled sources would shadow the installed package.
CWD = os.path.dirname(sys.executable)

FLAGS = ["-ngl", "auto", "-sm", "layer", "-ts", "3,1", "-mg", "0", "-dev", "CUDA0,CUDA1",
         "-fa", "auto", "--kv-type", "f16", "--rpc", "127.0.0.1:50052,gpu-box:50053"]
LONG = ["--n-gpu-layers", "all", "--split-mode", "row", "--tensor-split", "1/1",
        "--main-gpu", "1", "--device", "none", "--flash-attn", "off"]


@pytest.mark.parametrize("command,required", [
    ("serve", []), ("run", []), ("calibrate", []),
    ("stage", ["-m", "s.gguf", "--listen", "ipc:///tmp/x"]),
])
@pytest.mark.parametrize("flags", [FLAGS, LONG], ids=["short", "long"])
def test_every_model_command_takes_the_offload_flags(command, required, flags):
    if command == "stage":  # the driver tells a stage worker its KV type and flash attention
        flags = [f for i, f in enumerate(flags) if f not in ("-fa", "--kv-type", "--flash-attn")
                 and (i == 0 or flags[i - 1] not in ("-fa", "--kv-type", "--flash-attn"))]
    args = build_parser().parse_args([command, *required, *flags])
    if "-ngl" in flags:
        assert args.n_gpu_layers == "auto" and args.split_mode == "layer"
        assert args.tensor_split == (3.0, 1.0) and args.device == ("CUDA0", "CUDA1")
        assert args.rpc == ["127.0.0.1:50052", "gpu-box:50053"]
    else:
        assert args.n_gpu_layers == "all" and args.split_mode == "row"
        assert args.main_gpu == 1 and args.device == ("none",)


def test_the_defaults_leave_the_device_to_decide():
    args = build_parser().parse_args(["serve"])
    assert args.n_gpu_layers == "auto" and args.kv_type is None and args.flash_attn is None
    assert args.ctx_size is None and args.max_num_batched_tokens is None
    assert build_parser().parse_args(["serve", "--flash-attn"]).flash_attn == "on"
    assert build_parser().parse_args(["run", "-ngl", "-1"]).n_gpu_layers == "auto"
    assert build_parser().parse_args(["run", "-ngl", "-2"]).n_gpu_layers == "all"
    assert build_parser().parse_args(["serve", "--stages", "d", "--stage-devices",
                                      "CUDA0,CUDA1"]).stage_devices == ("CUDA0", "CUDA1")


@pytest.mark.parametrize("flags,message", [
    (["-ngl", "lots"], "expected a layer count, auto or all"),
    (["-sm", "diagonal"], "invalid choice"),
    (["-ts", "a,1"], "expected proportions"),
    (["-mg", "-2"], "GPU index >= 0"),
    (["-fa", "maybe"], "invalid choice"),
    (["--rpc", "127.0.0.1"], "expected RPC servers as host:port"),
    (["--rpc", "host:0"], "expected RPC servers as host:port"),
    (["--rpc", "::1:50052"], "expected RPC servers as host:port"),
    (["--rpc", "a:1,"], "expected RPC servers as host:port"),
])
def test_bad_offload_values_are_one_line_errors(flags, message):
    proc = subprocess.run([sys.executable, "-m", "skippy_scheduler.cli", "serve", *flags],
                          capture_output=True, text=True, timeout=60, cwd=CWD)
    assert proc.returncode == 2
    assert message in proc.stderr.splitlines()[-1]


def test_stage_devices_give_each_local_stage_its_device():
    from skippy_scheduler.cli._common import CommandError, stage_worker_args

    args = build_parser().parse_args(["serve", "--stages", "d", "-ngl", "8", "-dev", "CUDA0",
                                      "--stage-devices", "CUDA0,CUDA1"])
    per_stage = stage_worker_args(args, 2)
    assert [a[a.index("-dev") + 1] for a in per_stage] == ["CUDA0", "CUDA1"]
    assert all(a.count("-dev") == 1 and a[a.index("-ngl") + 1] == "8" for a in per_stage)
    with pytest.raises(CommandError, match="2 device"):
        stage_worker_args(args, 3)


def test_rpc_servers_go_to_a_stage_worker_not_to_the_driver_of_stages():
    from skippy_scheduler.cli.offload import offload_spec

    args = build_parser().parse_args(["stage", "-m", "s.gguf", "--listen", "ipc:///tmp/x",
                                      "--rpc", "10.0.0.2:50052", "--rpc", "b:2,10.0.0.2:50052"])
    assert offload_spec(args).rpc == ("10.0.0.2:50052", "b:2")  # as llama-server adds them
    # The driver of stages loads no layer, and one RPC server serves one process at a time.
    for command in ("serve", "run"):
        for stages in (["--stages", "d"], ["--stage-addresses", "ipc:///tmp/a", "-m", "m.gguf"]):
            proc = subprocess.run([sys.executable, "-m", "skippy_scheduler.cli", command,
                                   *stages, "--rpc", "10.0.0.2:50052"],
                                  capture_output=True, text=True, timeout=60, cwd=CWD)
            assert proc.returncode == 2
            assert f"error: --rpc with {stages[0]}: the stage workers load the layers" in \
                proc.stderr.splitlines()[-1], proc.stderr


def test_rpc_is_one_line_where_it_cannot_be_used():
    pytest.importorskip("llama_cpp")
    from serve_support import free_port

    from skippy_scheduler.hosts.llama.backend import backends

    # A build without the RPC backend says how to get it; with it, nothing listening is named.
    said = ("no RPC server answers at" if "RPC" in dict(backends())
            else "this llama.cpp was built without its RPC backend; build llama-cpp-python "
                 'with CMAKE_ARGS="-DGGML_RPC=on"')
    proc = subprocess.run([sys.executable, "-m", "skippy_scheduler.cli", "serve", "--rpc",
                           f"127.0.0.1:{free_port()}", "--list-devices"],
                          capture_output=True, text=True, timeout=60, cwd=CWD)
    assert proc.returncode == 2
    assert f"skippy-scheduler serve: error: --rpc: {said}" in proc.stderr.splitlines()[-1]


def test_list_devices_answers():
    pytest.importorskip("llama_cpp")
    for command in ("serve", "run", "stage"):
        proc = subprocess.run([sys.executable, "-m", "skippy_scheduler.cli", command,
                               "--list-devices"], capture_output=True, text=True, timeout=60,
                              cwd=CWD)
        assert proc.returncode == 0, proc.stderr
        lines = proc.stdout.splitlines()
        assert lines[0] == "Available devices:"
        assert any(line.strip().startswith("CPU:") and "GiB free of" in line for line in lines)


def test_the_backends_and_why_no_gpu():
    pytest.importorskip("llama_cpp")
    from skippy_scheduler.hosts.llama.backend import backends, list_devices, no_gpu_reason
    from skippy_scheduler.hosts.offload import HOST_BACKENDS, NO_GPU_BACKEND

    found = dict(backends())
    assert found.get("CPU") == 1
    # Every device belongs to a backend, and a GPU is reported as one when a backend finds it.
    assert sum(found.values()) == len(list_devices())
    if not any(d.is_gpu for d in list_devices()):
        gpu_backends = [n for n in found if n not in HOST_BACKENDS]
        why = no_gpu_reason()
        if gpu_backends:
            assert why.startswith(f"this llama.cpp's {gpu_backends[0]} backend found no device")
        else:
            assert why == NO_GPU_BACKEND


def test_serve_says_where_the_layers_went_and_reports_device_memory(tmp_path):
    pytest.importorskip("llama_cpp")
    pytest.importorskip("fastapi")
    import httpx
    from serve_support import Spawned

    srv = Spawned(tmp_path, "-ngl", "auto")
    try:
        body = httpx.get(srv.url + "/metrics", timeout=10).text
        assert 'skippy:device_memory_bytes{device="CPU",kind="weights"}' in body
    finally:
        assert srv.stop() == 0
    from skippy_scheduler.hosts.llama.backend import list_devices

    if not any(d.is_gpu for d in list_devices()):  # (an RPC build "supports" offload too)
        banner = srv.log().splitlines()[0]
        assert banner.startswith("skippy-scheduler serve: tiny-random-llama on http")
        assert "(0 layers on a GPU: this llama.cpp has no GPU backend, " in banner
        assert "skippy:gpu_layers 0.0" in body
    else:
        assert " layers on " in srv.log()


@pytest.mark.parametrize("command", ["run", "calibrate", "split", "stage", "serve"])
def test_a_truncated_model_is_one_line_in_every_command(tmp_path, command):
    pytest.importorskip("gguf")
    from skippy_scheduler.hosts.tiny_model import write_tiny_llama

    import pathlib

    data = pathlib.Path(write_tiny_llama(str(tmp_path / "tiny.gguf"), seed=0)).read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) // 2])
    extra = {"split": ["--stages", "2", "--out", str(tmp_path / "out")],
             "stage": ["--listen", f"ipc://{tmp_path}/s0"]}.get(command, [])
    proc = subprocess.run([sys.executable, "-m", "skippy_scheduler.cli", command, "-m", str(cut),
                           *extra], capture_output=True, text=True, timeout=120, cwd=CWD)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "not a whole GGUF model" in proc.stderr.splitlines()[-1]


def test_offload_flags_a_driver_cannot_use_are_refused_before_anything_starts():
    """With --stage-addresses the workers were started with their own offload flags; with
    --stages a device name this machine's llama.cpp does not see is refused before any worker
    starts."""
    pytest.importorskip("llama_cpp")
    for command in ("serve", "run"):
        proc = subprocess.run([sys.executable, "-m", "skippy_scheduler.cli", command,
                               "--stage-addresses", "ipc:///tmp/a", "-m", "m.gguf", "-ngl", "4",
                               "-dev", "CUDA0"],
                              capture_output=True, text=True, timeout=60, cwd=CWD)
        assert proc.returncode == 2
        assert "error: -ngl, -dev with --stage-addresses: the stage workers load the layers" in \
            proc.stderr.splitlines()[-1], proc.stderr
        proc = subprocess.run([sys.executable, "-m", "skippy_scheduler.cli", command,
                               "--stages", "d", "--stage-devices", "cpu,NOSUCH0"],
                              capture_output=True, text=True, timeout=60, cwd=CWD)
        assert proc.returncode == 2
        assert "-dev: no device named NOSUCH0 (llama.cpp sees: CPU" in \
            proc.stderr.splitlines()[-1], proc.stderr
