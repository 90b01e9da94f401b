"""bench/serve_load.py drives a server and reports what it measured."""
from __future__ import annotations

import collections
import importlib.util
import json
import os
import sys

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "serve_load.py")


def _bench():
    spec = importlib.util.spec_from_file_location("serve_load", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["serve_load"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_prompts_have_the_asked_length_and_shared_prefix(reference):
    bench = _bench()
    prompts = bench.make_prompts(8, 40, 24, 0.5, seed=1)
    ids = [reference.tokenize(p, special=True) for p in prompts]
    assert all(len(t) == 40 for t in ids)
    heads = collections.Counter(tuple(t[:24]) for t in ids)
    assert sorted(heads.values()) == [1, 1, 1, 1, 4]  # half share the prefix, half do not


def test_load_run_reports_tokens_and_latencies(server, tmp_path):
    bench = _bench()
    out = tmp_path / "load.jsonl"
    assert bench.main(["run", "--url", server.url, "--label", "t", "--concurrency", "3",
                       "--requests", "6", "--prompt-tokens", "48", "--shared-prefix", "32",
                       "--max-tokens", "8", "--token-ids", "--json", str(out)]) == 0
    doc = json.loads(out.read_text().splitlines()[-1])
    assert doc["completed"] == 6 and doc["errors"] == [] and doc["short_outputs"] == 0
    assert doc["output_tokens"] == 48 and doc["output_tokens_per_s"] > 0
    assert 0 < doc["ttft_p50_s"] <= doc["ttft_p99_s"] and doc["itl_p99_s"] > 0
