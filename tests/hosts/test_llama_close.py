"""`LlamaHost.close` from another thread while an engine runs plans on it: it waits for the
decode in progress before it frees llama.cpp's context (it used to free it under a running
`llama_decode`: the process died of a segmentation fault), the engine's next plan fails with
"the host is closed", and the closed host holds no lane. In a process of its own, as the old
behaviour killed it."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("llama_cpp")

SCRIPT = textwrap.dedent("""
    import random, sys, threading, time
    from skippy_scheduler import Scheduler, SchedulerConfig
    from skippy_scheduler.engine import Engine, Request
    from skippy_scheduler.hosts.llama import LlamaHost
    from skippy_scheduler.hosts.tiny_model import write_tiny_llama

    depth, folder = int(sys.argv[1]), sys.argv[2]
    path = write_tiny_llama(folder + "/tiny.gguf", seed=7)
    host = LlamaHost(path, n_ctx=4 * 512, n_seq_max=4, n_threads=1)
    engine = Engine(Scheduler(SchedulerConfig(
        max_active_sequences=4, max_tokens_per_iteration=512, prefill_chunk_tokens=64,
        max_inflight_plans=depth)), host, max_iterations=100000)
    rng = random.Random(0)
    for i in range(40):
        engine.submit(Request(f"r{i}", [1] + [rng.randrange(3, 384) for _ in range(300)], 100))
    ended = []
    def run():
        try:
            engine.run()
            ended.append("finished")
        except BaseException as exc:
            ended.append(f"{type(exc).__name__}: {exc}")
    thread = threading.Thread(target=run)
    thread.start()
    time.sleep(0.5)
    host.close()
    thread.join(60)
    print("engine:", ended, "alive:", thread.is_alive())
    print("lanes:", len(host.active_sequences))
""")


@pytest.mark.parametrize("depth", [1, 2])
def test_a_close_from_another_thread_waits_for_the_decode_it_would_free(tmp_path, depth):
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(depth), str(tmp_path)],
                          capture_output=True, text=True, timeout=180, cwd=str(tmp_path))
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert "alive: False" in done.stdout, done.stdout
    assert "the host is closed" in done.stdout or "closing" in done.stdout, done.stdout
    assert "lanes: 0" in done.stdout, done.stdout
