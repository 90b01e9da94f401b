"""This server against llama-server on a GPU: the same GGUF model and the same llama.cpp build,
in alternating rounds at concurrency 1, 16 and 64 (bench/gpu/README.md says how to get both
onto a GPU machine).

    python bench/gpu_rounds.py --write-model bench-0.85b-f16.gguf
    python bench/gpu_rounds.py --model bench-0.85b-f16.gguf --rounds 3 \\
        --ours-args='-fa off --kv-type f16' --markdown gpu-rounds.md --json gpu-rounds.jsonl

`--write-model PATH` writes the model of the GPU table and exits: a random-weight llama (vocab
32000, n_embd 2048, 16 layers, 32 heads, 8 KV heads, n_ff 5632, f16 matrices: 0.85 B
parameters, 1.7 GB), with `skippy_scheduler.hosts.tiny_model.write_tiny_llama`.

The workload is serve_load.py's closed loop: at each `--concurrency` (default 1, 16, 64),
`--requests` streaming requests (default 4 x the concurrency, at least 8) of
`--prompt-tokens` (512) tokens, half of them sharing a `--shared-prefix` (384) of tokens,
`--max-tokens` (64) output tokens each, greedy with `ignore_eos`. Each round runs every level
on this server and then on llama-server, each load on a fresh server process (no load inherits
another's prefix cache), `--rounds` times:

- this server: `python -m skippy_scheduler.cli serve -m MODEL --host 127.0.0.1 -np LANES
  -c CTX --served-model-name bench -ngl all` (`-ngl` only when its `serve --help` lists
  `--n-gpu-layers`; `--ngl` sets the value) and whatever `--ours-args` adds (without any,
  its own GPU defaults, flash attention `auto` among them: `--ours-args='-fa off --kv-type
  f16'` gives it llama-server's kernels);
- llama-server: `-m MODEL --host 127.0.0.1 -np LANES -c CTX -ngl 99 -cb -b 2048 -ub 512
  -fa off -ctk f16 -ctv f16 --no-webui -a bench`, then `--theirs-args` (a repeated flag
  overrides the default one: both servers take the last occurrence).

`--threads N` gives both servers N threads (default: their own). Each load reports output
tokens/s, TTFT p50/p99 and the inter-token gap p50/p99, and, where `nvidia-smi` exists, the
GPU's utilisation (mean and max of samples every 0.5 s during the load) and its memory used
(max); for this server also, per engine iteration over the load and its warm-up request
(`skippy:step_seconds` in `/metrics`), the wall time, the time in the model (the host's
execution: on a GPU the device's step), the engine thread's own work (before, plan, events,
complete), its waits on the model, the garbage collector's pauses in its process
(`skippy:gc_pause_seconds_total`), the model's busy share of the wall time, and the share of
steps staged while the step before ran (`skippy:plans_staged_ahead`). Greedy outputs
are compared request for request: on a GPU they may differ (llama.cpp's kernels are not
batch-invariant with an f16 KV cache), so the count of equal requests is reported, and only
`--require-equal` makes a difference fail the run (exit 1).

`--decode-tokens N` adds, to each round, a decode-phase load at the highest concurrency C on
each server: one wave of C requests of N output tokens (the same prompts), all sent at once.
From the last request's first token to the earliest last token every one of them is decoding
and nothing else runs: over that stretch, the output rate (streamed token chunks per second)
and the GPU's mean utilisation (the nvidia-smi samples, each stamped by nvidia-smi itself,
taken at least a second into it: the driver averages utilisation over a period of up to a
second, so an earlier sample would count prefill; their number is in the table), the issue's
"GPU busy share of the decode phase". Its rate counts streamed chunks (one token each unless a
server merged some: `tokens_per_chunk` in the JSON lines says). A lane must hold a prompt and
its output tokens: `--prompt-tokens` plus `--max-tokens` or `--decode-tokens` at most
`--ctx-size` / `--lanes`, else the run is refused.

The table: per load, the median over the rounds of each server's figures and ours ÷ theirs;
written to `--markdown FILE` after every load (so a run cut short leaves the table of what it
measured), printed at the end, and the medians appended as JSON lines to `--json FILE`, which
also gets every load's figures as it ends, both command lines, `llama-server --version`, the
GPU's name and the date. A server that does not start, or a load past its time, is recorded
as a failed load (its error and the end of the server's log in the JSON line) and the rounds
go on; a server that failed to start `--start-failures` times (default 2) is skipped for the
rest of the run, and the table and the progress lines say so. SIGINT (Ctrl-C, `timeout -s
INT`, also where the process started with SIGINT ignored) or SIGTERM (`timeout`'s own) stops
them, and the table of what was measured is still written (exit 130). Progress goes to
stderr. Requests time out after `--timeout` s without data, a load after `--load-timeout` s, a
server start after `--start-timeout` s.

`--merge A.jsonl B.jsonl ...` runs nothing: it reads the loads, the output comparisons and
the run lines that earlier runs wrote with `--json` (say two calls on one lent machine, each
with the rounds that fit, or several runs appending to one file) and writes one table of
their medians taken together; runs of another workload (model, concurrency, sizes, threads,
flags) are refused, while runs of one server or both merge (each server's medians over the
runs that had it). A missing or empty file is skipped with a warning, and so is a line cut
short by a run stopped while writing it (a file's last line, or one before the next run's
first); a run appending to a file whose last line was cut short starts a new line.

A CPU smoke run (the test's): `--model tiny.gguf --servers ours --concurrency 1,2
--requests 3 --prompt-tokens 24 --shared-prefix 16 --max-tokens 4 --lanes 2 --ctx-size 1024`.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from typing import Any, Callable, Optional, Sequence

from skippy_bench.loads import chunks_within, closed_args, decode_window, load_result, \
    load_results
from skippy_bench.reports import emit
from skippy_bench.servers import OURS, THEIRS, Served, find_llama_server, stop

# (key in a load's result, name in the table, scale for the table)
MEASURES = (("output_tokens_per_s", "output tok/s", 1), ("ttft_p50_s", "TTFT p50 ms", 1e3),
            ("ttft_p99_s", "TTFT p99 ms", 1e3), ("itl_p50_s", "gap p50 ms", 1e3),
            ("itl_p99_s", "gap p99 ms", 1e3), ("gpu_util_mean_pct", "GPU util mean %", 1),
            ("gpu_util_max_pct", "GPU util max %", 1), ("gpu_mem_max_mib", "GPU memory max MiB", 1),
            ("step_wall_ms", "step ms (wall)", 1), ("step_execute_ms", "step ms in the model", 1),
            ("step_engine_ms", "step ms of engine work", 1), ("step_wait_ms", "step ms waited", 1),
            ("step_gc_ms", "step ms of GC pauses", 1),
            ("host_busy_pct", "model busy % of wall", 1),
            ("staged_ahead_pct", "steps staged ahead %", 1),
            ("not_staged_new_rows_pct", "steps not staged: new sequences %", 1),
            ("not_staged_not_queued_pct", "steps not staged: plan not queued %", 1))
#: The decode-phase load's measures (`--decode-tokens`): over the stretch in which every
#: request of one wave was decoding, the output rate and the GPU's utilisation; its gaps and
#: steps over the whole load.
DECODE_MEASURES = (("decode_tokens_per_s", "decode phase: output tok/s", 1),
                   ("gpu_util_decode_pct", "decode phase: GPU util mean %", 1),
                   ("gpu_decode_samples", "decode phase: GPU samples", 1),
                   ("decode_phase_s", "decode phase: seconds", 1),
                   ("itl_p50_s", "gap p50 ms", 1e3), ("itl_p99_s", "gap p99 ms", 1e3),
                   ("step_execute_ms", "step ms in the model", 1),
                   ("step_engine_ms", "step ms of engine work", 1),
                   ("step_gc_ms", "step ms of GC pauses", 1),
                   ("host_busy_pct", "model busy % of wall", 1),
                   ("staged_ahead_pct", "steps staged ahead %", 1),
                   ("not_staged_not_queued_pct", "steps not staged: plan not queued %", 1))
#: The step histogram's parts that are the engine thread's own work (serve/metrics.py).
ENGINE_PARTS = ("before", "plan", "events", "complete")
_STEP = re.compile(r'^skippy:step_seconds_(sum|count)\{part="(\w+)"\} (\S+)$', re.M)
_AHEAD = re.compile(r'^skippy:plans_staged_ahead_total (\S+)$', re.M)
_NOT_AHEAD = re.compile(r'^skippy:plans_not_staged_ahead_total\{reason="(\w+)"\} (\S+)$', re.M)
#: Why steps were not staged ahead, as shares of the steps (the server's reasons).
NOT_AHEAD_SHARES = (("new_rows", "not_staged_new_rows_pct"),
                    ("not_queued", "not_staged_not_queued_pct"))
_GC = re.compile(r'^skippy:gc_pause_seconds_total\{generation="\d"\} (\S+)$', re.M)
SMI_PERIOD_S = 0.5
#: How far into a window a sample must be taken to count for it: NVML averages a GPU's
#: utilisation over its own sample period, between 1/6 s and 1 s depending on the product.
SMI_AVERAGED_S = 1.0
SMI_QUERY = ["--query-gpu=timestamp,utilization.gpu,memory.used",
             "--format=csv,noheader,nounits", "-lms", str(int(SMI_PERIOD_S * 1000))]


def gpu_model_shape():
    """The GPU table's model: 0.85 B parameters in the tiny model's layout."""
    from skippy_scheduler.hosts.tiny_model import TinyModelShape

    return TinyModelShape(n_vocab=32000, n_embd=2048, n_layer=16, n_head=32, n_head_kv=8,
                          n_ff=5632, context_length=65536, rope_dimension=64)


def rpc_model_shape():
    """The RPC table's model (BENCHMARKS.md "On a device that is not the host's"): 4.3 M
    parameters, the GPU model's vocabulary, a decode step of 64 rows in tens of ms on one CPU
    core, so that the host's work per step counts as it does beside a GPU."""
    from skippy_scheduler.hosts.tiny_model import TinyModelShape

    return TinyModelShape(n_vocab=32000, n_embd=64, n_layer=4, n_head=4, n_head_kv=4,
                          n_ff=192, context_length=4096, rope_dimension=16)


