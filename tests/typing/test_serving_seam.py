"""The serving seam (engine/contract.py, "the serving seam"): the hosts a server runs on are
`ServingHost`s, with the optional capabilities each claims, as mypy --strict sees them and as
`isinstance` sees them at runtime; and nothing in serve/ types a host as `Any`."""
import ast
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

from skippy_scheduler.engine import contract
from skippy_scheduler.engine.contract import (ChatTemplateHost, ClosingHost, ContextLimitsHost,
                                              GrammarCheckingHost, Host, MemoryComponentsHost,
                                              PrefixEventsHost, RoutesHost, ServingHost,
                                              VocabularyHost)

ROOT = pathlib.Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
SERVE = ROOT / "skippy_scheduler" / "serve"


def _instant_host():
    sys.path.insert(0, str(BENCH))
    try:
        from instant_host import InstantHost
    finally:
        sys.path.remove(str(BENCH))
    return InstantHost


def test_the_serving_protocols_are_in_the_contract():
    for name in ("VocabularyHost", "ChatTemplateHost", "ContextLimitsHost", "ClosingHost",
                 "RoutesHost", "ServingHost", "GrammarCheckingHost", "MemoryComponentsHost",
                 "PrefixEventsHost", "InterruptibleHost"):
        assert name in contract.__all__, name
    # A served host is an engine host too, and the routes' needs are part of it.
    assert {Host, RoutesHost, ContextLimitsHost, ClosingHost} <= set(ServingHost.__mro__)
    assert {VocabularyHost, ChatTemplateHost} <= set(RoutesHost.__mro__)


def test_the_instant_host_is_a_serving_host():
    pytest.importorskip("prometheus_client")  # bench/instant_host.py builds a server too
    pytest.importorskip("fastapi")
    host = _instant_host()(n_seq_max=2)
    assert isinstance(host, ServingHost)
    assert isinstance(host, RoutesHost)
    # A model-free host: no grammar sampler, no memory pools, no prefixes.
    assert not isinstance(host, GrammarCheckingHost)
    assert not isinstance(host, MemoryComponentsHost)
    assert not isinstance(host, PrefixEventsHost)
    assert host.sequence_id_settings == {"sequence_id_limit": 2, "reserved_sequence_ids": 0}


def test_the_llama_host_is_a_serving_host(tmp_path):
    pytest.importorskip("llama_cpp")
    from skippy_scheduler.hosts.llama import LlamaHost
    from skippy_scheduler.hosts.tiny_model import write_tiny_llama

    path = write_tiny_llama(tmp_path / "tiny.gguf", seed=3)
    with LlamaHost(path, n_ctx=256, n_seq_max=2, n_threads=1, prefix_cache_tokens=128,
                   prefix_holders=2) as host:
        assert isinstance(host, ServingHost)
        assert isinstance(host, GrammarCheckingHost)
        assert isinstance(host, PrefixEventsHost)
        assert isinstance(host, MemoryComponentsHost)  # its devices' KV (hosts/offload.py)
        assert host.prefix_store is not None
        assert host.held_tokens("nobody") is None
        seen = []
        host.watch_prefixes(lambda kind, entry: seen.append(kind))
        assert seen == []


def test_the_hosts_satisfy_the_protocols_under_mypy_strict(tmp_path):
    """Typed assignments mypy checks: each host to `ServingHost` and to the optional
    protocols it implements (the stage host needs workers to build, so only mypy sees it)."""
    pytest.importorskip("mypy")
    (tmp_path / "mypy.ini").write_text("[mypy]\n")
    snippet = tmp_path / "serving_hosts.py"
    snippet.write_text(textwrap.dedent("""\
        from instant_host import InstantHost

        from skippy_scheduler.engine.contract import (
            GrammarCheckingHost, InterruptibleHost, MemoryComponentsHost, PrefixEventsHost,
            RoutesHost, ServingHost)
        from skippy_scheduler.hosts.llama import LlamaHost
        from skippy_scheduler.hosts.stages.host import StageHost


        def llama(host: LlamaHost) -> None:
            served: ServingHost = host
            grammar: GrammarCheckingHost = host
            memory: MemoryComponentsHost = host
            events: PrefixEventsHost = host


        def stages(host: StageHost) -> None:
            served: ServingHost = host
            memory: MemoryComponentsHost = host
            events: PrefixEventsHost = host
            interruptible: InterruptibleHost = host


        def instant(host: InstantHost) -> None:
            served: ServingHost = host
            routes: RoutesHost = host
        """))
    cmd = [sys.executable, "-m", "mypy", "--strict", "--config-file", str(tmp_path / "mypy.ini"),
           "--cache-dir", str(tmp_path / "cache"), "--ignore-missing-imports", str(snippet)]
    env = {**os.environ, "MYPYPATH": str(BENCH)}
    r = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stdout + r.stderr


def _annotations_of_hosts(tree: ast.AST):
    """(line, annotation) of every parameter, attribute or variable named `host`."""
    for node in ast.walk(tree):
        if isinstance(node, ast.arg) and node.arg == "host" and node.annotation is not None:
            yield node.lineno, node.annotation
        elif isinstance(node, ast.AnnAssign):
            target = node.target
            name = (target.id if isinstance(target, ast.Name)
                    else target.attr if isinstance(target, ast.Attribute) else None)
            if name == "host":
                yield node.lineno, node.annotation


def test_no_host_in_serve_is_typed_any():
    found = []
    for path in sorted(SERVE.glob("*.py")):
        for line, annotation in _annotations_of_hosts(ast.parse(path.read_text())):
            if "Any" in ast.unparse(annotation):
                found.append(f"{path.name}:{line}: {ast.unparse(annotation)}")
    assert not found, found
