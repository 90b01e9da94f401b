"""Staged serving under load: the medium model split into P = 1, 2, 3 local stage processes
behind `skippy-scheduler serve`, the transport's cost per plan, and the closed form.

    python bench/serve_load.py write-model bench-58m.gguf
    python bench/stages_load.py --model bench-58m.gguf --json stages.json --markdown
    python bench/stages_load.py --model bench-58m.gguf --parts rpc --json stages.json \
        --rpc-server BUILD/bin/ggml-rpc-server --rpc-llama-server BUILD/bin/llama-server

`serve` (the three parts below, `--parts` picks some):

- **load**: for each `--stages` entry P the model is split
  (`skippy_scheduler.hosts.stages.split`, P = 1 is the unsplit model on plain `serve`),
  `skippy-scheduler serve --stages DIR` starts its P workers (one llama.cpp thread each,
  `--threads`), and bench/serve_load.py's closed-loop client sends `--requests` streamed
  greedy completions from `--concurrency` clients. With `--pipeline` (default both: `on,off`)
  the server keeps P plans in flight on disjoint groups of sequences (`--inflight P`), or one
  (`--inflight 1`: the stages take turns). Requests are greedy with `ignore_eos`, as in
  serve_load's comparison (the last stage samples).
- **transport**: a plan frame, its activation header and `rows x n_embd` float32 activations,
  encoded, sent over a pyzmq PUSH/PULL pair on ipc and on tcp loopback, received and decoded
  (the stage worker's path without the model), `--transport-iters` times per size: µs per
  message and µs per MB of activations.
- **closed form** (docs/lab.md "Staged serving"): from the P = 1 run's median inter-token gap
  g1 (one plan of all b decode rows through all layers) and the ipc transport cost h of a
  group's activations, what a P-stage pipeline gives if a stage's cost divides like its layers
  and its rows (linear, no fixed cost per plan: an optimistic bound): P groups of b/P rows, a
  stage's cost of a group s = g1 / P x (b/P) / b, round trip C = P x s + P x h, gap =
  max(C, P x s), tokens/s = b / gap; with one plan in flight the gap is g1 + P x h.

`rpc` (with `--rpc-server PATH --rpc-llama-server PATH`, skippy_bench/rpc_split.py): llama.cpp's
own split beside ours, for each P: P `ggml-rpc-server` processes on loopback (`--threads`
each) and `llama-server --rpc ...` with every layer offloaded, device k holding stage k's layers
(checked in its log), the same context, lanes, KV type and the same closed-loop load; P = 1 is
plain llama-server with the same options.

Output: one JSON line per run (appended to `--json`); `--markdown` prints the tables.
One machine's cores are shared by all the stage processes, the server and the client: see
BENCHMARKS.md for what that can and cannot show.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import tempfile
import time

import numpy as np

from skippy_bench.loads import load_args as closed_loop_args, run_load
from skippy_bench.reports import emit, percentile
from skippy_bench.servers import Served, log_tail


def start_server(args: argparse.Namespace, stage_dir: str | None, inflight: int, work: str,
                 name: str) -> Served:
    cmd = [sys.executable, "-m", "skippy_scheduler.cli", "serve", "--model",
           os.path.abspath(args.model), "--threads", str(args.threads),
           "-np", str(args.concurrency), "-c", str(args.concurrency * args.lane_tokens),
           "--inflight", str(inflight),
           "--served-model-name", "bench", "--log-level", "warning"]
    if stage_dir is not None:
        cmd += ["--stages", stage_dir]
    try:
        return Served(cmd, work, name, args.start_timeout, stop_timeout_s=60)
    except RuntimeError as exc:
        tail = log_tail(os.path.join(work, f"{name}.log"), 2000)
        raise RuntimeError(f"the server did not start ({exc}): {tail}") from None


def load_args(args: argparse.Namespace, url: str, label: str, model: str | None = None,
              token_ids: bool = True) -> argparse.Namespace:
    """bench/serve_load.py's closed loop as every part of this benchmark runs it."""
    return closed_loop_args(
        url, label, model=model, concurrency=args.concurrency, requests=args.requests,
        prompt_tokens=args.prompt_tokens, shared_prefix=args.prompt_tokens // 2,
        shared_fraction=0.0, max_tokens=args.max_tokens, seed=args.seed, timeout=args.timeout,
        token_ids=token_ids)


def load_runs(args: argparse.Namespace, work: str) -> list[dict]:
    from skippy_scheduler.hosts.stages.split import split_model

    out = []
    for p in args.stages:
        stage_dir = None
        if p > 1:
            stage_dir = os.path.join(work, f"p{p}")
            split_model(args.model, stage_dir, p)
        for pipelined in (args.pipeline if p > 1 else [False]):
            inflight = p if pipelined else 1
            served = start_server(args, stage_dir, inflight, work, f"serve-{p}")
            try:
                label = f"P={p}" + (" pipelined" if pipelined else "")
                result = asyncio.run(run_load(load_args(args, served.url, label)))
            finally:
                served.close()
            result.update(part="load", stages=p, inflight=inflight, threads=args.threads)
            emit(result, args.json)
            out.append(result)
    return out