def write_model(path: str, seed: int, rpc: bool = False) -> None:
    from skippy_scheduler.hosts.tiny_model import parameter_count, write_tiny_llama

    shape, dtype = (rpc_model_shape(), "f32") if rpc else (gpu_model_shape(), "f16")
    write_tiny_llama(path, seed=seed, dtype=dtype, shape=shape)
    n = parameter_count(shape)
    size = f"{n / 1e6:.1f} M" if n < 1e8 else f"{n / 1e9:.2f} B"
    print(f"{path}: {size} parameters, {dtype}", file=sys.stderr)


def serve_has_ngl() -> bool:
    """Whether this server's `serve --help` lists --n-gpu-layers (run outside the checkout,
    where `python -m` imports the installed package)."""
    try:
        out = subprocess.run([sys.executable, "-m", "skippy_scheduler.cli", "serve", "--help"],
                             capture_output=True, text=True, timeout=120,
                             cwd=tempfile.gettempdir())
    except subprocess.TimeoutExpired:
        return False
    return "--n-gpu-layers" in out.stdout


def ours_cmd(args: argparse.Namespace) -> list[str]:
    cmd = [sys.executable, "-m", "skippy_scheduler.cli", "serve", "-m",
           os.path.abspath(args.model), "--host", "127.0.0.1", "-np", str(args.lanes),
           "-c", str(args.ctx_size), "--served-model-name", "bench", "--log-level", "warning"]
    if args.threads is not None:
        cmd += ["-t", str(args.threads)]
    if args.ours_ngl is not None:
        cmd += ["-ngl", str(args.ours_ngl)]
    return cmd + shlex.split(args.ours_args or "")


