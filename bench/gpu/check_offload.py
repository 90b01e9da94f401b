"""The GPU checks of the offload work, on a machine with a GPU build of llama.cpp:

    python3 bench/gpu/check_offload.py --model bench-0.85b-f16.gguf --json offload-check.json

1. `skippy-scheduler serve -m MODEL` with no offload flag: the startup line must say every
   layer is on a GPU ("N/N layers on ..."), and the openai client must get a chat answer;
2. the same server with the exact settings (`--kv-type f32 -fa off`): `--prompts` greedy
   completions run alone, one after another, then all at once; the tokens of each are compared
   (llama.cpp's kernels may not be batch-invariant on a GPU: the count of equal requests is
   reported, and `--require-equal` makes a difference fail the run);
3. with the same exact settings, the GPU path (`--inflight 2 -bs on`: two plans in flight,
   sampling on the device, and by default on a GPU each plan staged while the one before
   runs) against one plan at a time sampled on the host (`--inflight 1 -bs off`), the
   `--prompts` requests all at once on each: the tokens compared request for request
   (`--require-equal` fails the run on a difference here too), and the plans the GPU path
   staged ahead counted (`skippy:plans_staged_ahead`).

Exit status 0 when check 1 passed (and checks 2 and 3 with --require-equal); the JSON has the
startup lines, the answers and the comparison, and is written again after every check, so a
run cut short keeps what the checks before found. A check that fails (a server that does not
start, a request that errs) is recorded with its error and the end of the server's log, and
the next check runs. Each server runs in its own process, its output in `--logs` (default: a
temporary folder), is ready once `/health` answers, and is stopped after its check; every
wait is bounded (`--timeout`).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import itertools
import json
import os
import re
import shlex
import shutil
import signal
import sys
import tempfile
import urllib.request
from typing import Any, Callable, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/
from skippy_bench.servers import Served, log_tail  # noqa: E402

_names = itertools.count(1)
_last_log: list[str] = []  # the log of the server started last
_server_args: list[str] = []  # --server-args: given to every server


class CheckFailed(RuntimeError):
    """A check's server did not start; the message says why."""


class Server:
    """`skippy-scheduler serve` in a subprocess, its output in `logs`/serve-N.log, ready once
    `/health` answers; `banner` is its startup line."""

    def __init__(self, model: str, extra: list[str], timeout_s: float, logs: str) -> None:
        cmd = [sys.executable, "-m", "skippy_scheduler.cli", "serve", "-m",
               os.path.abspath(model), "--host", "127.0.0.1", "--served-model-name", "bench",
               "--log-level", "warning", *_server_args, *extra]
        self.cmd = cmd
        self.log = os.path.join(logs, f"serve-{next(_names)}")
        _last_log[:] = [self.log + ".log"]
        try:
            self.served = Served(cmd, logs, os.path.basename(self.log), timeout_s,
                                 stop_timeout_s=10)
        except RuntimeError as exc:
            raise CheckFailed(f"the server did not start ({exc}): {' '.join(cmd)}") from None
        self.url = self.served.url + "/v1"
        with open(self.log + ".log", encoding="utf-8", errors="replace") as fh:
            self.banner = next((ln.strip() for ln in fh
                                if ln.startswith("skippy-scheduler serve:")), "")

    def staged_ahead(self) -> Optional[int]:
        """The plans it staged while the one before ran (`/metrics`; None unreadable)."""
        try:
            with urllib.request.urlopen(self.served.url + "/metrics", timeout=10) as r:
                text = r.read().decode("utf-8", "replace")
        except (OSError, ValueError):
            return None
        m = re.search(r"^skippy:plans_staged_ahead_total (\S+)$", text, re.M)
        return int(float(m.group(1))) if m else None

    def stop(self) -> None:
        self.served.close()


def _client(url: str, timeout_s: float) -> Any:
    from openai import OpenAI

    return OpenAI(base_url=url, api_key="none", timeout=timeout_s, max_retries=0)


def _tokens(client: Any, prompt: str, max_tokens: int) -> list[int]:
    r = client.completions.create(model="bench", prompt=prompt, max_tokens=max_tokens,
                                  temperature=0, extra_body={"ignore_eos": True,
                                                             "return_token_ids": True})
    choice = r.choices[0]
    ids = getattr(choice, "token_ids", None) or (choice.model_extra or {}).get("token_ids")
    return list(ids) if ids else [ord(c) for c in choice.text]


def check_offload(args: argparse.Namespace) -> dict[str, Any]:
    srv = Server(args.model, [], args.timeout, args.logs)
    try:
        m = re.search(r"(\d+)/(\d+) layers on ([^,)]+)", srv.banner)
        all_on_gpu = bool(m and m.group(1) == m.group(2))
        chat = _client(srv.url, args.timeout).chat.completions.create(
            model="bench", max_tokens=16, temperature=0,
            messages=[{"role": "user", "content": "Hello"}])
        answered = chat.choices[0].finish_reason in ("stop", "length")
    finally:
        srv.stop()
    return {"command": srv.cmd, "startup_line": srv.banner, "all_layers_on_gpu": all_on_gpu,
            "chat_answered": answered}


def _prompts(args: argparse.Namespace) -> list[str]:
    return [" ".join(f"w{i}x{k}" for k in range(args.prompt_words))
            for i in range(args.prompts)]


