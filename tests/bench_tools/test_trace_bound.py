"""bench/trace_bound.py: the per-burst shortest-first bound on TTFT attainment, and its CLI."""
from __future__ import annotations

import json

import pytest
import trace_bound
import trace_load
from skippy_bench import open_loop
from lab_support import mooncake_file

from skippy_scheduler.hosts.tiny_model import write_tiny_llama

# (timestamp ms, trace blocks of 512 tokens, output tokens): two requests at 0 ms sharing their
# first block, one more at 0 ms (a burst), and a lone request later.
ROWS = [
    (0, [0, 1, 2, 3], 8),
    (0, [0, 4], 8),
    (0, [5], 8),
    (3000, [6, 7, 8, 9], 8),
]


@pytest.fixture
def trace_file(tmp_path):
    return mooncake_file(tmp_path, ROWS, "trace.jsonl")


def test_group_bound_takes_the_cheapest_first():
    # 0.5 s: 0.10 + 0.15 + 0.20 = 0.45 fit, the 0.3 s prompt does not.
    assert trace_bound.group_bound([0.3, 0.1, 0.2, 0.15], 0.5) == 3
    assert trace_bound.group_bound([0.3, 0.1, 0.2, 0.15], 0.09) == 0
    assert trace_bound.group_bound([], 1.0) == 0


def test_a_prompt_costs_its_tokens_and_their_positions():
    cost = trace_bound.PrefillCost(token_s=1e-3, position_s=1e-4)
    # positions 2, 3, 4: 3 tokens and 9 earlier positions
    assert cost.prompt_s(2, 5) == pytest.approx(3e-3 + 9e-4)
    assert cost.prompt_s(0, 1) == pytest.approx(1e-3)
    assert trace_bound.PrefillCost(1e-3).prompt_s(100, 300) == pytest.approx(0.2)


def test_bound_counts_each_burst_alone_with_shared_tokens_free(trace_file):
    ap = trace_load.build_parser()
    args = ap.parse_args(["--url", "http://127.0.0.1:9", "--trace", trace_file])
    open_loop.check_args(ap, args)
    plan = open_loop.plan_requests(args)
    # 1/32 of the prompts: 64, 32 (16 shared with the first), 16 and 64 tokens.
    assert [(p.prompt_tokens, p.shared_tokens) for p in plan] == [
        (64, 0), (32, 16), (16, 0), (64, 0)]
    # At 10 ms a token the burst's two 16-token prompts take 0.32 s, its third 0.96 s; the lone
    # request 0.64 s.
    flat = trace_bound.PrefillCost(1e-2)
    assert trace_bound.attainment_bound(plan, flat, 0.3) == 1  # one 16-token prompt
    assert trace_bound.attainment_bound(plan, flat, 0.5) == 2  # both of them
    assert trace_bound.attainment_bound(plan, flat, 0.7) == 3  # and the lone request
    assert trace_bound.attainment_bound(plan, flat, 1.0) == 4
    # With 1 ms a token per earlier position the shared prompt's tokens (positions 16-31) cost
    # 0.16 + 0.376 s, the unshared 16-token one 0.16 + 0.12 s: only that one fits 0.3 s, and
    # the shared one now misses 0.5 s.
    steep = trace_bound.PrefillCost(1e-2, 1e-3)
    assert trace_bound.attainment_bound(plan, steep, 0.3) == 1
    assert trace_bound.attainment_bound(plan, steep, 0.5) == 1
    assert trace_bound.attainment_bound(plan, steep, 0.9) == 2


def test_cli_prints_and_appends_json(trace_file, tmp_path, capsys):
    out = tmp_path / "bound.jsonl"
    assert trace_bound.main(["--trace", trace_file, "--token-ms", "10", "--ttft", "0.3,0.5",
                             "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "4 requests in 2 arrival groups (largest 3)" in text
    assert "TTFT <= 0.5 s: at most 2 of 4 (50.0 %)" in text
    doc = json.loads(out.read_text())
    assert [(r["ttft_s"], r["within"]) for r in doc["bounds"]] == [(0.3, 1), (0.5, 2)]
    assert doc["token_ms"] == pytest.approx(10) and doc["position_us"] == 0


def test_cli_takes_a_position_cost(trace_file, capsys):
    assert trace_bound.main(["--trace", trace_file, "--token-ms", "10", "--position-us", "1000",
                             "--ttft", "0.5"]) == 0
    text = capsys.readouterr().out
    assert "+ 1000.000 µs a token per earlier position: a 64-token prompt 2.656 s" in text
    assert "TTFT <= 0.5 s: at most 1 of 4 (25.0 %)" in text


def test_bad_options_are_refused(trace_file, capsys):
    for bad in (["--token-ms", "0"], ["--ttft", "2,x"], ["--ttft", "-1"], [],
                ["--token-ms", "1", "--threads", "0"], ["--position-us", "1"],
                ["--token-ms", "1", "--position-us", "-1"]):
        with pytest.raises(SystemExit) as exc:
            trace_bound.main(["--trace", trace_file, *bad])
        assert exc.value.code == 2
    assert "--token-ms" in capsys.readouterr().err


def test_measures_the_prefill_cost_on_a_model(tmp_path):
    model = write_tiny_llama(tmp_path / "tiny.gguf", seed=3)
    cost = trace_bound.measure_prefill_cost(str(model), threads=1)
    assert 0 < cost.token_s < 1 and 0 <= cost.position_s < 1e-3
