"""This server with its defaults against llama-server, in alternating rounds (BENCHMARKS.md
"Serving against llama-server").

    python bench/serve_rounds.py --model bench-58m.gguf --rounds 3 \\
        --trace $TRACES/mooncake-fast25-conversation_trace.jsonl \\
        --json rounds.jsonl --markdown rounds-table.txt

(`bench-58m.gguf` from `python bench/serve_load.py write-model bench-58m.gguf`; llama-server
from `--llama-server PATH`, else `$LLAMA_SERVER`, else PATH; `$TRACES` the folder holding the
public Mooncake trace.)

Each round runs this server (`skippy-scheduler serve` with no tuning flags: only the model,
lanes, context, threads and kernels both servers share) and then llama-server (`-fa off -ctk f32
-ctv f32 -no-kvu -cb -tb T -b 512 -ub 512 --no-webui`, the same lanes, context and threads),
each on a fresh process per load, so no load inherits another's prefix cache. `--flash-attn on
--kv-type f16` gives both servers llama.cpp's flash attention over an f16 KV cache instead
(what llama-server does by default on the CPU: `-fa auto` resolves to on there, and its cache
is f16, one stream per slot when `-np` is given):

- **the closed loop** of `serve_load.py` at each `--concurrency` (default 1, 4, 16):
  `--requests` streaming requests of 512 prompt tokens, half sharing a 384-token prefix, 64
  output tokens, greedy with `ignore_eos`; each server's generated text is kept per request and
  compared with the other's: the run fails (exit 1) unless they are equal request for request;
- **the open-loop trace replay** of `trace_load.py` (with `--trace`): a slice of the Mooncake
  conversation trace at `--time-scale`, its SLO (`--ttft-slo-s`, `--itl-slo-s`, max gap).
  With `--slo-ttft-ms` / `--slo-itl-ms` the SLO is also told to this server (its `serve`
  flags of the same names; llama-server runs as it is), and the replay measures against it.

Printed at the end (and written with `--markdown` / appended as JSON lines to `--json`): per
load, the median over the rounds of each server's output tokens/s, p99 TTFT, p99 inter-token
gap (and for the trace: SLO attainment, goodput, the misses by reason, max gap), and ours ÷
llama-server's. A
warning says when llama-server met the trace's SLO for a third of its requests or more: the
load is then lighter than the comparison names: lower `--time-scale` (the arrival gaps'
factor) and run again.

`--servers theirs --only-trace --rounds 1` replays the trace on llama-server alone, to choose
`--time-scale` first. `--rounds 1 --requests 8 --concurrency 2 --max-requests 10` is a smoke
run of a few minutes.
"""
from __future__ import annotations

import argparse
import math
import asyncio
import json
import os
import shlex
import sys
import tempfile
from typing import Any, Optional

from skippy_bench import open_loop
from skippy_bench.loads import closed_args, run_load
from skippy_bench.reports import emit, markdown_table, median
from skippy_bench.servers import OURS, THEIRS, Served, find_llama_server

from skippy_scheduler.cli._common import positive_ms

CLOSED = (("output_tokens_per_s", "tok/s", True), ("ttft_p99_s", "p99 TTFT s", False),
          ("itl_p99_s", "p99 gap s", False))
OPEN = (("slo_attainment_pct", "SLO %", True), ("slo_also_pct", "SLO % at --also-ttft-slo-s", True),
        ("goodput_rps", "goodput req/s", True),
        ("slo_missed_ttft", "missed: TTFT only", False),
        ("slo_missed_gaps", "missed: gaps only", False),
        ("slo_missed_both", "missed: both", False),
        ("slo_missed_unserved", "missed: unserved", False),
        ("itl_max_s", "max gap s", False), ("ttft_p99_s", "p99 TTFT s", False),
        ("output_tokens_per_s", "tok/s", True))


def ours_cmd(args: argparse.Namespace) -> list[str]:
    """This server with no tuning flags: what both servers share, and nothing else but the SLO
    it is told (--slo-ttft-ms, --slo-itl-ms; the load's objective, not a tuning) unless
    --ours-args gives some, to compare a setting against the defaults."""
    return [sys.executable, "-m", "skippy_scheduler.cli", "serve", "--model",
            os.path.abspath(args.model), "--host", "127.0.0.1", "--threads", str(args.threads),
            "--max-active", str(args.lanes), "--ctx-size", str(args.ctx_size),
            "--served-model-name", "bench", "--log-level", "warning", *kernel_flags(args, OURS),
            *told_slo(args), *shlex.split(getattr(args, "ours_args", "") or "")]