def theirs_cmd(args: argparse.Namespace, path: str) -> list[str]:
    cmd = [path, "-m", os.path.abspath(args.model), "--host", "127.0.0.1",
           "-np", str(args.lanes), "-c", str(args.ctx_size), "-ngl", str(args.theirs_ngl),
           "-cb", "-b", "2048", "-ub", "512", "-fa", "off", "-ctk", "f16", "-ctv", "f16",
           "--no-webui", "-a", "bench"]
    if args.threads is not None:
        cmd += ["-t", str(args.threads), "-tb", str(args.threads)]
    return cmd + shlex.split(args.theirs_args or "")


def requests_at(args: argparse.Namespace, c: int) -> int:
    return args.requests if args.requests is not None else max(8, 4 * c)


Sample = tuple[Optional[float], float, float]  # (time.perf_counter() or None, util %, MiB)


def parse_sample(line: str, clock_offset: float = 0.0) -> Optional[Sample]:
    """One nvidia-smi line, `[timestamp, ]util, mem`: the sample, its time on
    `time.perf_counter()`'s clock (the timestamp's epoch seconds less `clock_offset`, that is
    `time.time() - time.perf_counter()`; None without one), or None for a line without
    figures ("[N/A]", a line cut short by the stop)."""
    parts = [p.strip() for p in line.split(",")]
    at: Optional[float] = None
    if len(parts) == 3:
        try:  # nvidia-smi's local time, "2026/12/06 16:30:01.123"
            at = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp() \
                - clock_offset
        except ValueError:
            return None
        parts = parts[1:]
    try:
        return at, float(parts[0]), float(parts[1])
    except (ValueError, IndexError):
        return None


def gpu_figures(samples: Sequence[Sample],
                window: Optional[tuple[float, float]] = None) -> dict[str, Any]:
    """Mean and max utilisation and max memory of the samples (None when there is none); with
    a `window` (perf_counter seconds) also the mean utilisation of the samples taken at least
    `SMI_AVERAGED_S` into it (nvidia-smi's utilisation is the share of the driver's last sample
    period a kernel ran, a period of up to a second)."""
    util = [u for _, u, _ in samples]
    mem = [m for _, _, m in samples]
    out: dict[str, Any] = {"gpu_samples": len(util),
                           "gpu_util_mean_pct": sum(util) / len(util) if util else None,
                           "gpu_util_max_pct": max(util) if util else None,
                           "gpu_mem_max_mib": max(mem) if mem else None}
    if window is not None:
        inside = [u for t, u, _ in samples
                  if t is not None and window[0] + SMI_AVERAGED_S <= t <= window[1]]
        out["gpu_decode_samples"] = len(inside)
        out["gpu_util_decode_pct"] = sum(inside) / len(inside) if inside else None
    return out


def parse_smi(text: str, clock_offset: float = 0.0,
              window: Optional[tuple[float, float]] = None) -> dict[str, Any]:
    """`gpu_figures` of nvidia-smi's output lines."""
    samples = [s for s in (parse_sample(ln, clock_offset) for ln in text.splitlines()) if s]
    return gpu_figures(samples, window)


class GpuSampler:
    """nvidia-smi sampling the GPU every 0.5 s in the background (nothing without it); each
    sample carries nvidia-smi's own timestamp, so a pipe's buffering cannot shift it."""

    def __init__(self, smi: Optional[str]) -> None:
        self.proc: Optional[subprocess.Popen] = None
        self.offset = time.time() - time.perf_counter()
        if smi:
            self.out = tempfile.TemporaryFile()
            self.proc = subprocess.Popen([smi, *SMI_QUERY], stdout=self.out,
                                         stderr=subprocess.DEVNULL)

    def stop(self, window: Optional[tuple[float, float]] = None) -> dict[str, Any]:
        if self.proc is None:
            return parse_smi("", window=window)
        stop(self.proc)
        self.out.seek(0)
        text = self.out.read().decode("utf-8", "replace")
        self.out.close()
        return parse_smi(text, self.offset, window)


class ProcSampler:
    """A process standing in for the GPU (`--device-pid`: a llama.cpp RPC server lending a CPU,
    which computes asynchronously to the server's host work as a GPU does): every 0.25 s the
    share of the interval its threads ran on a CPU, as a utilisation in percent (over 100 when
    several ran at once), and its resident MiB, in `gpu_figures`' samples."""

    PERIOD_S = 0.25

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.samples: list[Sample] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="device-pid", daemon=True)
        self._thread.start()

    def _read(self) -> tuple[float, float]:
        """CPU seconds (user + system) and resident MiB, from /proc/PID/stat."""
        with open(f"/proc/{self.pid}/stat", encoding="ascii") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()  # after the command's name
        ticks = int(fields[11]) + int(fields[12])   # utime, stime (fields 14 and 15)
        return (ticks / os.sysconf("SC_CLK_TCK"),
                int(fields[21]) * os.sysconf("SC_PAGE_SIZE") / (1 << 20))  # rss (field 24)

    def _run(self) -> None:
        try:
            t0, (c0, _) = time.perf_counter(), self._read()
            while not self._done.wait(self.PERIOD_S):
                t, (c, mem) = time.perf_counter(), self._read()
                self.samples.append((t, 100.0 * (c - c0) / (t - t0), mem))
                t0, c0 = t, c
        except (OSError, ValueError, IndexError):
            pass  # the process is gone: the samples so far

    def stop(self, window: Optional[tuple[float, float]] = None) -> dict[str, Any]:
        self._done.set()
        self._thread.join()
        return gpu_figures(self.samples, window)