def rpc_runs(args: argparse.Namespace, work: str) -> list[dict]:
    """The same load on llama.cpp's RPC split at every P (skippy_bench/rpc_split.py)."""
    from skippy_bench.rpc_split import RpcSplit

    out = []
    for p in args.stages:
        with RpcSplit(args, p, work) as split:
            result = asyncio.run(run_load(load_args(
                args, split.url, f"llama.cpp RPC P={p}", model="bench", token_ids=False)))
        result.update(part="rpc", stages=p, threads=args.threads, placement=split.placement,
                      command=" ".join(split.command))
        emit(result, args.json)
        out.append(result)
    return out


def transport_runs(args: argparse.Namespace, work: str) -> list[dict]:
    import zmq

    from skippy_scheduler.hosts.stages.wire import (decode_activations, decode_plan,
                                                    encode_activations, encode_plan)

    n_embd = args.n_embd
    out = []
    for kind in ("ipc", "tcp"):
        ctx = zmq.Context()
        pull = ctx.socket(zmq.PULL)
        address = (f"ipc://{work}/transport" if kind == "ipc" else "tcp://127.0.0.1:*")
        pull.bind(address)
        push = ctx.socket(zmq.PUSH)
        push.connect(pull.getsockopt_string(zmq.LAST_ENDPOINT))
        for rows in args.transport_rows:
            offsets = np.arange(rows + 1, dtype=np.int64)
            lanes = np.arange(rows, dtype=np.int32) % 256
            tokens = np.ones(rows, dtype=np.int32)
            positions = np.full(rows, 100, dtype=np.int32)
            acts = np.random.default_rng(0).standard_normal((rows, n_embd)).astype(np.float32)
            times = []
            for i in range(args.transport_iters + 1):
                t0 = time.perf_counter()
                frame = encode_plan(step=i, serial=i + 1, row_offsets=offsets, row_lanes=lanes,
                                    tokens=tokens, positions=positions,
                                    sample_last=np.ones(rows, dtype=np.uint8),
                                    phases=np.full(rows, 2, dtype=np.uint8), new_rows=[],
                                    row_restore=[-1] * rows, release_lanes=[])
                head, data = encode_activations(i, acts)
                push.send_multipart([b"plan", frame, head, data], copy=True)
                parts = pull.recv_multipart(copy=False)
                view = decode_plan(parts[1].buffer)
                got = decode_activations(parts[2].buffer, parts[3].buffer, view.step, rows, n_embd)
                assert got.shape == (rows, n_embd)
                if i:  # the first one warms the sockets up
                    times.append((time.perf_counter() - t0) * 1e6)
            mb = rows * n_embd * 4 / 1e6
            med = percentile(times, 50)
            result = {"part": "transport", "transport": kind, "rows": rows, "n_embd": n_embd,
                      "activation_mb": mb, "iters": args.transport_iters,
                      "us_per_plan_p50": med, "us_per_plan_p99": percentile(times, 99),
                      "us_per_mb": med / mb}
            emit(result, args.json)
            out.append(result)
        mine = [r for r in out if r["transport"] == kind]
        if len(mine) > 1:  # the marginal cost of activations: the slope over the sizes
            lo, hi = mine[0], mine[-1]
            slope = {"part": "transport_slope", "transport": kind,
                     "us_per_mb": (hi["us_per_plan_p50"] - lo["us_per_plan_p50"])
                     / (hi["activation_mb"] - lo["activation_mb"]),
                     "fixed_us": lo["us_per_plan_p50"]}
            emit(slope, args.json)
            out.append(slope)
        push.close(0)
        pull.close(0)
        ctx.term()
    return out


