"""bench/cold_hold.py on a small burst: the counts it reports are the rule's (the shared head
prefilled once with the hold, by every sharer without it) and the outputs agree."""
from __future__ import annotations

import json

import cold_hold


def test_the_burst_counts(tmp_path, capsys):
    out = tmp_path / "cold.json"
    assert cold_hold.main(["--requests", "6", "--prompt-tokens", "100", "--shared-prefix", "80",
                           "--shared-fraction", "0.5", "--max-tokens", "3", "--lanes", "6",
                           "--ctx-size", "1536", "--prefix-cache-tokens", "1024",
                           "--threads", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["identical"] is True
    off, on = result["hold off"], result["hold on"]
    assert off["prefilled"] == 6 * 100 and off["prompt_keeps"] == 0
    # three share 80 tokens: the leader prefills them, the two others restore them
    assert on["prompt_keeps"] == 1 and on["restored"] == 2 * 80
    assert on["prefilled"] == 6 * 100 - 2 * 80
    assert "hold on" in capsys.readouterr().out