def kernel_flags(args: argparse.Namespace, server: str) -> list[str]:
    """The attention kernel and KV cache type, the same for both servers (`--flash-attn`,
    `--kv-type` of the rounds; off and f32 by default, this server's own CPU defaults), each in
    its server's spelling."""
    fa, kv = getattr(args, "flash_attn", "off"), getattr(args, "kv_type", "f32")
    if server == OURS:
        return ["--flash-attn", fa, "--kv-type", kv]
    return ["-fa", fa, "-ctk", kv, "-ctv", kv]


def told_slo(args: argparse.Namespace) -> list[str]:
    """The SLO this server is told (`--slo-ttft-ms`, `--slo-itl-ms` of the rounds); none
    without them."""
    out = []
    for flag in ("slo_ttft_ms", "slo_itl_ms"):
        value = getattr(args, flag, None)
        if value is not None:
            out += ["--" + flag.replace("_", "-"), f"{value:g}"]
    return out


def theirs_cmd(args: argparse.Namespace, path: str) -> list[str]:
    t = str(args.threads)
    return [path, "-m", os.path.abspath(args.model), "--host", "127.0.0.1", "-a", "bench",
            "-c", str(args.ctx_size), "-np", str(args.lanes), "-cb", "-t", t, "-tb", t,
            "-b", "512", "-ub", "512", *kernel_flags(args, THEIRS), "-no-kvu", "--no-webui"]


def byte_token_ids(model: str) -> list[int]:
    """The ids of `model`'s byte tokens (llama.cpp's BYTE attribute: <0x00>..<0xFF> of an SPM
    vocabulary), read from its vocabulary alone."""
    import llama_cpp as ll

    from skippy_scheduler.hosts.llama.backend import init_backend

    init_backend()  # the package's log sink: llama.cpp's INFO lines are dropped
    params = ll.llama_model_default_params()
    params.vocab_only = True
    m = ll.llama_model_load_from_file(os.path.abspath(model).encode(), params)
    if not m:
        raise SystemExit(f"serve_rounds: llama.cpp could not read the vocabulary of {model}")
    try:
        vocab = ll.llama_model_get_vocab(m)
        return [t for t in range(ll.llama_vocab_n_tokens(vocab))
                if ll.llama_vocab_get_attr(vocab, t) & ll.LLAMA_TOKEN_ATTR_BYTE]
    finally:
        ll.llama_model_free(m)


def trace_args(args: argparse.Namespace, url: str, label: str) -> argparse.Namespace:
    ap = open_loop.build_parser()
    extra = ([] if not getattr(args, "byte_bias", None) else
             ["--extra", json.dumps({"logit_bias": args.byte_bias})])
    targs = ap.parse_args([
        "--url", url, "--label", label, "--model", "bench", "--trace", args.trace,
        "--start-s", str(args.start_s), "--max-requests", str(args.max_requests),
        "--time-scale", str(args.time_scale), "--ttft-slo-s", str(args.ttft_slo_s),
        "--itl-slo-s", str(args.itl_slo_s), "--progress-s", "1e9", *extra])
    open_loop.check_args(ap, targs)
    return targs


def run_trace(targs: argparse.Namespace, also_ttft_s: Optional[float] = None,
              grid: tuple[tuple[float, float], ...] = (),
              rows_to: Optional[str] = None) -> dict[str, Any]:
    """The replay's report; with `also_ttft_s`, also the share of the requests sent that met
    the SLO with that TTFT bound instead (the same gap bound), from the same replay; with
    `grid` ((TTFT s, gap s), ...), the report under each of those SLOs, from the same replay
    (`by_slo`, keyed by `slo_key`), and every request's text (`outputs`); with `rows_to`, one
    JSON line per request written there (trace_load.py's `--requests-out`)."""
    plan = open_loop.plan_requests(targs)
    outcomes, wall = asyncio.run(open_loop.replay(plan, targs))
    doc = open_loop.report(plan, outcomes, wall, targs)
    if rows_to:
        with open(rows_to, "w", encoding="utf-8") as fh:
            fh.writelines(json.dumps(row) + "\n"
                          for row in open_loop.request_rows(outcomes, targs))
    if grid:
        doc["by_slo"] = {
            slo_key(ttft, itl): open_loop.report(plan, outcomes, wall, argparse.Namespace(
                **{**vars(targs), "ttft_slo_s": ttft, "itl_slo_s": itl}))
            for ttft, itl in grid}
        doc["outputs"] = [o.result.text if o.result is not None and o.result.ok
                          and o.result.end > 0 else None for o in outcomes]
    if also_ttft_s is not None:
        other = argparse.Namespace(**{**vars(targs), "ttft_slo_s": also_ttft_s})
        sent = [o for o in outcomes if o.lag_s >= 0]  # as the report counts them
        met = sum(1 for o in sent if o.result is not None and o.result.end > 0
                  and open_loop.meets_slo(o.result, other))
        doc["also_ttft_slo_s"] = also_ttft_s
        doc["slo_also_pct"] = 100 * met / len(sent) if sent else 0.0
    return doc


