"""A device that is not the host's: a llama.cpp RPC server on this machine's CPU, which llama.cpp
treats as a GPU (`--rpc`). Layers, KV cache, holders and backend sampling placed there take the
paths they take on a GPU (device buffers, tokens read back from the device, two plans in
flight), computed by the same CPU kernels, so the tokens must equal a CPU server's.

These need llama-cpp-python built with `CMAKE_ARGS="-DGGML_RPC=on"` (.ci/run builds it so, and
sets SKIPPY_REQUIRE_RPC=1 to make a build without it a failure rather than a skip)."""
from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("llama_cpp")
pytest.importorskip("fastapi")
pytest.importorskip("openai")

from serve_support import Spawned, free_port, metrics, start_rpc_server  # noqa: E402

from skippy_scheduler.hosts.llama.backend import backends  # noqa: E402

CWD = os.path.dirname(sys.executable)  # outside the checkout (see test_offload_flags.py)
HAS_RPC = any(name == "RPC" for name, _ in backends())
if not HAS_RPC and os.environ.get("SKIPPY_REQUIRE_RPC") != "1":
    pytest.skip("llama-cpp-python built without -DGGML_RPC=on", allow_module_level=True)

EXACT = ["--kv-type", "f32", "-fa", "off", "-np", "6"]
PROMPTS = [" ".join(f"w{i}x{k}" for k in range(24)) for i in range(6)]


@pytest.fixture(scope="module")
def rpc_endpoint(tmp_path_factory):
    """An RPC server on loopback, lending this machine's CPU; stopped after the module."""
    assert HAS_RPC, "this llama.cpp has no RPC backend (build it with -DGGML_RPC=on)"
    proc, endpoint = start_rpc_server(tmp_path_factory.mktemp("rpc") / "rpc.log")
    try:
        yield endpoint
    finally:
        proc.terminate()
        proc.wait(10)


def _tokens(url: str, prompt: str, max_tokens: int = 24, **sampling) -> list[int]:
    from openai import OpenAI

    with OpenAI(base_url=url + "/v1", api_key="none", timeout=60, max_retries=0) as client:
        r = client.completions.create(model="tiny-random-llama", prompt=prompt,
                                      max_tokens=max_tokens,
                                      temperature=sampling.pop("temperature", 0),
                                      extra_body={"ignore_eos": True, "return_token_ids": True,
                                                  **sampling})
    return list(r.choices[0].model_extra["token_ids"])


def _at_once(url: str, **sampling) -> list[list[int]]:
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(lambda p: _tokens(url, p, **sampling), PROMPTS))


def test_list_devices_shows_the_rpc_server_as_a_gpu(rpc_endpoint):
    proc = subprocess.run([sys.executable, "-m", "skippy_scheduler.cli", "serve", "--rpc",
                           rpc_endpoint, "--list-devices"], capture_output=True, text=True,
                          timeout=60, cwd=CWD)
    assert proc.returncode == 0, proc.stderr
    assert any(line.startswith(f"  RPC0: {rpc_endpoint} (gpu, ") and "GiB free of" in line
               for line in proc.stdout.splitlines()), proc.stdout


