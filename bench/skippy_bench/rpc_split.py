"""llama.cpp's own split beside ours: P `ggml-rpc-server` processes and one `llama-server`.

Used by bench/stages_load.py (`--rpc-server PATH --rpc-llama-server PATH`, part `rpc`). For
each P > 1 it starts P rpc-servers on loopback ports (CPU backend, `--threads` threads each,
as our stage workers), then `llama-server --rpc 127.0.0.1:p1,...` with every layer and the
output head offloaded (`-ngl 99`) and `--tensor-split` set so that RPC device k holds exactly
the layers of our stage k (`skippy_scheduler.hosts.stages.split.even_ranges`; the head counts
as one more layer on the last device: llama.cpp places layer i, and the head as layer n_layer,
on the device whose cumulative share first exceeds i / (n_layer + 1)). The token embedding
stays on llama-server's CPU, as llama.cpp always keeps the input layer there (our stage 0
holds it).

The placement is checked, not assumed: llama-server's log names each device's model and KV
buffer sizes, which must match what the layers assigned to it take (from the GGUF's tensor
sizes) within 1 %. P = 1 is plain llama-server with the same options and no RPC.

Same model, context, lanes, KV type and batch as the staged `serve` run: `-c` cells, `-np`
lanes, one KV cache for all lanes (`--kv-unified`, as every stage context), f32 K and V,
flash attention off, `-b`/`-ub` 512, and `--no-cache-idle-slots` (see the command below).
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import time
from typing import Any

from .servers import free_port, log_tail, stop, wait_ready

_BUFFER = re.compile(r"(?P<what>model|KV) buffer size = +(?P<mib>[0-9.]+) MiB")
_DEVICE = re.compile(r"RPC\d+\[127\.0\.0\.1:(?P<port>\d+)\]")


def tensor_split(ranges: list[tuple[int, int]]) -> list[int]:
    """`--tensor-split` shares that give RPC device k the layers of range k (and the head to
    the last device: it is placed as one more layer)."""
    shares = [hi - lo for lo, hi in ranges]
    shares[-1] += 1
    return shares


def expected_bytes(model: str, ranges: list[tuple[int, int]]) -> list[int]:
    """Bytes of the weights each device should hold: its blocks, plus the output norm and
    head on the last one (the token embedding stays on the host's CPU)."""
    from gguf import GGUFReader

    out = [0] * len(ranges)
    for t in GGUFReader(model).tensors:
        name = t.name
        if name.startswith("blk."):
            layer = int(name.split(".")[1])
            k = next(i for i, (lo, hi) in enumerate(ranges) if lo <= layer < hi)
            out[k] += int(t.n_bytes)
        elif name.startswith("output"):
            out[-1] += int(t.n_bytes)
    return out


def placement(log_text: str, ports: list[int]) -> dict[str, list[float]]:
    """MiB of model and KV buffers per RPC device (by port order) from llama-server's log."""
    got: dict[str, list[float]] = {"model": [0.0] * len(ports), "KV": [0.0] * len(ports)}
    for line in log_text.splitlines():
        m, d = _BUFFER.search(line), _DEVICE.search(line)
        if m and d and int(d["port"]) in ports:
            got[m["what"]][ports.index(int(d["port"]))] += float(m["mib"])
    return got


def check_placement(log_text: str, ports: list[int], model: str,
                    ranges: list[tuple[int, int]], kv_bytes_per_layer: int) -> dict[str, Any]:
    """What each device holds against what its layers take; RuntimeError when a device's
    weights or KV are more than 1 % off (the layers did not land as planned)."""
    got = placement(log_text, ports)
    want_model = [b / 2**20 for b in expected_bytes(model, ranges)]
    want_kv = [(hi - lo) * kv_bytes_per_layer / 2**20 for lo, hi in ranges]
    for what, have, want in (("model", got["model"], want_model), ("KV", got["KV"], want_kv)):
        for k, (h, w) in enumerate(zip(have, want)):
            if abs(h - w) > 0.01 * w + 0.01:
                raise RuntimeError(f"RPC device {k} holds {h:.2f} MiB of {what} buffers, its "
                                   f"layers {list(ranges[k])} take {w:.2f} MiB: the split did "
                                   f"not land as planned")
    return {"model_mib": got["model"], "kv_mib": got["KV"], "want_model_mib": want_model,
            "want_kv_mib": want_kv,
            "pipeline_parallel": "pipeline parallelism enabled" in log_text}


def _wait_port(port: int, proc: subprocess.Popen[bytes], timeout: float, log: str) -> None:
    import socket

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"rpc-server exited: {log_tail(log, 2000)}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError(f"rpc-server on port {port} did not start in time")


class RpcSplit:
    """P rpc-servers and the llama-server that drives them (a context manager); `url`."""

    def __init__(self, args: argparse.Namespace, p: int, work: str) -> None:
        self.args, self.p, self.work = args, p, work
        self.procs: list[subprocess.Popen[bytes]] = []
        self.url = ""
        self.placement: dict[str, Any] = {}

    def __enter__(self) -> "RpcSplit":
        try:
            self._start()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in reversed(self.procs):  # llama-server first, then its devices
            stop(proc, 30)
        self.procs = []

    def _start(self) -> None:
        from skippy_scheduler.hosts.stages.split import even_ranges, read_layer_count

        args, p = self.args, self.p
        env = {**os.environ, "GGML_RPC_NO_RDMA": "1"}
        ports = []
        if p > 1:
            for k in range(p):
                port = free_port()
                log = os.path.join(self.work, f"rpc-server-{p}-{k}.log")
                with open(log, "wb") as fh:
                    proc = subprocess.Popen(
                        [args.rpc_server, "-H", "127.0.0.1", "-p", str(port), "-t",
                         str(args.threads)], stdout=fh, stderr=subprocess.STDOUT, env=env)
                self.procs.append(proc)
                _wait_port(port, proc, args.start_timeout, log)
                ports.append(port)
        port = free_port()
        cmd = [args.rpc_llama_server, "-m", args.model, "-a", "bench", "--host", "127.0.0.1",
               "--port", str(port), "-c", str(args.concurrency * args.lane_tokens),
               "-np", str(args.concurrency), "-cb", "-t", str(args.threads), "-tb",
               str(args.threads), "-b", "512", "-ub", "512", "-ctk", "f32", "-ctv", "f32",
               "-fa", "off", "-kvu", "--no-webui",
               # with one KV cache for all lanes llama-server saves an idle slot's KV to its
               # host-side prompt cache when the slot takes a new task; over RPC that reads the
               # state back from every device (decode fell from 0.17 to 3-6 s a token after the
               # first wave of requests), and the staged runs keep no such copy either
               "--no-cache-idle-slots",
               "-lv", "4"]  # the buffer lines the placement check reads (a few lines a request)
        n_layer = read_layer_count(args.model)
        ranges = even_ranges(n_layer, p)
        if p > 1:
            cmd += ["--rpc", ",".join(f"127.0.0.1:{x}" for x in ports), "-ngl", "99",
                    "--tensor-split", ",".join(str(s) for s in tensor_split(ranges))]
        log = os.path.join(self.work, f"llama-server-{p}.log")
        with open(log, "wb") as fh:
            proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env)
        self.procs.append(proc)
        self.url = f"http://127.0.0.1:{port}"
        try:
            wait_ready(self.url + "/health", proc, args.start_timeout)
        except RuntimeError as exc:
            raise RuntimeError(f"llama-server: {exc}: {log_tail(log)}") from None
        self.command = cmd
        if p > 1:
            cells = -(-args.concurrency * args.lane_tokens // 256) * 256  # llama.cpp pads it
            with open(log, encoding="utf-8", errors="replace") as fh:
                text = fh.read()
            self.placement = check_placement(text, ports, args.model, ranges,
                                             kv_layer_bytes(args.model, cells))
        self.placement["ranges"] = [list(r) for r in ranges]


def kv_layer_bytes(model: str, cells: int) -> int:
    """Bytes one layer's f32 K and V take for `cells` cells."""
    from gguf import GGUFReader

    reader = GGUFReader(model)

    def value(key: str) -> int:
        field = reader.get_field(key)
        assert field is not None, key
        return int(field.parts[field.data[0]][0])

    arch = bytes(reader.get_field("general.architecture").parts[-1]).decode()
    n_embd = value(f"{arch}.embedding_length")
    n_head = value(f"{arch}.attention.head_count")
    n_head_kv = value(f"{arch}.attention.head_count_kv")
    return 2 * cells * (n_embd // n_head) * n_head_kv * 4
