"""bench/llama_step_shapes.py: every shape timed on a real llama.cpp context, and its options."""
from __future__ import annotations

import json

import llama_step_shapes
import pytest

from skippy_scheduler.hosts.tiny_model import write_tiny_llama


def test_times_every_shape(tmp_path, capsys):
    model = write_tiny_llama(tmp_path / "tiny.gguf", seed=5)
    out = tmp_path / "shapes.json"
    assert llama_step_shapes.main(["--model", str(model), "--threads", "1", "--lanes", "4",
                                   "--ctx-size", "2048", "--context", "40", "--rows-max", "3",
                                   "--repeats", "1", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert sorted(doc["decode_ms"], key=int) == ["1", "3"]
    assert sorted(doc["prefill_ms"], key=int) == [str(n) for n in llama_step_shapes.CHUNKS]
    assert doc["mixed_ms"].keys() == doc["prefill_ms"].keys()
    assert list(doc["decode_order_ms"]) == ["ascending", "rotated", "reversed", "gap",
                                          "gap filled"]
    assert all(v > 0 for part in ("decode_ms", "prefill_ms", "mixed_ms", "decode_order_ms")
               for v in doc[part].values())
    printed = capsys.readouterr().out
    assert "mixed with 3 rows" in printed and "reversed" in printed


def test_bad_options_are_refused(tmp_path, capsys):
    for bad in (["--rows-max", "4", "--lanes", "4"], ["--threads", "0"],
                ["--context", "500", "--ctx-size", "2048", "--lanes", "4", "--rows-max", "2"],
                ["--ctx-size", "1024", "--lanes", "4", "--rows-max", "2"]):
        with pytest.raises(SystemExit) as exc:
            llama_step_shapes.main(["--model", "x.gguf", *bad])
        assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--rows-max" in err and "does not fit" in err and "do not hold" in err