def test_layers_kv_and_sampling_on_the_device_give_the_cpus_tokens(tmp_path, rpc_endpoint):
    (tmp_path / "dev").mkdir()
    (tmp_path / "cpu").mkdir()
    # Sampling on the device asked for (on an RPC server's device `auto` leaves it to the host).
    dev = Spawned(tmp_path / "dev", "--rpc", rpc_endpoint, *EXACT, "-bs", "on")
    try:
        banner = dev.log().splitlines()[0]
        # Every layer there, and the KV (lanes and holders); sampling on the device and (the
        # device's default, not in the line) two plans in flight.
        assert "(3/3 layers on RPC0, KV " in banner and " on RPC0, 6 lanes" in banner, banner
        assert "sampling on the device" in banner, banner
        got = _at_once(dev.url)
        alone = [_tokens(dev.url, PROMPTS[0], temperature=0.9, seed=7)]
        seeded = _at_once(dev.url, temperature=0.9, seed=7)
        m = metrics(dev.url)
        assert m['skippy:device_memory_bytes{device="RPC0",kind="kv"}'] > 0
        assert m['skippy:device_memory_bytes{device="RPC0",kind="weights"}'] > 0
        assert m["skippy:gpu_layers"] == 3
        assert m["skippy:plans_staged_ahead_total"] > 0  # the device's default
        # The requests' first plans start sequences: staged when they run, and counted so.
        assert m['skippy:plans_not_staged_ahead_total{reason="new_rows"}'] > 0
    finally:
        assert dev.stop() == 0
    # A seeded request draws the same tokens alone and among others on the device.
    assert seeded[0] == alone[0]
    cpu = Spawned(tmp_path / "cpu", *EXACT)
    try:
        assert "0 layers on a GPU" in cpu.log().splitlines()[0]
        assert "sampling on the device" not in cpu.log().splitlines()[0]
        want = _at_once(cpu.url)
    finally:
        assert cpu.stop() == 0
    assert got == want


@pytest.mark.parametrize("ahead", [None, "off"])
def test_run_places_its_layers_on_the_device(tmp_path, rpc_endpoint, ahead):
    out = tmp_path / "run.json"
    flag = ["--stage-ahead", ahead] if ahead else []
    proc = subprocess.run([sys.executable, "-m", "skippy_scheduler.cli", "run", "--rpc",
                           rpc_endpoint, "-n", "4", "--json", str(out), *flag],
                          capture_output=True, text=True, timeout=120, cwd=CWD)
    assert proc.returncode == 0, proc.stderr
    assert "skippy-scheduler run: 3/3 layers on RPC0, KV " in proc.stderr
    # Beside a device the next plan is staged while one runs, unless turned off.
    assert json.loads(out.read_text())["settings"]["stage_ahead"] is (ahead is None)


@pytest.mark.parametrize("command", ["serve", "run", "calibrate", "stage"])
def test_nothing_listening_is_one_line_before_anything_loads(tmp_path, command):
    from skippy_scheduler.hosts.tiny_model import write_tiny_llama

    model = write_tiny_llama(str(tmp_path / "tiny.gguf"), seed=0)
    extra = {"serve": ["--port", str(free_port())],
             "stage": ["--listen", f"ipc://{tmp_path}/s0"]}.get(command, [])
    port = free_port()  # bound and released: nothing listens there
    proc = subprocess.run([sys.executable, "-m", "skippy_scheduler.cli", command, "-m", model,
                           "--rpc", f"127.0.0.1:{port}", *extra],
                          capture_output=True, text=True, timeout=60, cwd=CWD)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines()[-1].startswith(
        f"skippy-scheduler {command}: error: --rpc: no RPC server answers at "
        f"127.0.0.1:{port} ("), proc.stderr


def test_a_server_held_by_another_process_is_waited_for_within_a_limit(tmp_path, rpc_endpoint):
    # llama.cpp's handshake waits for a busy server without a limit; the wait is bounded and
    # said (the other process here: a server whose model lives on the RPC server).
    held = Spawned(tmp_path, "--rpc", rpc_endpoint)
    try:
        banner = held.log().splitlines()[0]
        # With no flag the host samples for an RPC server's device (docs/gpu.md).
        assert "layers on RPC0" in banner and "sampling on the device" not in banner, banner
        code = ("import sys\n"
                "from skippy_scheduler.hosts.llama.backend import add_rpc_servers\n"
                "from skippy_scheduler.hosts.offload import RpcError\n"
                "try:\n"
                f"    add_rpc_servers([{rpc_endpoint!r}], timeout=3)\n"
                "except RpcError as exc:\n"
                "    sys.exit(str(exc))\n")
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=60, cwd=CWD)
    finally:
        assert held.stop() == 0
    assert proc.returncode == 1, proc.stderr
    last = proc.stderr.splitlines()[-1]
    assert last.startswith(f"--rpc: the RPC server at {rpc_endpoint} did not ") and last.endswith(
        " within 3 s (it serves one process at a time: is another process using it?)"), last


