"""A llama.cpp RPC server from the llama.cpp this package runs on:

    python -m skippy_scheduler.hosts.llama.rpc_server [--host 127.0.0.1] [--port 50052]
                                                      [-t THREADS] [--device CUDA0[,CUDA1]]

llama.cpp's `rpc-server` program lends a machine's devices to another process, which sees them
as devices of its own (`--rpc HOST:PORT` on `serve`, `run`, `calibrate`, `stage`, and on
llama-server). pip's builds of llama-cpp-python do not build that program; this runs the same
server (`ggml_backend_rpc_start_server`) from the library, so it needs a llama-cpp-python built
with `CMAKE_ARGS="-DGGML_RPC=on"`. It serves one client process at a time, until stopped.

Served on the CPU, it gives a machine without a GPU a device that llama.cpp treats as a GPU:
layers, KV cache and backend sampling placed there take the same paths as on a GPU, computed
by the CPU kernels of the other process (docs/gpu.md). The protocol has no authentication:
listen on loopback or a trusted network only.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import signal
import socket
import sys
from typing import Optional, Sequence

from ..offload import RpcError
from .backend import _device_handles, init_backend, list_devices, rpc_function

_START = ctypes.CFUNCTYPE(None, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t,
                          ctypes.c_size_t, ctypes.c_void_p)


def serve_forever(endpoint: str, devices: Sequence[str] = (), threads: int = 1) -> None:
    """Serve `devices` (names as `--list-devices` prints them; default: the GPUs, else the
    CPU) at `endpoint` (host:port). Returns only when llama.cpp's server gives up (a port
    already taken, say); RpcError before starting when it cannot."""
    init_backend()
    start = rpc_function(b"ggml_backend_rpc_start_server")
    known = list_devices()
    handles = dict(zip((d.name for d in known), _device_handles()))
    if devices:
        missing = [n for n in devices if n not in handles]
        if missing:
            raise RpcError(f"no device named {', '.join(missing)} (llama.cpp sees: "
                           f"{', '.join(handles) or 'none'})")
        names = list(devices)
    else:
        names = [d.name for d in known if d.is_gpu] or [d.name for d in known if d.kind == "cpu"]
    if not names:
        raise RpcError("llama.cpp sees no device to serve")
    chosen = (ctypes.c_void_p * len(names))(*(handles[n] for n in names))
    print(f"rpc_server: {', '.join(names)} at {endpoint} ({threads} thread(s))",
          file=sys.stderr, flush=True)
    _START(start)(endpoint.encode(), None, threads, len(names),
                  ctypes.cast(chosen, ctypes.c_void_p))


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m skippy_scheduler.hosts.llama.rpc_server",
                                description="Lend this machine's llama.cpp devices to another "
                                            "process (its --rpc HOST:PORT).")
    p.add_argument("-H", "--host", default="127.0.0.1",
                   help="IPv4 address to listen on (llama.cpp's server takes no host names); "
                        "the protocol has no authentication (default: 127.0.0.1)")
    p.add_argument("-p", "--port", type=int, default=50052, help="port (default: 50052)")
    threads = max(1, (os.cpu_count() or 2) // 2)
    p.add_argument("-t", "--threads", type=int, default=threads,
                   help="CPU threads of a CPU device (default: half the cores, as llama.cpp's "
                        f"rpc-server: {threads} here)")
    p.add_argument("-dev", "--device", default="",
                   help="devices to serve, by the names --list-devices prints (default: the "
                        "GPUs, else the CPU)")
    args = p.parse_args(argv)
    try:
        socket.inet_aton(args.host)
    except OSError:
        p.error(f"--host must be an IPv4 address such as 127.0.0.1 (llama.cpp's RPC server "
                f"takes no host names), got {args.host!r}")
    if not 0 < args.port < 65536:
        p.error(f"--port must be in 1..65535, got {args.port}")
    if args.threads < 1:
        p.error(f"--threads must be >= 1, got {args.threads}")
    devices = [n.strip() for n in args.device.split(",") if n.strip()]
    # The server runs in C until the process ends: Ctrl-C must end it, not wait for Python.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        serve_forever(f"{args.host}:{args.port}", devices, args.threads)
    except RpcError as exc:
        p.exit(2, f"{p.prog}: error: {exc}\n")
    print(f"{p.prog}: error: llama.cpp's RPC server stopped (is port {args.port} taken?)",
          file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
