"""bench/cold_hold.py on a small burst: the counts it reports are the rule's (the shared head
prefilled once with the hold, by every sharer without it) and the outputs agree."""
from __future__ import annotations

import json

import cold_hold


def _run(tmp_path, *args: str) -> tuple[dict, dict]:
    """bench/cold_hold.py on 100-token prompts sharing 80 with `args`; (hold off, hold on)."""
    out = tmp_path / "cold.json"
    assert cold_hold.main(["--prompt-tokens", "100", "--shared-prefix", "80", "--threads", "1",
                           *args, "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["identical"] is True
    return result["hold off"], result["hold on"]


def test_the_burst_counts(tmp_path, capsys):
    off, on = _run(tmp_path, "--requests", "6", "--shared-fraction", "0.5", "--max-tokens", "3",
                   "--lanes", "6", "--ctx-size", "1536", "--prefix-cache-tokens", "1024")
    assert off["prefilled"] == 6 * 100 and off["prompt_keeps"] == 0
    # three share 80 tokens: the leader prefills them, the two others restore them
    assert on["prompt_keeps"] == 1 and on["restored"] == 2 * 80
    assert on["prefilled"] == 6 * 100 - 2 * 80
    assert "hold on" in capsys.readouterr().out


def test_spaced_arrivals_restore_from_a_decoding_leader(tmp_path):
    """Arrivals far enough apart that each sharer comes while the one before it decodes: with
    the hold the first sharer's prompt is kept from its running lane and the others restore the
    head; without it each prefills it (nothing is released before the last one arrives)."""
    off, on = _run(tmp_path, "--requests", "4", "--shared-fraction", "1", "--max-tokens", "40",
                   "--lanes", "4", "--ctx-size", "1024", "--prefix-cache-tokens", "512",
                   "--arrival-ms", "100")
    assert off["prefilled"] == 4 * 100 and off["restored"] == 0
    assert on["prompt_keeps"] == 1 and on["restored"] == 3 * 80
    assert on["prefilled"] == 4 * 100 - 3 * 80