def rows_path(args: argparse.Namespace, label: str, rnd: int, load: str) -> Optional[str]:
    """Where `--requests-out DIR` keeps one replay's request rows (None without it)."""
    if not args.requests_out:
        return None
    os.makedirs(args.requests_out, exist_ok=True)
    name = f"{label}-r{rnd}-{load}".replace("/", "x").replace(" ", "-").replace("=", "")
    return os.path.join(args.requests_out, name + ".jsonl")


def slo_key(ttft_s: float, itl_s: float) -> str:
    """An SLO's name in the grid's results: "TTFT ms/gap ms"."""
    return f"{ttft_s * 1e3:g}/{itl_s * 1e3:g}"


def _grid(text: str) -> tuple[tuple[float, float], ...]:
    """`--slo-grid`: TTFTxGAP pairs in ms, comma-separated ("2000x200,3000x500")."""
    pairs = []
    for part in text.split(","):
        ttft, sep, itl = part.strip().partition("x")
        if not sep:
            raise argparse.ArgumentTypeError(f"{part!r} is not TTFTxGAP (ms), e.g. 3000x500")
        pairs.append((positive_ms(ttft) / 1e3, positive_ms(itl) / 1e3))
    if not pairs:
        raise argparse.ArgumentTypeError("no SLO given")
    return tuple(pairs)


def run_grid(args: argparse.Namespace, theirs: Optional[str]) -> int:
    """`--slo-grid`: per round, llama-server replays the trace once (it takes no SLO: that one
    replay is scored under every SLO of the grid), and this server once per SLO, told it
    (`--slo-ttft-ms`, `--slo-itl-ms`). Medians over the rounds per SLO; greedy outputs compared
    request for request between each of our runs and llama-server's of the same round (where
    both completed the request)."""
    grid = args.slo_grid
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {
        slo_key(*slo): {OURS: [], THEIRS: []} for slo in grid}
    failures = []
    with tempfile.TemporaryDirectory(prefix="slo-grid-") as logs:
        for rnd in range(1, args.rounds + 1):
            theirs_doc = None
            if theirs:
                print(f"# round {rnd}: {THEIRS}, trace", file=sys.stderr, flush=True)
                served = Served(theirs_cmd(args, theirs), logs, THEIRS, args.start_timeout)
                try:
                    theirs_doc = run_trace(trace_args(args, served.url, THEIRS), grid=grid,
                                           rows_to=rows_path(args, THEIRS, rnd, "trace"))
                finally:
                    served.close()
                for key, doc in theirs_doc["by_slo"].items():
                    doc.update(round=rnd, load="trace", slo=key)
                    runs[key][THEIRS].append(doc)
                    emit(doc, args.json)
            for ttft, itl in grid if args.servers != "theirs" else ():
                key = slo_key(ttft, itl)
                told = argparse.Namespace(**{**vars(args), "slo_ttft_ms": ttft * 1e3,
                                             "slo_itl_ms": itl * 1e3, "ttft_slo_s": ttft,
                                             "itl_slo_s": itl})
                print(f"# round {rnd}: {OURS}, trace, SLO {key} ms", file=sys.stderr,
                      flush=True)
                served = Served(ours_cmd(told), logs, OURS, args.start_timeout)
                try:
                    doc = run_trace(trace_args(told, served.url, OURS), grid=((ttft, itl),),
                                    rows_to=rows_path(args, OURS, rnd, f"trace {key}"))
                finally:
                    served.close()
                outputs = doc.pop("outputs")
                doc.pop("by_slo")
                doc.update(round=rnd, load="trace", slo=key)
                runs[key][OURS].append(doc)
                if theirs_doc is not None:
                    pairs = [(a, b) for a, b in zip(outputs, theirs_doc["outputs"])
                             if a is not None and b is not None]
                    bad = sum(a != b for a, b in pairs)
                    doc["outputs_compared"], doc["outputs_differing"] = len(pairs), bad
                    if bad:
                        failures.append(f"SLO {key}, round {rnd}: {bad} of {len(pairs)} "
                                        "outputs differ")
                emit(doc, args.json)
    rows = []
    for key, by_server in runs.items():
        row: dict[str, Any] = {"label": "medians", "load": "trace", "slo": key,
                               "rounds": args.rounds}
        for field, _, _ in OPEN:
            ours = median(by_server[OURS], field) if by_server[OURS] else None
            mine = median(by_server[THEIRS], field) if by_server[THEIRS] else None
            row[field] = {OURS: ours, THEIRS: mine,
                          "ratio": ours / mine if ours is not None and mine else None}
        rows.append(row)
        emit(row, args.json)
    show(grid_markdown(rows), args.markdown)
    if failures:
        print("# greedy outputs differ: " + "; ".join(failures), file=sys.stderr)
        return 1
    return 0