def command_output(cmd: list[str]) -> Optional[str]:
    """stdout and stderr of `cmd`, stripped (None when it cannot run)."""
    try:
        out = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def log_tail(logs: str, label: str, n: int = 3000) -> str:
    try:
        with open(os.path.join(logs, f"{label}.log"), "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - n))
            return fh.read().decode("utf-8", "replace")
    except OSError:
        return ""


def step_sums(url: str) -> dict[str, tuple[float, float]]:
    """(seconds, iterations) per part of this server's `skippy:step_seconds` (empty where the
    server has none: llama-server)."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            text = r.read().decode("utf-8", "replace")
    except (OSError, ValueError):
        return {}
    got: dict[str, list[float]] = {}
    for kind, part, value in _STEP.findall(text):
        got.setdefault(part, [0.0, 0.0])[kind == "count"] = float(value)
    ahead = _AHEAD.search(text)  # plans staged while the one before ran (a count, not a part)
    if ahead and got:
        got["staged_ahead"] = [float(ahead.group(1)), 0.0]
    for reason, value in _NOT_AHEAD.findall(text) if got else ():
        got["not_staged:" + reason] = [float(value), 0.0]
    gc_pauses = _GC.findall(text)  # the garbage collector's passes, every generation
    if gc_pauses and got:
        got["gc"] = [sum(map(float, gc_pauses)), 0.0]
    return {part: (v[0], v[1]) for part, v in got.items()}


def step_figures(before: dict[str, tuple[float, float]],
                 after: dict[str, tuple[float, float]]) -> dict[str, Optional[float]]:
    """Per engine iteration over a load (the histograms' growth): its wall time, the time in the
    model (the host's execution: on a GPU the device's step), the engine thread's own work, its
    waits on the model, the model's busy share of the wall time, and the share of steps the
    host staged while the step before ran (None from a server without the count) and of
    those that were not, for the two main reasons (`skippy:plans_not_staged_ahead`), and the
    garbage collector's pauses in the server's process (`skippy:gc_pause_seconds_total`, any
    thread's; None without them)."""
    def grew(part: str) -> tuple[float, float]:
        s1, n1 = after.get(part, (0.0, 0.0))
        s0, n0 = before.get(part, (0.0, 0.0))
        return s1 - s0, n1 - n0

    wall, steps = grew("wall")
    if not after or steps <= 0:
        return {k: None for k in ("steps", "step_wall_ms", "step_execute_ms", "step_engine_ms",
                                  "step_wait_ms", "step_gc_ms", "host_busy_pct",
                                  "staged_ahead_pct", *(k for _, k in NOT_AHEAD_SHARES))}
    def per(seconds: float) -> float:
        return seconds * 1e3 / steps

    execute = grew("execute")[0]
    shares = {key: (100 * grew("not_staged:" + reason)[0] / steps
                    if "not_staged:" + reason in after else None)
              for reason, key in NOT_AHEAD_SHARES}
    return {**shares, "steps": steps, "step_wall_ms": per(wall), "step_execute_ms": per(execute),
            "step_engine_ms": per(sum(grew(p)[0] for p in ENGINE_PARTS)),
            "step_wait_ms": per(grew("wait")[0]),
            "step_gc_ms": per(grew("gc")[0]) if "gc" in after else None,
            "host_busy_pct": 100 * execute / wall if wall > 0 else None,
            "staged_ahead_pct": (100 * grew("staged_ahead")[0] / steps
                                 if "staged_ahead" in after else None)}


def load_name(c: int, decode: bool) -> str:
    return f"decode c={c}" if decode else f"closed c={c}"


def measure(args: argparse.Namespace, cmd: list[str], label: str, c: int, logs: str,
            sampler_of: Callable[[], Any], decode: bool = False) -> dict[str, Any]:
    """One load on a fresh server, the GPU sampled meanwhile: serve_load's closed loop, or with
    `decode` one wave of `c` requests of `--decode-tokens` output tokens, whose decode phase
    (every request decoding) gets its own output rate and GPU utilisation. A server that does
    not start, or a load past `--load-timeout`, is a result with an `error` (the end of the
    server's log in the message): the rounds go on with the next load."""
    n = c if decode else requests_at(args, c)
    base = {"label": label, "load": load_name(c, decode), "concurrency": c, "requests": n,
            "completed": 0}
    try:
        served = Served(cmd, logs, label, args.start_timeout)
    except RuntimeError as exc:
        return {**base, "start_failed": True,
                "error": f"{label} did not start: {exc}; the end of its log: "
                         f"{log_tail(logs, label, 1500)}"}
    sampler = window = None
    try:
        load = argparse.Namespace(**{**vars(args), "requests": n})
        if decode:
            load.max_tokens = args.decode_tokens
        load = closed_args(load, served.url, label, c)
        sampler = sampler_of()
        before = step_sums(served.url)
        results, wall = asyncio.run(asyncio.wait_for(load_results(load), args.load_timeout))
        steps = step_figures(before, step_sums(served.url))
        result = load_result(load, results, wall)
        if decode:
            window = decode_window(results)
            span = window[1] - window[0] if window else None  # a window is never empty
            result["decode_phase_s"] = span
            result["decode_tokens_per_s"] = (chunks_within(results, *window) / span
                                             if window and span else None)
    except asyncio.TimeoutError:
        return {**base, "error": f"{label} at concurrency {c} took over --load-timeout "
                                 f"{args.load_timeout} s"}
    finally:
        gpu = sampler.stop(window if decode else None) if sampler else {}
        served.close()
    return {**result, **gpu, **steps, "load": base["load"]}


def count_equal(a: Optional[list], b: Optional[list]) -> tuple[int, int]:
    """(requests whose greedy text is the same on both servers, requests compared)."""
    if a is None or b is None:
        return 0, 0
    return sum(1 for x, y in zip(a, b) if x is not None and x == y), max(len(a), len(b))


def finite(x: Any) -> Any:
    """None for NaN (no value: JSON and the table show it as missing)."""
    return None if isinstance(x, float) and math.isnan(x) else x


def median_of(results: Sequence[dict[str, Any]], key: str) -> Optional[float]:
    """The median of `key` over the results that have a value for it, NaN (no value: a load
    without a gap has no gap percentile) counted as none; None when none has one. The same
    whether the results are fresh or read back from the JSON lines, where NaN is written as
    null."""
    values = [v for r in results if (v := finite(r.get(key))) is not None]
    return statistics.median(values) if values else None


def summarize(runs: dict[str, dict[str, list[dict[str, Any]]]],
              equal: dict[str, list[int]], meta: dict[str, Any]) -> list[dict[str, Any]]:
    """Per load measured so far (`runs`: load name, server, its results), the medians of each
    server's figures and ours / theirs (a load that failed counts in `rounds`, not in a
    median)."""
    rows = []
    for name, by_server in runs.items():
        done = [r for v in by_server.values() for r in v]
        if not done:
            continue
        decode = name.startswith("decode")
        row: dict[str, Any] = {"label": "medians", "load": name,
                               "concurrency": done[0]["concurrency"],
                               "requests": done[0]["requests"],
                               "rounds": min(len(v) for v in by_server.values()),
                               "failed": sum(1 for r in done if r.get("error"))}
        for key, _, _ in DECODE_MEASURES if decode else MEASURES:
            ours = median_of(by_server[OURS], key) if OURS in by_server else None
            theirs = median_of(by_server[THEIRS], key) if THEIRS in by_server else None
            row[key] = {OURS: ours, THEIRS: theirs,
                        "ratio": ours / theirs if ours is not None and theirs else None}
        if len(by_server) == 2:
            row["equal_outputs"], row["compared_outputs"] = equal.get(name, (0, 0))
        rows.append({**row, **meta})
    return rows


def shown(cmd: list[str], args: argparse.Namespace) -> str:
    """A command line as the table shows it: the model as given, no interpreter path."""
    model = os.path.abspath(args.model)
    words = ["python" if w == sys.executable else args.model if w == model else w for w in cmd]
    if words and os.path.isabs(words[0]):
        words[0] = os.path.basename(words[0])
    return shlex.join(words)


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any], args: argparse.Namespace,
             servers: list[tuple[str, list[str]]]) -> str:
    def fmt(x: Any) -> str:
        return "n/a" if x is None else f"{x:.0f}" if abs(x) >= 100 else f"{x:.3g}"

    version = meta.get("llama_server_version") or ""
    version = next((ln for ln in version.splitlines() if ln.startswith("version")),
                   version.splitlines()[0] if version else "n/a")
    dates = meta.get("merged") or [meta["date"]]
    out = [f"{OURS} against {THEIRS}, {', '.join(dates)}", "",
           f"- model: {os.path.basename(args.model)}; GPU: {meta.get('gpu_name') or 'n/a'}; "
           f"llama-server {version}",
           f"- {args.prompt_tokens}-token prompts, half sharing a {args.shared_prefix}-token "
           f"prefix, {args.max_tokens} output tokens, greedy, streamed; medians of "
           f"{max((r['rounds'] for r in rows), default=0)} alternating rounds, a fresh server "
           "per load"]
    if args.decode_tokens:
        out.append(f"- decode phase: one wave of as many requests as the concurrency, "
                   f"{args.decode_tokens} output tokens each; its rate and the GPU's "
                   "utilisation from the last first token to the earliest last token")
    out += [f"- {label}: `{shown(cmd, args)}`" for label, cmd in servers]
    if len({r["rounds"] for r in rows}) > 1:  # a run cut short: the loads' own counts
        out.append("- rounds per load: " + ", ".join(f"{r['load']}: {r['rounds']}"
                                                   for r in rows))
    failed = sum(r.get("failed", 0) for r in rows)
    if failed:
        out.append(f"- {failed} load(s) failed (their errors are in the JSON lines)")
    for label, n in (meta.get("skipped") or {}).items():
        out.append(f"- {label} did not start {n} times: skipped for the rest of the run")
    if meta.get("interrupted"):
        out.append("- interrupted: the rounds stopped before their end")
    out += ["", f"| concurrency | requests | measure | {OURS} | {THEIRS} | ours ÷ theirs |",
            "|---:|---:|---|---:|---:|---:|"]
    for row in rows:
        decode = row["load"].startswith("decode")
        lead = (f"| {row['concurrency']}{', decode' if decode else ''} | "
                f"{row['requests']} |")
        for key, name, scale in DECODE_MEASURES if decode else MEASURES:
            v = row[key]
            vals = [None if v[s] is None else v[s] * scale for s in (OURS, THEIRS)]
            out.append(f"{lead} {name} | {fmt(vals[0])} | {fmt(vals[1])} | {fmt(v['ratio'])} |")
        if "equal_outputs" in row:
            out.append(f"{lead} equal greedy outputs | {row['equal_outputs']} of "
                       f"{row['compared_outputs']} | | |")
    return "\n".join(out) + "\n"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--model", help="GGUF both servers load (required unless --write-model)")
    ap.add_argument("--write-model", metavar="PATH",
                    help="write the GPU table's 0.85 B f16 random-weight llama here and exit")
    ap.add_argument("--write-rpc-model", metavar="PATH",
                    help="write the model of the RPC table (4.3 M parameters, f32; "
                         "BENCHMARKS.md) here and exit")
    ap.add_argument("--llama-server", default=None, metavar="PATH",
                    help="llama-server binary (default: $LLAMA_SERVER, else llama-server on "
                         "PATH)")
    ap.add_argument("--servers", choices=("both", "ours", "theirs"), default="both")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")],
                    default=[1, 16, 64], metavar="C,...")
    ap.add_argument("--requests", type=int, default=None,
                    help="per load (default: 4 x the concurrency, at least 8)")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--shared-prefix", type=int, default=384,
                    help="tokens half of the prompts share")
    ap.add_argument("--max-tokens", type=int, default=64, help="output tokens per request")
    ap.add_argument("--lanes", type=int, default=64, help="sequences at once, both servers")
    ap.add_argument("--ctx-size", type=int, default=65536, help="KV cells in all, both servers")
    ap.add_argument("--threads", type=int, default=None,
                    help="threads for both servers (default: each server's own)")
    ap.add_argument("--ngl", default=None, metavar="N|auto|all",
                    help="layers offloaded, both servers (default: all for this server when its "
                         "serve has --n-gpu-layers, else not passed; 99 for llama-server)")
    ap.add_argument("--ours-args", default="", metavar="FLAGS",
                    help="extra flags for this server, one shell-quoted string "
                         "(--ours-args='--flag V')")
    ap.add_argument("--theirs-args", default="", metavar="FLAGS",
                    help="extra flags for llama-server, after (so overriding) the defaults")
    ap.add_argument("--seed", type=int, default=0, help="of the prompts and of --write-model")
    ap.add_argument("--decode-tokens", type=int, default=0, metavar="N",
                    help="after each round's loads, one wave of as many requests as the "
                         "highest concurrency with N output tokens each, on each server: the "
                         "decode phase's output rate and GPU utilisation (default 0: none)")
    ap.add_argument("--timeout", type=float, default=600, help="per request without data, s")
    ap.add_argument("--load-timeout", type=float, default=3600, help="per load, s")
    ap.add_argument("--start-timeout", type=float, default=300, help="per server start, s")
    ap.add_argument("--start-failures", type=int, default=2, metavar="N",
                    help="a server that failed to start N times is skipped for the rest of the "
                         "run (default 2; 0: never)")
    ap.add_argument("--require-equal", action="store_true",
                    help="exit 1 when the servers' greedy outputs differ for any request")
    ap.add_argument("--logs", default=None, metavar="DIR",
                    help="keep the servers' logs here (default: a temporary folder)")
    ap.add_argument("--device-pid", type=int, default=None, metavar="PID",
                    help="a process standing in for the GPU, whose CPU time share is reported "
                         "as the GPU's utilisation: a llama.cpp RPC server lending a CPU, the "
                         "servers given its --rpc in --ours-args and --theirs-args "
                         "(default: nvidia-smi's GPU)")
    ap.add_argument("--json", help="append every load, the medians and the run as JSON lines")
    ap.add_argument("--markdown", help="write the table here")
    ap.add_argument("--merge", nargs="+", metavar="JSONL",
                    help="run nothing: the table of the loads recorded in these --json files "
                         "(earlier runs of the same workload, e.g. two calls on one machine), "
                         "their medians taken together; --markdown and --json as for a run")
    return ap


