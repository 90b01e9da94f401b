"""bench/priority_load.py, smoked tiny: the load against a real server (4 lanes, 6 background
streams, 3 urgent requests) reports every urgent request and the background's rate; the
resume cost times one restore (nothing recomputed) and one recompute (the replay again)."""
from __future__ import annotations

import json

import priority_load

from skippy_scheduler.hosts.tiny_model import write_tiny_llama


def test_the_load_reports_the_urgent_requests_and_the_background(server, capsys, tmp_path):
    out = tmp_path / "p.jsonl"
    assert priority_load.main([
        "run", "--url", server.url, "--label", "tiny", "--background", "6",
        "--background-tokens", "48", "--prompt-tokens", "16", "--urgent", "3",
        "--urgent-tokens", "3", "--urgent-prompt-tokens", "8", "--urgent-interval", "0.05",
        "--settle", "0.05", "--json", str(out)]) == 0
    doc = json.loads(out.read_text().splitlines()[-1])
    assert doc["label"] == "tiny" and doc["errors"] == []
    assert doc["urgent_completed"] == 3 and doc["urgent_ttft_p99_s"] >= doc["urgent_ttft_p50_s"] > 0
    assert doc["background_tokens_per_s"] > 0 and doc["window_s"] > 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1]) == doc


def test_the_resume_cost_restores_or_recomputes_the_replay(tmp_path, capsys):
    model = write_tiny_llama(tmp_path / "tiny.gguf", seed=3)
    assert priority_load.main(["resume-cost", "--model", str(model), "--prompt-tokens", "20",
                               "--generated", "6", "--repeat", "1", "--threads", "1"]) == 0
    doc = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert doc["restore_recomputed_tokens"] == 0
    assert doc["recompute_recomputed_tokens"] == 20 + 6 - 1
    assert doc["restore_ms"] > 0 and doc["recompute_ms"] > 0