def show(table: str, path: Optional[str]) -> None:
    """Print the table of medians, and write it to `path` (--markdown) when given."""
    print(table)
    if path:
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(table)


def grid_markdown(rows: list[dict[str, Any]]) -> str:
    """One line per SLO: within the SLO (ours, theirs), goodput and its ratio, the misses by
    reason, the largest gap."""
    def fmt(x: Optional[float], spec: str = ".3g") -> str:
        return "-" if x is None else format(x, spec)

    lines = markdown_table(
        ["SLO (TTFT / gap ms)", "within: ours %", "theirs %", "goodput ours / theirs req/s",
         "ratio", "ours missed: TTFT / gaps / both / unserved", "max gap s: ours / theirs"],
        "lrrrrrr",
        ([r["slo"], fmt(r["slo_attainment_pct"][OURS], ".1f"),
          fmt(r["slo_attainment_pct"][THEIRS], ".1f"),
          f"{fmt(r['goodput_rps'][OURS])} / {fmt(r['goodput_rps'][THEIRS])}",
          fmt(r["goodput_rps"]["ratio"], ".2f"),
          " / ".join(fmt(r[f"slo_missed_{w}"][OURS], "g")
                     for w in ("ttft", "gaps", "both", "unserved")),
          f"{fmt(r['itl_max_s'][OURS])} / {fmt(r['itl_max_s'][THEIRS])}"] for r in rows))
    return f"\nSLO grid (medians of {rows[0]['rounds'] if rows else 0} rounds)\n\n" + \
        "\n".join(lines) + "\n"


def loads(args: argparse.Namespace) -> list[str]:
    closed = [] if args.only_trace else [f"closed c={c}" for c in args.concurrency]
    return closed + (["trace"] if args.trace else [])


def measure(args: argparse.Namespace, cmd: list[str], label: str, load: str,
            logs: str, rnd: int = 1) -> dict[str, Any]:
    served = Served(cmd, logs, label, args.start_timeout)
    try:
        if load == "trace":
            result = run_trace(trace_args(args, served.url, label), args.also_ttft_slo_s,
                               rows_to=rows_path(args, label, rnd, load))
        else:
            c = int(load.split("=")[1])
            result = asyncio.run(run_load(closed_args(args, served.url, label, c)))
    finally:
        served.close()
    result["load"] = load
    return result


def check_equal(load: str, rnd: int, results: dict[str, dict[str, Any]]) -> Optional[str]:
    """None when both servers generated the same text for every request, else what differs."""
    a, b = results[OURS].get("outputs"), results[THEIRS].get("outputs")
    if a is None or b is None:
        return None
    bad = [i for i, (x, y) in enumerate(zip(a, b)) if x is None or y is None or x != y]
    if len(a) != len(b) or bad:
        return (f"{load}, round {rnd}: outputs differ for {len(bad)} of {len(a)} requests "
                f"(first: {bad[:5]})")
    return None