def _exact(args: argparse.Namespace, *extra: str) -> Server:
    """A server with the exact settings (f32 KV, flash attention off), a lane per prompt of
    512 tokens (a model trained on a short context would give its lanes less by default)."""
    return Server(args.model, ["--kv-type", "f32", "-fa", "off", "-np", str(args.prompts),
                               "-c", str(512 * args.prompts), *extra], args.timeout, args.logs)


def _all_at_once(client: Any, args: argparse.Namespace) -> list[list[int]]:
    """The greedy tokens of the check prompts, all sent at once."""
    with concurrent.futures.ThreadPoolExecutor(args.prompts) as pool:
        return list(pool.map(lambda p: _tokens(client, p, args.max_tokens), _prompts(args)))


def check_batch_invariance(args: argparse.Namespace) -> dict[str, Any]:
    srv = _exact(args)
    try:
        client = _client(srv.url, args.timeout)
        alone = [_tokens(client, p, args.max_tokens) for p in _prompts(args)]
        batched = _all_at_once(client, args)
    finally:
        srv.stop()
    equal = sum(a == b for a, b in zip(alone, batched))
    return {"command": srv.cmd, "startup_line": srv.banner, "requests": len(alone),
            "equal": equal}


def _batched(args: argparse.Namespace, *extra: str
             ) -> tuple[Server, list[list[int]], Optional[int]]:
    """The tokens of `_all_at_once` on a server of its own, `_exact` with `extra`, and the
    plans it staged ahead."""
    srv = _exact(args, *extra)
    try:
        got = _all_at_once(_client(srv.url, args.timeout), args)
        return srv, got, srv.staged_ahead()
    finally:
        srv.stop()


def check_in_flight(args: argparse.Namespace) -> dict[str, Any]:
    """The GPU path (two plans in flight, sampling on the device) against one plan at a time
    with the host's sampling, the same requests at once: the tokens request for request."""
    fast, got, staged = _batched(args, "--inflight", "2", "-bs", "on")
    plain, want, _ = _batched(args, "--inflight", "1", "-bs", "off")
    return {"commands": [fast.cmd, plain.cmd], "startup_lines": [fast.banner, plain.banner],
            "device_sampling": "sampling on the device" in fast.banner,
            "staged_ahead": staged,
            "requests": len(got), "equal": sum(a == b for a, b in zip(got, want))}


CHECKS: tuple[tuple[str, Callable[[argparse.Namespace], dict[str, Any]]], ...] = (
    ("offload", check_offload), ("batch_invariance", check_batch_invariance),
    ("in_flight", check_in_flight))


def run_checks(args: argparse.Namespace) -> dict[str, Any]:
    """Every check in turn, the JSON (`--json`) written after each; a check that fails is
    recorded as {"error": ...} and the next one runs. SIGINT stops them: what was found stays."""
    out: dict[str, Any] = {}

    def write() -> None:
        if args.json:
            with open(args.json, "w", encoding="utf-8") as fh:
                json.dump(out, fh, indent=2)

    try:
        for name, check in CHECKS:
            try:
                out[name] = check(args)
            except Exception as exc:  # a failed check is a finding, not the end of the run
                tail = log_tail(_last_log[0], 2000) if _last_log else ""
                out[name] = {"error": f"{type(exc).__name__}: {exc}"
                             + (f"; the end of the last server's log: {tail}" if tail else "")}
            write()
    except KeyboardInterrupt:
        out["interrupted"] = True
        write()
    return out


def main(argv: Optional[list[str]] = None) -> int:
    # Stopped by SIGINT (also where the process started with it ignored: a command run without
    # job control) or SIGTERM (`timeout`'s own): keep what was found.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--model", required=True, help="GGUF model file")
    ap.add_argument("--prompts", type=int, default=8, help="requests compared (default: 8)")
    ap.add_argument("--prompt-words", type=int, default=48, help="words per prompt (default: 48)")
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens per request (default: 32)")
    ap.add_argument("--timeout", type=float, default=300.0,
                    help="seconds any start or request may take (default: 300)")
    ap.add_argument("--require-equal", action="store_true",
                    help="fail unless alone and batched greedy tokens are equal, and the "
                    "GPU path's equal one plan at a time sampled on the host")
    ap.add_argument("--json", metavar="FILE", help="write the results here")
    ap.add_argument("--logs", metavar="DIR", help="keep the servers' output here (default: a "
                    "temporary folder, removed at the end)")
    ap.add_argument("--server-args", default="", metavar="FLAGS",
                    help="more flags for every server, e.g. '--rpc 127.0.0.1:50052' (a "
                         "llama.cpp RPC server as the device, docs/gpu.md)")
    args = ap.parse_args(argv)
    _server_args[:] = shlex.split(args.server_args)
    if not os.path.isfile(args.model):
        ap.error(f"--model: no such file: {args.model}")
    keep = args.logs is not None
    args.logs = os.path.abspath(args.logs) if keep else tempfile.mkdtemp(prefix="check-offload-")
    os.makedirs(args.logs, exist_ok=True)
    try:
        out = run_checks(args)
    finally:
        if not keep:
            shutil.rmtree(args.logs, ignore_errors=True)
    print(json.dumps(out, indent=2))
    ok = bool(out.get("offload", {}).get("all_layers_on_gpu")
              and out.get("offload", {}).get("chat_answered"))
    if args.require_equal:
        for k in ("batch_invariance", "in_flight"):
            got = out.get(k, {})
            ok = ok and got.get("requests") is not None and got.get("equal") == got["requests"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