# Run in a process of its own: an RPC server registered with llama.cpp stays a device of the
# process that registered it, and this module's server is stopped after it.
_STAGED_AHEAD = """
import json, sys
from skippy_scheduler import MemoryComponent, Scheduler, SchedulerConfig
from skippy_scheduler.cost_model import LAB_COST
from skippy_scheduler.engine import Engine, Request, VirtualClock
from skippy_scheduler.hosts.llama import LlamaHost
from skippy_scheduler.hosts.llama.fit import resolve
from skippy_scheduler.hosts.offload import OffloadSpec

model, endpoint = sys.argv[1:]
fit = resolve(model, OffloadSpec(rpc=(endpoint,)), n_ctx=6 * 256, lanes=6, share_ctx=False,
              kv_type="f32", flash_attn="off", n_batch=256)
assert fit.placement.on_gpu and fit.placement.over_rpc

def tokens(**placed):
    with LlamaHost(model, n_ctx=6 * 256, n_seq_max=6, n_batch=256, n_threads=1, kv_type="f32",
                   **placed) as host:
        # Whether each of the decoder's C calls said `launching` before it (every call says
        # it once, before or after): the signals counted at the call's start, less the calls
        # before it, are 1 when it did, 0 when it says it after.
        signals, calls = [0], []
        decoder = host._decoder
        signal = decoder.on_launch
        def launching():
            signals[0] += 1
            signal()
        decoder.on_launch = launching
        for batch in decoder._batches:
            def call(*args, _decode=batch.decode, **kw):
                kind = "wait" if kw.get("synchronize") else "queue"
                calls.append(f"{kind} {'after' if signals[0] == len(calls) else 'before'}")
                return _decode(*args, **kw)
            batch.decode = call
        scheduler = Scheduler(SchedulerConfig(
            max_active_sequences=6, max_tokens_per_iteration=256, prefill_chunk_tokens=16,
            max_inflight_plans=2, memory_components=[MemoryComponent("kv", 10**9, 0, 1, 0)]))
        engine = Engine(scheduler, host, clock=VirtualClock(LAB_COST), max_iterations=2000)
        for i in range(6):
            engine.submit(Request(f"r{i}", [1] + [3 + 7 * i + k for k in range(5 + 9 * i)],
                                  16, arrival_us=0.0))
        report = engine.run()
        assert signals[0] == len(calls)
        return ({r.id: r.tokens for r in report.records}, host.staged_ahead,
                host.settings["stage_ahead"], sorted(set(calls)))

print(json.dumps([tokens(placement=fit.placement, flash_attn=False),
                  tokens(placement=fit.placement, flash_attn=False, stage_ahead=False),
                  tokens()]))
"""


def test_on_a_device_each_plan_is_staged_while_the_one_before_decodes(tmp_path, rpc_endpoint):
    """Where llama_decode returns before the device is done (an RPC server's device, as a
    GPU's), the host stages the next plan in between by default; greedy tokens stay the
    CPU's at two plans in flight."""
    from skippy_scheduler.hosts.tiny_model import write_tiny_llama

    model = write_tiny_llama(str(tmp_path / "tiny.gguf"), seed=3)
    proc = subprocess.run([sys.executable, "-c", _STAGED_AHEAD, model, rpc_endpoint],
                          capture_output=True, text=True, timeout=120, cwd=CWD)
    assert proc.returncode == 0, proc.stderr
    (on_device, staged, ahead, device_order), (unstaged, _, _, unstaged_order), \
        (on_cpu, none, cpu_ahead, cpu_order) = json.loads(proc.stdout.splitlines()[-1])
    assert ahead is True and cpu_ahead is False  # the default: on beside a device only
    assert on_device == on_cpu == unstaged
    assert staged > 10 and none == 0
    # Beside the device, a decode that only queues its step says so (releasing the plan
    # before it to the engine) once the call has returned; one that waits for its outputs in
    # the call (not staging ahead) says so before it, as every decode on the CPU does, whose
    # call computes the step.
    assert device_order == ["queue after"]
    assert unstaged_order == ["wait before"]
    assert cpu_order == ["wait before"]
