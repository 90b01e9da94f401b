"""bench/serve_load.py drives a server and reports what it measured."""
from __future__ import annotations

import collections
import json
import math

import pytest
import serve_load
from serve_support import LANE_CTX
from skippy_bench.loads import make_prompts

from skippy_scheduler.hosts.llama import LlamaHost


@pytest.fixture(scope="module")
def reference(model_path):
    """The server's model in a host of its own, to tokenize with."""
    with LlamaHost(model_path, n_ctx=LANE_CTX, n_seq_max=1, n_threads=1) as host:
        yield host


def test_prompts_have_the_asked_length_and_shared_prefix(reference):
    prompts = make_prompts(8, 40, 24, 0.5, seed=1)
    ids = [reference.tokenize(p, special=True) for p in prompts]
    assert all(len(t) == 40 for t in ids)
    heads = collections.Counter(tuple(t[:24]) for t in ids)
    assert sorted(heads.values()) == [1, 1, 1, 1, 4]  # half share the prefix, half do not


def test_load_run_reports_tokens_and_latencies(server, tmp_path):
    out = tmp_path / "load.jsonl"
    assert serve_load.main(["run", "--url", server.url, "--label", "t", "--concurrency", "3",
                       "--requests", "6", "--prompt-tokens", "48", "--shared-prefix", "32",
                       "--max-tokens", "8", "--token-ids", "--json", str(out)]) == 0
    doc = json.loads(out.read_text().splitlines()[-1])
    assert doc["completed"] == 6 and doc["errors"] == [] and doc["short_outputs"] == 0
    assert doc["output_tokens"] == 48 and doc["output_tokens_per_s"] > 0
    assert 0 < doc["ttft_p50_s"] <= doc["ttft_p99_s"]
    assert doc["tokens_per_chunk"] == doc["output_tokens"] / doc["token_chunks"]
    # A gap needs two chunks of one request. The server writes what one wake-up of its event
    # loop carries as one chunk per choice (serve/stream.py), so on a busy machine a request's
    # 8 tokens of the tiny model can arrive in a single chunk, and then it has no gap.
    if doc["token_chunks"] > doc["completed"]:
        assert 0 < doc["itl_p50_s"] <= doc["itl_p99_s"]
    else:
        assert math.isnan(doc["itl_p50_s"]) and math.isnan(doc["itl_p99_s"])
