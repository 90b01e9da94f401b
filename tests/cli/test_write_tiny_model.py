"""`write-tiny-model PATH`: the built-in tiny model in a file, which `split` then cuts."""
from __future__ import annotations

import pathlib

import pytest

from skippy_scheduler.cli import main

pytest.importorskip("gguf")


def test_it_writes_the_model_the_other_commands_write(tmp_path, capsys):
    from skippy_scheduler.hosts.tiny_model import write_tiny_llama

    path = tmp_path / "tiny.gguf"
    assert main(["write-tiny-model", str(path), "--seed", "5"]) == 0
    out = capsys.readouterr().out
    assert "tiny.gguf\t" in out and "2 layers, f32" in out
    same = write_tiny_llama(tmp_path / "same.gguf", seed=5)
    assert path.read_bytes() == pathlib.Path(same).read_bytes()
    assert main(["write-tiny-model", str(tmp_path / "zero.gguf")]) == 0
    again = write_tiny_llama(tmp_path / "zero-again.gguf", seed=0)
    assert (tmp_path / "zero.gguf").read_bytes() == pathlib.Path(again).read_bytes()


def test_an_unwritable_path_is_refused(tmp_path, capsys):
    assert main(["write-tiny-model", str(tmp_path / "missing" / "tiny.gguf")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["write-tiny-model", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err
    assert main(["write-tiny-model"]) == 2
    assert "required: PATH" in capsys.readouterr().err


def test_split_cuts_it(tmp_path, capsys):
    pytest.importorskip("zmq")
    pytest.importorskip("llama_cpp")
    model = tmp_path / "tiny.gguf"
    assert main(["write-tiny-model", str(model)]) == 0
    assert main(["split", "-m", str(model), "--stages", "2", "--out", str(tmp_path / "s")]) == 0
    out = capsys.readouterr().out
    assert "stage-0.gguf\tlayers 0-0" in out and "stage-1.gguf\tlayers 1-1" in out