def closed_form_rows(loads: list[dict], transports: list[dict], concurrency: int) -> list[dict]:
    """The closed form at each P > 1 from the P = 1 run and the ipc transport figures."""
    base = next((r for r in loads if r["stages"] == 1), None)
    near = [t for t in transports if t["part"] == "transport" and t["transport"] == "ipc"]
    if base is None:
        return []
    gap1 = base["itl_p50_s"] * 1e6  # one plan of every decode row, all layers
    out = []
    for p in sorted({r["stages"] for r in loads if r["stages"] > 1}):
        rows = -(-concurrency // p)  # a group's decode rows
        # The transport figure of the measured size nearest to a group's activations.
        hop = min(near, key=lambda t: abs(t["rows"] - rows))["us_per_plan_p50"] if near else 0.0
        stage = gap1 / p * rows / concurrency  # a stage's share of the layers, a group's rows
        trip = p * stage + p * hop  # P stages, P hops (the last one back to the driver)
        gap = max(trip, p * stage)  # P groups: the slowest stage serves P plans a round
        out.append({"part": "closed_form", "stages": p, "group_rows": rows, "hop_us": hop,
                    "stage_us": stage, "round_trip_us": trip, "gap_us": gap,
                    "tokens_s": p * rows * 1e6 / gap,
                    "one_plan_gap_us": gap1 + p * hop})  # no pipelining: stages take turns
    return out


def markdown(results: list[dict]) -> str:
    lines = ["| stages | plans in flight | output tok/s | p99 TTFT (s) | p50 ITL (ms) | "
             "p99 ITL (ms) | short outputs |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in (r for r in results if r["part"] == "load"):
        lines.append(f"| {r['stages']} | {r['inflight']} | {r['output_tokens_per_s']:.1f} | "
                     f"{r['ttft_p99_s']:.2f} | {r['itl_p50_s'] * 1e3:.1f} | "
                     f"{r['itl_p99_s'] * 1e3:.1f} | {r['short_outputs']} |")
    rpc = [r for r in results if r["part"] == "rpc"]
    if rpc:
        lines += ["", "| llama.cpp RPC split: stages | output tok/s | p99 TTFT (s) | "
                      "p50 ITL (ms) | p99 ITL (ms) | short outputs | layers per device |",
                  "|---:|---:|---:|---:|---:|---:|---|"]
        for r in rpc:
            layers = " ".join(f"{lo}-{hi - 1}" for lo, hi in r["placement"]["ranges"])
            lines.append(f"| {r['stages']} | {r['output_tokens_per_s']:.1f} | "
                         f"{r['ttft_p99_s']:.2f} | {r['itl_p50_s'] * 1e3:.1f} | "
                         f"{r['itl_p99_s'] * 1e3:.1f} | {r['short_outputs']} | "
                         f"{layers if r['stages'] > 1 else 'all on one CPU'} |")
    lines += ["", "| transport | rows | activations (MB) | µs per plan (p50) | µs per MB |",
              "|---|---:|---:|---:|---:|"]
    for r in (r for r in results if r["part"] == "transport"):
        lines.append(f"| {r['transport']} | {r['rows']} | {r['activation_mb']:.3f} | "
                     f"{r['us_per_plan_p50']:.0f} | {r['us_per_mb']:.0f} |")
    for r in (r for r in results if r["part"] == "transport_slope"):
        lines.append(f"| {r['transport']}: fixed + per MB | | | {r['fixed_us']:.0f} | "
                     f"{r['us_per_mb']:.0f} |")
    forms = [r for r in results if r["part"] == "closed_form"]
    if forms:
        lines += ["", "| stages | closed-form gap (ms) | closed-form tok/s | measured p50 ITL "
                      "pipelined (ms) |", "|---:|---:|---:|---:|"]
        for f in forms:
            got = next((r for r in results if r["part"] == "load" and r["stages"] == f["stages"]
                        and r["inflight"] > 1), None)
            measured = f"{got['itl_p50_s'] * 1e3:.1f}" if got else "-"
            lines.append(f"| {f['stages']} | {f['gap_us'] / 1e3:.1f} | {f['tokens_s']:.1f} | "
                         f"{measured} |")
    return "\n".join(lines)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--model", help="the GGUF to split (bench/serve_load.py write-model)")
    ap.add_argument("--parts", default=None,
                    help="comma-separated: load, transport (the closed form follows from both), "
                         "rpc (default: load,transport, and rpc with the two paths below)")
    ap.add_argument("--rpc-server", help="llama.cpp's ggml-rpc-server binary (the rpc part)")
    ap.add_argument("--rpc-llama-server", help="a llama-server built with -DGGML_RPC=ON")
    ap.add_argument("--stages", type=_ints, default=[1, 2, 3])
    ap.add_argument("--pipeline", type=lambda t: [x.strip() == "on" for x in t.split(",")],
                    default=[True, False], help="on, off or on,off (default)")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--lane-tokens", type=int, default=512, help="KV cells per request")
    ap.add_argument("--threads", type=int, default=1, help="llama.cpp threads per process")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--start-timeout", type=float, default=120)
    ap.add_argument("--n-embd", type=int, default=512, help="activation width (the bench model's)")
    ap.add_argument("--transport-rows", type=_ints, default=[1, 8, 16, 128, 512])
    ap.add_argument("--transport-iters", type=int, default=200)
    ap.add_argument("--json", help="append every result as one JSON line to this file")
    ap.add_argument("--markdown", action="store_true", help="print the BENCHMARKS.md tables")
    args = ap.parse_args(argv)
    with_rpc = bool(args.rpc_server or args.rpc_llama_server)
    parts = {p.strip() for p in (args.parts or "load,transport" + (",rpc" if with_rpc else ""))
             .split(",")}
    if parts & {"load", "rpc"} and not args.model:
        ap.error("the load and rpc parts need --model")
    if "rpc" in parts and not (args.rpc_server and args.rpc_llama_server):
        ap.error("the rpc part needs --rpc-server and --rpc-llama-server")
    work = tempfile.mkdtemp(prefix="skippy-stages-bench-")
    try:
        results: list[dict] = []
        if "transport" in parts:
            results += transport_runs(args, work)
        if "load" in parts:
            loads = load_runs(args, work)
            results += loads
            forms = closed_form_rows(loads, results, args.concurrency)
            for f in forms:
                emit(f, args.json)
            results += forms
        if "rpc" in parts:
            results += rpc_runs(args, work)
        if args.markdown:
            print(markdown(results))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