#: The options that make two runs' loads the same workload (`--merge` refuses others; runs of
#: either server or both merge, each server's medians over the runs that had it).
WORKLOAD = ("model", "concurrency", "requests", "prompt_tokens", "shared_prefix",
            "max_tokens", "lanes", "ctx_size", "threads", "ngl", "ours_args", "theirs_args",
            "seed", "decode_tokens")


def read_lines(path: str) -> list[dict[str, Any]]:
    """The JSON lines of one `--json` file for `--merge`. A file that is missing or empty is
    skipped with a warning, and so is a line cut short by a run stopped while writing it: the
    file's last line, or one followed by the next run's `run` line (a later run appending to
    the same file); any other line that is not JSON makes the merge fail."""
    try:
        with open(path, encoding="utf-8") as fh:
            lines = fh.read().splitlines()
    except FileNotFoundError:
        print(f"gpu_rounds --merge: warning: no file {path}, skipped", file=sys.stderr)
        return []
    except OSError as exc:
        raise SystemExit(f"gpu_rounds --merge: {exc}") from None
    numbered = [(n, line) for n, line in enumerate(lines, 1) if line.strip()]
    if not numbered:
        print(f"gpu_rounds --merge: warning: {path} is empty, skipped", file=sys.stderr)
        return []
    rows: list[Any] = []  # a dict, or the ValueError of a line that is not JSON
    for n, line in numbered:
        try:
            row = json.loads(line)
        except ValueError as exc:
            rows.append(exc)
            continue
        if not isinstance(row, dict):
            raise SystemExit(f"gpu_rounds --merge: {path}:{n} is not a JSON object")
        rows.append(row)
    for i, (n, _) in enumerate(numbered):
        if not isinstance(rows[i], ValueError):
            continue
        last = i + 1 == len(rows)
        if last or (isinstance(rows[i + 1], dict) and rows[i + 1].get("label") == "run"):
            print(f"gpu_rounds --merge: warning: {path}:{n} is cut short (a run stopped while "
                  "writing it), skipped", file=sys.stderr)
            continue
        raise SystemExit(f"gpu_rounds --merge: {path}:{n} is not JSON ({rows[i]})")
    return [r for r in rows if isinstance(r, dict)]


