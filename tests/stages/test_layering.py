"""The stage host is a host like the llama host: nothing under skippy_scheduler/hosts/stages
imports the server (skippy_scheduler/serve); the server's staged runner (serve/staged.py) gives
it plain values."""
from __future__ import annotations

import ast
import pathlib

import pytest

import skippy_scheduler

PACKAGE = pathlib.Path(skippy_scheduler.__file__).resolve().parent
STAGES = PACKAGE / "hosts" / "stages"


def _module_name(path: pathlib.Path) -> list[str]:
    parts = ["skippy_scheduler", *path.relative_to(PACKAGE).with_suffix("").parts]
    return parts[:-1] if parts[-1] == "__init__" else parts


def _imports(path: pathlib.Path):
    """(line, absolute module name) of every import in `path`, relative ones resolved; a
    `from X import name` also counts as importing `X.name` (name may be a module)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name[:-1]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            yield node.lineno, module
            for alias in node.names:
                yield node.lineno, f"{module}.{alias.name}"


def _in_serve(module: str) -> bool:
    return module == "skippy_scheduler.serve" or module.startswith("skippy_scheduler.serve.")


def test_the_resolution_of_relative_imports():
    path = STAGES / "opening.py"
    assert _module_name(path) == ["skippy_scheduler", "hosts", "stages", "opening"]
    found = {module for _, module in _imports(path)}
    assert "skippy_scheduler.hosts.stages.host.StageHost" in found
    assert _in_serve("skippy_scheduler.serve.runner") and not _in_serve("skippy_scheduler.server")


def test_the_stage_host_imports_nothing_from_the_server():
    modules = sorted(STAGES.rglob("*.py"))
    assert STAGES / "host.py" in modules and STAGES / "opening.py" in modules
    found = [f"{path.relative_to(PACKAGE)}:{line}: {module}"
             for path in modules for line, module in _imports(path) if _in_serve(module)]
    assert not found, found


def test_open_stage_host_refuses_before_starting_a_worker():
    pytest.importorskip("llama_cpp")
    pytest.importorskip("zmq")
    from skippy_scheduler.hosts.stages.opening import open_stage_host, stage_context_cells

    assert stage_context_cells(1024, 0) == 1024
    assert stage_context_cells(1024, 1) == stage_context_cells(1024, 256) == 1024 + 256
    with pytest.raises(ValueError, match="give stages or stage_addresses, not both"):
        open_stage_host(stages="dir", stage_addresses=["ipc:///nowhere"], ctx_size=1024,
                        n_seq_max=4)
    with pytest.raises(ValueError, match="stage_addresses needs model"):
        open_stage_host(stage_addresses=["ipc:///nowhere"], ctx_size=1024, n_seq_max=4)
