"""bench/gpu/device_run.sh on the CPU (SETUP=0: the packages of this environment): the
offload checks run against the tiny model and their summary reaches progress.log; what comes
back is at most six files (for runners that bring back only a few), the rest packed; a budget too
short for a phase skips it and says so; a missing kit is named; the first round of the table
runs before the other phases and later rounds join its table; a preflight load that dies with a
SIGSEGV sends the rest to SKIPPY_LLAMA_LOG=raw, an abort does not. And check_offload.py alone:
a check that cannot start its server is recorded with the server's own complaint, and the
next check runs."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "bench", "gpu", "device_run.sh")
CHECKS = os.path.join(ROOT, "bench", "gpu", "check_offload.py")

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                                reason="needs bash and coreutils' timeout")


def run(tmp_path, cwd: str = ROOT, **env: str) -> tuple[subprocess.CompletedProcess, str]:
    out = tmp_path / "out"
    full = {**os.environ, "PYTHON": sys.executable, "GPU_WORK": str(tmp_path / "work"), **env}
    proc = subprocess.run(["bash", SCRIPT, str(out)], cwd=cwd, env=full, capture_output=True,
                          text=True, timeout=400)
    return proc, (out / "progress.log").read_text()


def test_the_checks_run_and_are_summarised(tmp_path, model_path):
    proc, progress = run(tmp_path, SETUP="0", MODEL=str(model_path), ROUNDS="0",
                         BUDGET_S="300")
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "out"
    assert "no GPU" in (out / "devices.txt").read_text()  # --list-devices answered
    check = json.loads((out / "offload-check.json").read_text())
    assert check["offload"]["chat_answered"] is True
    # The CPU build puts no layer on a GPU: check 1 fails, and the summary says why.
    assert check["offload"]["all_layers_on_gpu"] is False
    assert "offload checks ended (1): all layers on a GPU: False | chat answered: True" in progress
    assert "0 layers on a GPU" in progress
    # The GPU path's tokens against one plan at a time sampled on the host, all at once: on
    # llama.cpp's CPU backend they are equal.
    flight = check["in_flight"]
    assert flight["requests"] == 8 and flight["equal"] == 8
    assert ["--inflight", "2", "-bs", "on"] == flight["commands"][0][-4:]
    assert "depth 2 + device sampling = depth 1 + host: 8 of 8" in progress
    # -bs on samples with llama.cpp's samplers (on its CPU backend here): the line says so
    assert flight["device_sampling"] is True and "sampled on the device: True" in progress
    # Read from /metrics: none staged ahead on the CPU, where `auto` leaves it off.
    assert flight["staged_ahead"] == 0 and "plans staged ahead: 0" in progress
    assert "sampling on the device" in flight["startup_lines"][0]
    assert "sampling on the device" not in flight["startup_lines"][1]  # -bs off
    assert progress.rstrip().endswith("done")
    assert "gpu_rounds" not in progress  # ROUNDS=0
    came_back = sorted(os.listdir(out))
    assert came_back == ["details.tar.gz", "devices.txt", "offload-check.json", "progress.log"]
    with tarfile.open(out / "details.tar.gz") as tar:
        names = tar.getnames()
    assert "./offload-check.log" in names
    serve_logs = [n for n in names if n.startswith("./logs/checks/serve-")]
    assert len(serve_logs) == 4  # a server per check, two for the last


def test_host_cpu_times_the_host_with_each_sampling_before_the_rounds(tmp_path, model_path):
    proc, progress = run(tmp_path, SETUP="0", MODEL=str(model_path), CHECKS="0", ROUNDS="0",
                         HOST_CPU="1", THREADS="1", BUDGET_S="300")
    assert proc.returncode == 0, proc.stderr
    for bs, what in (("off", "off"), ("on", "on"), ("on", "on --stage-ahead off")):
        line = next(x for x in progress.splitlines() if f"host_cpu -bs {what} ended" in x)
        assert f"host_cpu -bs {what} ended (0): " in line
        result = json.loads(line.split(": ", 1)[1])
        assert result["label"] == "bs-" + what.replace(" --stage-ahead off", "-noahead")
        assert result["rows"] == 64
        assert (result["read_cpu_us"] > 0) == (bs == "on")  # the device's tokens read
        assert result["staged_ahead_share"] == 0  # on the CPU `auto` leaves it off
    assert sorted(os.listdir(tmp_path / "out")) == ["details.tar.gz", "devices.txt",
                                                    "progress.log"]
    with tarfile.open(tmp_path / "out" / "details.tar.gz") as tar:
        lines = tar.extractfile("./host-cpu.jsonl").read().decode().splitlines()
    assert [json.loads(x)["label"] for x in lines] == ["bs-off", "bs-on", "bs-on-noahead"]


def test_a_short_budget_skips_what_cannot_finish(tmp_path, model_path):
    proc, progress = run(tmp_path, SETUP="0", MODEL=str(model_path), BUDGET_S="100")
    assert proc.returncode == 0, proc.stderr
    assert "offload checks skipped" in progress and "gpu_rounds skipped" in progress
    assert not (tmp_path / "out" / "offload-check.json").exists()


def test_without_the_kit_it_says_what_to_run(tmp_path):
    proc, progress = run(tmp_path, cwd=str(tmp_path), MODEL=str(tmp_path / "m.gguf"))
    assert proc.returncode == 1
    assert "make_kit.sh" in progress and not (tmp_path / "m.gguf").exists()


def test_a_check_whose_server_does_not_start_is_recorded_and_the_next_runs(tmp_path):
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 40)  # a GGUF cut short
    out = tmp_path / "check.json"
    proc = subprocess.run([sys.executable, CHECKS, "--model", str(bad), "--timeout", "60",
                           "--json", str(out), "--logs", str(tmp_path / "logs")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    got = json.loads(out.read_text())
    assert set(got) == {"offload", "batch_invariance", "in_flight"}
    for name, found in got.items():
        assert "the server did not start" in found["error"], name
        assert "cut.gguf" in found["error"]  # the server's own line, from its log
    assert len(list((tmp_path / "logs").glob("serve-*.log"))) == 3


def test_a_check_whose_requests_fail_is_recorded_with_the_server_log(tmp_path, model_path):
    out = tmp_path / "check.json"
    proc = subprocess.run([sys.executable, CHECKS, "--model", str(model_path), "--timeout", "60",
                           "--prompts", "2", "--prompt-words", "3000", "--json", str(out),
                           "--logs", str(tmp_path / "logs")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    got = json.loads(out.read_text())
    assert got["offload"]["chat_answered"] is True  # its chat is short: it ran
    for name in ("batch_invariance", "in_flight"):  # prompts past a lane's context: refused
        assert got[name]["error"].startswith("BadRequestError"), got[name]
        assert "the end of the last server's log" in got[name]["error"]


def test_the_first_round_comes_first_and_later_rounds_join_its_table(tmp_path, model_path):
    # A python whose load with the package's log sink dies with a signal, as one GPU load did:
    # the preflight says so and the rest runs with SKIPPY_LLAMA_LOG=raw.
    wrapper = tmp_path / "python"
    wrapper.write_text("#!/bin/bash\nfor a in \"$@\"; do\n"
                       "  [[ $a == */preflight_load.py && ${SKIPPY_LLAMA_LOG:-} != raw ]] "
                       "&& kill -SEGV $$\ndone\n"
                       f"exec {sys.executable} \"$@\"\n")
    wrapper.chmod(0o755)
    proc, progress = run(tmp_path, SETUP="0", MODEL=str(model_path), PYTHON=str(wrapper),
                         CHECKS="0", ROUNDS="2", SERVERS="ours", CONCURRENCY="1",
                         DECODE_TOKENS="0", THREADS="1", BUDGET_S="300",
                         ROUNDS_ARGS="--prompt-tokens 24 --shared-prefix 16 --max-tokens 4 "
                                     "--lanes 2 --ctx-size 1024 --requests 3")
    assert proc.returncode == 0, proc.stderr
    lines = progress.splitlines()
    assert any("preflight load died with signal 11" in x and "SKIPPY_LLAMA_LOG=raw" in x
               for x in lines)
    assert any("with SKIPPY_LLAMA_LOG=raw ended (0): loaded on the CPU" in x for x in lines)
    first = next(i for i, x in enumerate(lines) if "gpu_rounds: round 1 of 2 (ours)" in x)
    assert "gpu_rounds round 1 ended (0)" in lines[first + 1]
    assert any("gpu_rounds: round 2 of 2 (ours)" in x for x in lines[first + 2:])
    assert "gpu-rounds.md: medians of 2 alternating rounds" in progress
    out = tmp_path / "out"
    assert sorted(os.listdir(out)) == ["details.tar.gz", "devices.txt", "gpu-rounds.jsonl",
                                       "gpu-rounds.md", "progress.log"]
    rows = [json.loads(x) for x in (out / "gpu-rounds.jsonl").read_text().splitlines()]
    assert [r["label"] for r in rows].count("run") == 2  # two runs, one file
    assert "medians of 2 alternating rounds" in (out / "gpu-rounds.md").read_text()
    with tarfile.open(out / "details.tar.gz") as tar:
        assert "./preflight.log" in tar.getnames()


def test_an_abort_in_the_preflight_keeps_the_log_sink(tmp_path, model_path):
    """Only SIGSEGV or SIGBUS (the crash the log sink was seen to cause) sends the rest to
    SKIPPY_LLAMA_LOG=raw; an abort (a GGML_ASSERT, a CUDA error) is reported as it is."""
    wrapper = tmp_path / "python"
    wrapper.write_text("#!/bin/bash\nfor a in \"$@\"; do\n"
                       "  [[ $a == */preflight_load.py ]] && kill -ABRT $$\ndone\n"
                       f"exec {sys.executable} \"$@\"\n")
    wrapper.chmod(0o755)
    proc, progress = run(tmp_path, SETUP="0", MODEL=str(model_path), PYTHON=str(wrapper),
                         CHECKS="0", ROUNDS="0", BUDGET_S="120")
    assert proc.returncode == 0, proc.stderr
    assert "preflight load died with signal 6" in progress
    assert "SKIPPY_LLAMA_LOG=raw" not in progress