def summarize(args: argparse.Namespace,
              runs: dict[str, dict[str, list[dict[str, Any]]]]) -> list[dict[str, Any]]:
    rows = []
    for load, by_server in runs.items():
        fields = OPEN if load == "trace" else CLOSED
        row: dict[str, Any] = {"label": "medians", "load": load,
                               "rounds": min(len(v) for v in by_server.values())}
        for key, _, _ in fields:
            ours = median(by_server[OURS], key) if OURS in by_server else None
            theirs = median(by_server[THEIRS], key) if THEIRS in by_server else None
            row[key] = {OURS: ours, THEIRS: theirs,
                        "ratio": ours / theirs if ours is not None and theirs else None}
        rows.append(row)
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    def fmt(x: Optional[float]) -> str:
        return "-" if x is None else f"{x:.3g}"

    out = []
    for row in rows:
        fields = OPEN if row["load"] == "trace" else CLOSED
        out.append(f"\n{row['load']} (medians of {row['rounds']} rounds)\n")
        out += markdown_table(
            ["measure", OURS, THEIRS, "ours / theirs"], "lrrr",
            ([name, fmt(row[key][OURS]), fmt(row[key][THEIRS]), fmt(row[key]["ratio"])]
             for key, name, _ in fields))
    return "\n".join(out) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--model", required=True, help="GGUF both servers load")
    ap.add_argument("--llama-server", default=None, metavar="PATH",
                    help="llama-server binary (default: $LLAMA_SERVER, else llama-server on "
                         "PATH; without one, only this server runs)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")],
                    default=[1, 4, 16], metavar="C,...")
    ap.add_argument("--requests", type=int, default=64, help="per closed-loop run")
    ap.add_argument("--prompt-tokens", type=int, default=512, help="closed loop: per prompt")
    ap.add_argument("--shared-prefix", type=int, default=384,
                    help="closed loop: tokens half the prompts share")
    ap.add_argument("--max-tokens", type=int, default=64, help="closed loop: per request")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lanes", type=int, default=16)
    ap.add_argument("--ctx-size", type=int, default=16384)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--flash-attn", choices=("off", "on"), default="off",
                    help="both servers' attention kernel (this server's --flash-attn, "
                         "llama-server's -fa; default: off)")
    ap.add_argument("--kv-type", choices=("f32", "f16"), default="f32",
                    help="both servers' KV cache type (this server's --kv-type, llama-server's "
                         "-ctk and -ctv; default: f32)")
    ap.add_argument("--timeout", type=float, default=600, help="per request, seconds")
    ap.add_argument("--start-timeout", type=float, default=120)
    t = ap.add_argument_group("trace replay (with --trace)")
    t.add_argument("--trace", default=None, help="Mooncake conversation trace (JSONL)")
    t.add_argument("--start-s", type=float, default=0,
                   help="the slice's start in the trace (default: 0, where bursts reach 16)")
    t.add_argument("--max-requests", type=int, default=200)
    t.add_argument("--time-scale", type=float, default=1.0,
                   help="arrival gaps x this (default: 1: the 200 rows from 0 s span 72 s and "
                        "offer about 920 prompt tokens/s)")
    t.add_argument("--ttft-slo-s", type=float, default=2.0,
                   help="the SLO's first-token bound, measured only (default: 2)")
    t.add_argument("--itl-slo-s", type=float, default=0.2,
                   help="the SLO's bound on every gap, measured only (default: 0.2)")
    t.add_argument("--slo-ttft-ms", type=positive_ms, default=None, metavar="MS",
                   help="the SLO's first-token bound, measured and told to this server "
                        "(`serve --slo-ttft-ms`); llama-server runs as it is; replaces "
                        "--ttft-slo-s (default: not told)")
    t.add_argument("--slo-itl-ms", type=positive_ms, default=None, metavar="MS",
                   help="the SLO's bound on every gap, measured and told to this server "
                        "(`serve --slo-itl-ms`); replaces --itl-slo-s (default: not told)")
    t.add_argument("--slo-grid", type=_grid, default=None, metavar="TTFTxGAP,...",
                   help="SLOs in ms (e.g. 2000x200,3000x500): per round llama-server replays "
                        "the trace once, scored under each, and this server once per SLO, told "
                        "it; the closed loop is skipped")
    t.add_argument("--no-byte-tokens", action="store_true",
                   help="the replay's requests carry a logit bias of -100 on the model's byte "
                        "tokens, for both servers (BENCHMARKS.md: a byte that starts a UTF-8 "
                        "character streams no text until the next token)")
    t.add_argument("--also-ttft-slo-s", type=float, default=None, metavar="S",
                   help="also report the share within the SLO with this TTFT bound instead "
                        "(the same replay)")
    ap.add_argument("--servers", choices=("both", "ours", "theirs"), default="both",
                    help="theirs: only llama-server, to find a trace load where it meets the SLO "
                         "for under a third of the requests before the comparison")
    ap.add_argument("--only-trace", action="store_true",
                    help="skip the closed loop (with --servers theirs: finding the trace load)")
    ap.add_argument("--ours-args", default="", metavar="FLAGS",
                    help="extra flags for this server (one string, shell-quoted; give it as "
                         "--ours-args='--flag V'), to measure a setting; the comparison with "
                         "llama-server runs without")
    ap.add_argument("--json", help="append every result and the medians as JSON lines here")
    ap.add_argument("--requests-out", metavar="DIR",
                    help="keep every trace replay's requests here, one JSON line each (times, "
                         "tokens, the SLO's verdict: trace_load.py's --requests-out), a file per "
                         "server, round and SLO")
    ap.add_argument("--markdown", help="write the table of medians here")
    args = ap.parse_args(argv)
    if args.slo_ttft_ms is not None:
        args.ttft_slo_s = args.slo_ttft_ms / 1e3
    if args.slo_itl_ms is not None:
        args.itl_slo_s = args.slo_itl_ms / 1e3
    if (args.slo_ttft_ms is not None or args.slo_itl_ms is not None) and not args.trace:
        ap.error("--slo-ttft-ms and --slo-itl-ms need --trace")
    if args.rounds < 1 or args.requests < 1 or min(args.concurrency) < 1:
        ap.error("--rounds, --requests and every --concurrency must be >= 1")
    theirs = find_llama_server(args.llama_server)
    if args.servers == "theirs" and not theirs:
        ap.error("--servers theirs needs llama-server: --llama-server PATH, $LLAMA_SERVER or "
                 "llama-server on PATH")
    if args.also_ttft_slo_s is not None and not (math.isfinite(args.also_ttft_slo_s)
                                                 and args.also_ttft_slo_s > 0):
        ap.error(f"--also-ttft-slo-s must be a finite number > 0, got {args.also_ttft_slo_s}")
    args.byte_bias = None
    if args.no_byte_tokens:
        if not args.trace:
            ap.error("--no-byte-tokens needs --trace")
        args.byte_bias = {str(t): -100 for t in byte_token_ids(args.model)}
    if args.only_trace and not args.trace:
        ap.error("--only-trace needs --trace")
    if args.slo_grid is not None:
        if not args.trace:
            ap.error("--slo-grid needs --trace")
        if args.slo_ttft_ms is not None or args.slo_itl_ms is not None:
            ap.error("--slo-grid gives the SLOs: not with --slo-ttft-ms / --slo-itl-ms")
        return run_grid(args, theirs if args.servers != "ours" else None)
    servers = ([(OURS, ours_cmd(args))] if args.servers != "theirs" else []) + (
        [(THEIRS, theirs_cmd(args, theirs))] if theirs and args.servers != "ours" else [])
    for label, cmd in servers:
        print(f"# {label}: {' '.join(cmd)}", file=sys.stderr, flush=True)
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {
        load: {label: [] for label, _ in servers} for load in loads(args)}
    failures = []
    with tempfile.TemporaryDirectory(prefix="serve-rounds-") as logs:
        for rnd in range(1, args.rounds + 1):
            for load in loads(args):
                this: dict[str, dict[str, Any]] = {}
                for label, cmd in servers:
                    print(f"# round {rnd}: {label}, {load}", file=sys.stderr, flush=True)
                    result = measure(args, cmd, label, load, logs, rnd)
                    result["round"] = rnd
                    this[label] = result
                    runs[load][label].append(result)
                    emit({k: v for k, v in result.items() if k != "outputs"}, args.json)
                if len(this) == 2 and (why := check_equal(load, rnd, this)):
                    failures.append(why)
                    print(f"# {why}", file=sys.stderr, flush=True)
    rows = summarize(args, runs)
    for row in rows:
        emit(row, args.json)
    show(markdown(rows), args.markdown)
    trace = next((r for r in rows if r["load"] == "trace"), None)
    if trace and (met := trace["slo_attainment_pct"][THEIRS]) is not None and met >= 100 / 3:
        print(f"# warning: llama-server met the SLO for {met:.1f} % of the trace's requests "
              "(the comparison asks for a load where it meets it for under a third)",
              file=sys.stderr)
    if failures:
        print("# greedy outputs differ: " + "; ".join(failures), file=sys.stderr)
        return 1
    if len(servers) == 2:
        print("# greedy outputs identical request for request in every closed-loop run",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
