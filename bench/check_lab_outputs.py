"""Regenerate the lab's reference outputs and compare them with a saved baseline, byte for byte
except the wall-time fields.

    python bench/check_lab_outputs.py --write BASELINE_DIR   # make a baseline (old package)
    python bench/check_lab_outputs.py BASELINE_DIR           # compare the installed package
    python bench/check_lab_outputs.py BASELINE_DIR --only ref --only suite

The outputs are those of `skippy-scheduler lab` (run from this Python's environment): the
reference table (with and without the fixture replay), the per-iteration trace and lab JSON,
the workload suite's table and JSON, and the Mooncake and Azure trace replays (only when the
trace files are found under `--traces`). Wall-time fields (`wall_s`, `bench_us_per_run`, the
`wall s` column of a replay table) are masked before comparing; everything else must match
exactly. Exit status 1 when any output differs, with the first differing line of each.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from typing import Callable, Optional

MOONCAKE = "mooncake-fast25-conversation_trace.jsonl"
AZURE = "AzureLLMInferenceTrace_conv.csv"
# Where the tests look for the public traces (tests/support/lab_support.py).
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_TRACES = (os.environ.get("SKIPPY_TRACES_DIR")
                  or os.path.join(os.path.dirname(REPO), "shared", "traces"))

# name -> (lab arguments, {output file: stdout or a file the command writes})
# "{trace}" is replaced with the traces folder.
RUNS: dict[str, tuple[list[str], list[str]]] = {
    "ref": (["--bench-reps", "0"], ["ref_table.tsv"]),
    "ref-replay": (["--bench-reps", "0", "--replay"], ["ref_table_replay.tsv"]),
    "trace": (["--bench-reps", "0", "--iteration-trace", "iteration_trace.txt", "--json",
               "lab.json"], ["", "iteration_trace.txt", "lab.json"]),
    "suite": (["--suite", "--requests", "2000", "--seed", "7", "--json", "suite.json"],
              ["suite.txt", "suite.json"]),
    "mooncake": (["--trace", "{trace}/" + MOONCAKE, "--policy", "fcfs", "--policy",
                  "cache-aware-noaging", "--policy", "cache-aware-aging", "--policy",
                  "fair-share", "--tenants", "4", "--time-scale", "0.1", "--json",
                  "mooncake.json"], ["mooncake.txt", "mooncake.json"]),
    "azure": (["--trace", "{trace}/" + AZURE, "--time-scale", "0.05", "--json", "azure.json"],
              ["azure.txt", "azure.json"]),
}
TRACE_FILES = {"mooncake": MOONCAKE, "azure": AZURE}

_JSON_WALL = re.compile(r'("(?:wall_s|bench_us_per_run)": )[^,}\n]+')


def _mask_tsv(text: str) -> str:
    """Tab-separated tables: the wall-time columns, by header name."""
    out = []
    wall: set[int] = set()
    for line in text.splitlines():
        cells = line.split("\t")
        if "wall_s" in cells or "bench_us_per_run" in cells:
            wall = {i for i, c in enumerate(cells) if c in ("wall_s", "bench_us_per_run")}
        elif wall and len(cells) > max(wall):
            cells = ["*" if i in wall else c for i, c in enumerate(cells)]
        out.append("\t".join(cells))
    return "\n".join(out)


def _mask_replay(text: str) -> str:
    """A replay's fixed-width table: its last column (`wall s`), from the header to a blank
    line."""
    out = []
    in_table = False
    for line in text.splitlines():
        if line.startswith("policy ") and line.rstrip().endswith("wall s"):
            in_table = True
        elif not line.strip():
            in_table = False
        elif in_table:
            line = re.sub(r"\s+\S+\s*$", " *", line)  # the column's width varies too
        out.append(line)
    return "\n".join(out)


def mask(name: str, text: str) -> str:
    if name.endswith(".json"):
        return _JSON_WALL.sub(r"\1*", text)
    if name in ("mooncake.txt", "azure.txt"):
        return _mask_replay(text)
    return _mask_tsv(text)


def run(name: str, workdir: str, traces: str) -> dict[str, str]:
    """Run one lab command in `workdir`; its outputs by file name ("" = discarded stdout)."""
    args, outputs = RUNS[name]
    argv = [sys.executable, "-m", "skippy_scheduler.cli", "lab",
            *[a.replace("{trace}", traces) for a in args]]
    done = subprocess.run(argv, cwd=workdir, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{name}: exit {done.returncode}: {done.stderr.strip()[-500:]}")
    texts: dict[str, str] = {}
    for i, out in enumerate(outputs):
        if i == 0:
            texts[out] = done.stdout
        else:
            with open(os.path.join(workdir, out), encoding="utf-8") as fh:
                texts[out] = fh.read()
    texts.pop("", None)
    return texts


def first_difference(a: str, b: str) -> Optional[str]:
    la, lb = a.splitlines(), b.splitlines()
    for i, (x, y) in enumerate(zip(la, lb)):
        if x != y:
            return f"line {i + 1}:\n  baseline: {x[:200]}\n  now:      {y[:200]}"
    if len(la) != len(lb):
        return f"{len(la)} lines in the baseline, {len(lb)} now"
    return None if a == b else "trailing newline differs"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("baseline", help="folder of baseline outputs")
    parser.add_argument("--write", action="store_true", help="write the baseline instead")
    parser.add_argument("--traces", default=DEFAULT_TRACES,
                        help="folder holding the Mooncake and Azure trace files (default: "
                             "$SKIPPY_TRACES_DIR, else shared/traces beside the repository, "
                             "as the tests look them up)")
    parser.add_argument("--only", action="append", choices=sorted(RUNS),
                        help="run only these outputs (repeatable)")
    args = parser.parse_args(argv)
    names = args.only or list(RUNS)
    log: Callable[[str], None] = lambda msg: print(msg, flush=True)  # noqa: E731
    failed = 0
    for name in names:
        trace = TRACE_FILES.get(name)
        if trace is not None and not os.path.exists(os.path.join(args.traces, trace)):
            log(f"{name}: skipped ({trace} not under {args.traces})")
            continue
        with tempfile.TemporaryDirectory() as workdir:
            texts = run(name, workdir, os.path.abspath(args.traces))
        for out, text in texts.items():
            path = os.path.join(args.baseline, out)
            if args.write:
                os.makedirs(args.baseline, exist_ok=True)
                with open(path, "w", encoding="utf-8") as fh:
                    fh.write(text)
                log(f"{out}: written")
                continue
            if not os.path.exists(path):
                log(f"{out}: no baseline (skipped)")
                continue
            with open(path, encoding="utf-8") as fh:
                base = fh.read()
            diff = first_difference(mask(out, base), mask(out, text))
            if diff is None:
                log(f"{out}: identical")
            else:
                failed += 1
                log(f"{out}: DIFFERS at {diff}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
