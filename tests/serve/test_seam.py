"""The server's side of the serving seam (engine/contract.py): what it asks of a host, and nothing
more.

The HTTP app needs nothing of llama-cpp-python: llama.cpp is behind the host. A child Python in
which `llama_cpp` cannot be imported imports the server's modules and serves completions and
chats on the model-free `InstantHost` (bench/instant_host.py). ChatML, rendered by the server
itself, is what llama.cpp renders; the scheduler's refusals are told by their `RejectReason`;
KV events ask the host for its prefixes through `PrefixEventsHost`.
"""
from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import textwrap

import pytest
from starlette.testclient import TestClient

from skippy_scheduler.serve import ServeSettings, kv_events
from skippy_scheduler.serve.chat import ChatTemplate, _apply, chatml

ROOT = pathlib.Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"

# Run first in the child: any import of llama_cpp (or a submodule) fails as if it were not
# installed.
BLOCK_LLAMA = textwrap.dedent("""\
    import importlib.abc
    import sys

    class _NoLlama(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "llama_cpp" or name.startswith("llama_cpp."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, _NoLlama())
    for name in [m for m in sys.modules if m == "llama_cpp" or m.startswith("llama_cpp.")]:
        del sys.modules[name]
    """)


def run_without_llama(code: str) -> subprocess.CompletedProcess[str]:
    # Run outside the checkout: `python -c` puts the working directory first on sys.path, and
    # the checkout's sources would shadow the installed package (compiled modules and all).
    prelude = BLOCK_LLAMA + f"BENCH_DIR = {str(BENCH)!r}\n"
    return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)],
                          cwd=pathlib.Path(sys.executable).parent, capture_output=True,
                          text=True, timeout=300)


def test_the_blocker_blocks():
    r = run_without_llama("import llama_cpp\n")
    assert r.returncode != 0
    assert "No module named 'llama_cpp'" in r.stderr


def test_the_app_imports_without_llama_cpp():
    r = run_without_llama("""\
        import sys

        import skippy_scheduler.serve.app
        import skippy_scheduler.serve.kv_events
        import skippy_scheduler.serve.server
        import skippy_scheduler.serve.vllm_compat

        assert not [m for m in sys.modules if m.startswith("llama_cpp")]
        print("imported")
        """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "imported"


def test_a_model_free_host_serves_chats_without_llama_cpp():
    r = run_without_llama("""\
        import json
        import sys

        sys.path.insert(0, BENCH_DIR)
        from starlette.testclient import TestClient

        from instant_host import InstantHost, build_server
        from skippy_scheduler.serve import ServeSettings

        server = build_server(ServeSettings(max_active=2), InstantHost(n_seq_max=2))
        server.runner.start()
        try:
            with TestClient(server.app) as client:
                chat = client.post("/v1/chat/completions", json={
                    "model": "instant", "max_tokens": 3,
                    "messages": [{"role": "user", "content": "hi"}]}).json()
                text = client.post("/v1/completions", json={
                    "model": "instant", "prompt": "hi", "max_tokens": 2}).json()
                models = client.get("/v1/models").json()
        finally:
            server.runner.stop()
        print(json.dumps({"chat": chat["choices"][0]["message"]["content"],
                          "prompt_tokens": chat["usage"]["prompt_tokens"],
                          "text": text["choices"][0]["text"],
                          "template": models["data"][0]["chat_template"],
                          "llama": [m for m in sys.modules if m.startswith("llama_cpp")]}))
        """)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    chatml = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert got == {"chat": "aaa", "prompt_tokens": 1 + len(chatml.encode()), "text": "aa",
                   "template": "chatml", "llama": []}


def _instant():
    sys.path.insert(0, str(BENCH))
    try:
        from instant_host import InstantHost, build_server
    finally:
        sys.path.remove(str(BENCH))
    return InstantHost, build_server


@pytest.mark.parametrize("messages", [
    [("user", "hi")],
    [("system", "You are helpful."), ("user", "Hi"), ("assistant", "a\nb"), ("user", "")],
    [("user", "h\u00e9llo \u2713 \U0001f600 <|im_end|>")],
    [("tool", "{\"x\": 1}")],
])
def test_chatml_is_what_llama_cpp_renders(messages):
    assert chatml(messages) == _apply(b"chatml", messages)
    assert ChatTemplate(None).render(messages) == chatml(messages)
    assert ChatTemplate(None).source == "chatml"


def test_a_template_llama_cpp_does_not_recognise_is_named_at_startup(caplog):
    """A model's own template that llama.cpp cannot render falls back to ChatML with a
    warning (a recognised one, or none at all, warns nothing)."""
    with caplog.at_level("WARNING", logger="skippy_scheduler.serve.chat"):
        strange = ChatTemplate("{% for m in messages %}<<{{ m.content }}>>{% endfor %}")
        assert strange.source == "chatml" and "not one llama.cpp recognises" in caplog.text
        caplog.clear()
        assert ChatTemplate("chatml").source == "model"
        assert ChatTemplate(None).source == "chatml"
        assert caplog.text == ""


def test_a_full_waiting_queue_is_a_503_by_its_reject_reason():
    """The scheduler refuses the third choice (one lane, one waiting place): the engine's
    `FinishEvent` says QUEUE_FULL, and that, not its message, makes the answer a 503."""
    InstantHost, build_server = _instant()
    server = build_server(ServeSettings(max_active=1, max_waiting=1),
                          InstantHost(n_seq_max=1, step_s=0.01))
    server.runner.start()
    try:
        with TestClient(server.app) as client:
            r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 100, "n": 3})
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == "queue_full"
            ok = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "aa"
    finally:
        server.runner.stop()


def test_kv_events_refuse_a_host_without_prefix_events():
    InstantHost, _ = _instant()
    settings = ServeSettings(kv_events_endpoint="tcp://127.0.0.1:1", prefix_cache_tokens=64)
    with pytest.raises(ValueError, match="keeps no prefixes"):
        kv_events.start(settings, InstantHost())