def merge(args: argparse.Namespace) -> int:
    """`--merge`: the loads, output comparisons and run lines of earlier runs' JSON lines, one
    table of their medians; runs of another workload (`WORKLOAD`) are refused."""
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {}
    equal: dict[str, list[int]] = {}
    metas: list[dict[str, Any]] = []
    for path in args.merge:
        rows = read_lines(path)
        for row in rows:
            label = row.get("label")
            if label == "run":
                metas.append(row)
            elif label in (OURS, THEIRS):
                runs.setdefault(row["load"], {}).setdefault(label, []).append(row)
            elif label == "equal":
                got = equal.setdefault(row["load"], [0, 0])
                got[0] += row["equal"]
                got[1] += row["compared"]
    if not metas:
        raise SystemExit("gpu_rounds --merge: no run line in " + ", ".join(args.merge)
                         + " (files written by --json)")
    parsed = [build_parser().parse_args(m["argv"][2:]) for m in metas]
    for other, m in zip(parsed[1:], metas[1:]):
        differ = [k for k in WORKLOAD if getattr(other, k) != getattr(parsed[0], k)]
        if differ:
            flags = ", ".join("--" + k.replace("_", "-") for k in differ)
            raise SystemExit(f"gpu_rounds --merge: the run of {m['date']} differs from that of "
                             f"{metas[0]['date']} in {flags}")
    commands: dict[str, list[str]] = {}
    for m in metas:
        for label, cmd in m["commands"].items():
            commands.setdefault(label, cmd)
    servers = [(label, commands[label]) for label in (OURS, THEIRS) if label in commands]
    for by_server in runs.values():
        for label, _ in servers:
            by_server.setdefault(label, [])
    meta = {**metas[0], "merged": [m["date"] for m in metas]}
    rows = summarize(runs, equal, meta)
    for row in rows:
        emit(row, args.json)
    text = markdown(rows, meta, parsed[0], servers)
    print(text)
    if args.markdown:
        with open(args.markdown, "w", encoding="utf-8") as fh:
            fh.write(text)
    return 0


_stopped: list[int] = []  # the signals that asked this run to stop


def _stop(signum: int, frame: Any) -> None:
    _stopped.append(signum)
    raise KeyboardInterrupt


def raise_if_stopped() -> None:
    """KeyboardInterrupt where a stop was asked for: a signal's KeyboardInterrupt raised where
    Python prints exceptions as ignored (a fork hook, a finalizer) is otherwise lost."""
    if _stopped:
        raise KeyboardInterrupt


def stoppable() -> Callable[[], None]:
    """SIGINT raises KeyboardInterrupt even where the process started with it ignored (a
    command run without job control, `timeout -s INT`), and so does SIGTERM (`timeout`'s
    default): the table of what was measured is written either way. Each stop is recorded as
    well, and the rounds check for one before each load and at their end (raise_if_stopped).
    Returns what puts the handlers back (nothing to do outside the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    _stopped.clear()
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    for sig in before:
        signal.signal(sig, _stop)

    def restore() -> None:
        for sig, handler in before.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
    return restore


def main(argv: Optional[list[str]] = None) -> int:
    restore = stoppable()
    try:
        return _main(argv)
    finally:
        restore()


def _main(argv: Optional[list[str]]) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.write_model or args.write_rpc_model:
        write_model(args.write_model or args.write_rpc_model, args.seed,
                    rpc=bool(args.write_rpc_model))
        return 0
    if args.merge:
        return merge(args)
    if not args.model:
        ap.error("--model is required (or --write-model PATH to write one)")
    if (args.rounds < 1 or min(args.concurrency) < 1 or (args.requests or 1) < 1
            or args.max_tokens < 1 or not 0 < args.shared_prefix < args.prompt_tokens
            or args.decode_tokens < 0):
        ap.error("--rounds, --requests, --max-tokens and every --concurrency must be >= 1, "
                 "--decode-tokens >= 0, and 0 < --shared-prefix < --prompt-tokens")
    lane = args.ctx_size // args.lanes
    if args.prompt_tokens + max(args.max_tokens, args.decode_tokens) > lane:
        ap.error(f"a lane holds {lane} tokens (--ctx-size {args.ctx_size} / --lanes "
                 f"{args.lanes}): --prompt-tokens {args.prompt_tokens} plus --max-tokens "
                 f"{args.max_tokens} or --decode-tokens {args.decode_tokens} does not fit")
    theirs = find_llama_server(args.llama_server) if args.servers != "ours" else None
    theirs = shutil.which(theirs) if theirs else None  # a given path too must be a program
    if args.servers != "ours" and not theirs:
        ap.error(f"no llama-server: not --llama-server ({args.llama_server or 'not given'}), "
                 f"not $LLAMA_SERVER ({os.environ.get('LLAMA_SERVER') or 'unset'}), not on PATH "
                 "(or --servers ours)")
    args.theirs_ngl = args.ngl if args.ngl is not None else "99"
    args.ours_ngl = args.ngl
    if args.servers != "theirs" and args.ngl is None and serve_has_ngl():
        args.ours_ngl = "all"
    servers = ([(OURS, ours_cmd(args))] if args.servers != "theirs" else []) + (
        [(THEIRS, theirs_cmd(args, theirs))] if theirs else [])
    smi = shutil.which("nvidia-smi")
    meta: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "argv": ["python", "bench/gpu_rounds.py", *(argv if argv is not None else sys.argv[1:])],
        "commands": {label: cmd for label, cmd in servers},
        "llama_server_version": command_output([theirs, "--version"]) if theirs else None,
        "gpu_name": command_output([smi, "--query-gpu=name", "--format=csv,noheader"])
        if smi else None}
    if args.device_pid is not None:
        try:
            with open(f"/proc/{args.device_pid}/cmdline", "rb") as fh:
                shown_cmd = fh.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            ap.error(f"--device-pid: no process {args.device_pid}")
        meta["gpu_name"] = (f"process {args.device_pid} ({shown_cmd}), its CPU time share as "
                            "the utilisation")
    sampler_of: Callable[[], Any] = ((lambda: ProcSampler(args.device_pid))
                                     if args.device_pid is not None
                                     else (lambda: GpuSampler(smi)))
    if args.json and os.path.isfile(args.json):  # a line cut short by a run stopped while
        with open(args.json, "rb+") as end:     # writing it stays a line of its own
            end.seek(0, os.SEEK_END)
            if end.tell():
                end.seek(-1, os.SEEK_END)
                if end.read(1) != b"\n":
                    end.write(b"\n")
    emit({"label": "run", **meta}, args.json)
    for label, cmd in servers:
        print(f"# {label}: {shlex.join(cmd)}", file=sys.stderr, flush=True)
    print(f"# GPU: {meta['gpu_name'] or 'n/a (no nvidia-smi)'}", file=sys.stderr, flush=True)
    loads = [(c, False) for c in args.concurrency]
    if args.decode_tokens:
        loads.append((max(args.concurrency), True))
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {
        load_name(c, d): {label: [] for label, _ in servers} for c, d in loads}
    equal = {name: [0, 0] for name in runs}
    logs_dir = args.logs or tempfile.mkdtemp(prefix="gpu-rounds-")
    os.makedirs(logs_dir, exist_ok=True)

    def table() -> str:
        text = markdown(summarize(runs, equal, meta), meta, args, servers)
        if args.markdown:
            with open(args.markdown, "w", encoding="utf-8") as fh:
                fh.write(text)
        return text

    start_failures = {label: 0 for label, _ in servers}
    meta["skipped"] = {}  # server: its failed starts, once --start-failures is reached
    try:
        for rnd in range(1, args.rounds + 1):
            for c, decode in loads:
                name = load_name(c, decode)
                this: dict[str, dict[str, Any]] = {}
                for label, cmd in servers:
                    if label in meta["skipped"]:
                        continue
                    raise_if_stopped()
                    print(f"# round {rnd}/{args.rounds}: {label}, {name}, "
                          f"{c if decode else requests_at(args, c)} requests",
                          file=sys.stderr, flush=True)
                    result = measure(args, cmd, label, c, logs_dir, sampler_of, decode)
                    result["round"] = rnd
                    runs[name][label].append(result)
                    emit({k: finite(v) for k, v in result.items() if k != "outputs"}, args.json)
                    if result.get("start_failed"):
                        start_failures[label] += 1
                        if start_failures[label] == args.start_failures:
                            meta["skipped"][label] = start_failures[label]
                    table()
                    if result.get("error"):
                        print(f"#   failed: {result['error']}", file=sys.stderr, flush=True)
                        if label in meta["skipped"]:
                            print(f"# {label} did not start {start_failures[label]} times: "
                                  "skipped for the rest of the run", file=sys.stderr, flush=True)
                        continue
                    this[label] = result
                    util = result.get("gpu_util_decode_pct" if decode else "gpu_util_mean_pct")
                    print(f"#   {result['completed']}/{result['requests']} done, "
                          f"{result['output_tokens_per_s']:.1f} tok/s, TTFT p50 "
                          f"{result['ttft_p50_s'] * 1e3:.0f} ms, gap p50 "
                          f"{result['itl_p50_s'] * 1e3:.1f} ms, GPU "
                          f"{'n/a' if util is None else f'{util:.0f} %'}"
                          + (f", errors: {result['errors']}" if result["errors"] else ""),
                          file=sys.stderr, flush=True)
                if len(this) == 2:
                    same, n = count_equal(this[OURS].get("outputs"), this[THEIRS].get("outputs"))
                    equal[name][0] += same
                    equal[name][1] += n
                    emit({"label": "equal", "load": name, "round": rnd, "equal": same,
                          "compared": n}, args.json)
                    table()
                    print(f"#   greedy outputs equal for {same} of {n} requests",
                          file=sys.stderr, flush=True)
        raise_if_stopped()
    except KeyboardInterrupt:
        meta["interrupted"] = True
        print("# interrupted: the table of what was measured", file=sys.stderr, flush=True)
    finally:
        if not args.logs:
            shutil.rmtree(logs_dir, ignore_errors=True)
    for row in summarize(runs, equal, meta):
        emit(row, args.json)
    print(table())
    if meta.get("interrupted"):
        return 130
    differ = [name for name, (same, n) in equal.items() if same < n]
    if differ and args.require_equal:
        print(f"# greedy outputs differ in {differ} (--require-equal)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
