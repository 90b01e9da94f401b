"""bench/trace_load.py and its replay (skippy_bench.open_loop): the trace slice, the prompts'
shared prefixes, a replay on a real server."""
from __future__ import annotations

import asyncio
import json

import pytest
import trace_load
from skippy_bench import loads, open_loop

# (timestamp ms, input tokens, output tokens, hash_ids): 512-token blocks, ids are prefix hashes.
ROWS = [
    (0, 2048, 64, [0, 1, 2, 3]),
    (0, 1400, 40, [0, 1, 4]),
    (400, 2048, 16, [0, 5, 6, 7]),
    (900, 2048, 64, [0, 1, 2, 3]),  # the first request again: the whole prompt is shared
    (900, 700, 8, [8, 9]),  # nothing in common with the others
    (1500, 1536, 24, [0, 1, 2]),
    (5000, 600, 8, [10, 11]),
]


@pytest.fixture
def trace_file(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps({"timestamp": t, "input_length": n, "output_length": o,
                                        "hash_ids": h}) + "\n" for t, n, o, h in ROWS))
    return str(path)


def _args(trace, *extra, url="http://127.0.0.1:9"):
    ap = trace_load.build_parser()
    args = ap.parse_args(["--url", url, "--trace", trace, "--progress-s", "0", *extra])
    open_loop.check_args(ap, args)
    return args


def test_slice_times_and_lengths(trace_file):
    args = _args(trace_file, "--start-s", "0.3", "--duration-s", "1.2", "--time-scale", "2")
    plan = open_loop.plan_requests(args)
    # Rows from 0.3 s to 1.5 s of trace time, gaps doubled, times from the slice's first row.
    assert [p.id for p in plan] == ["r2", "r3", "r4", "r5"]
    assert [p.at_s for p in plan] == pytest.approx([0.0, 1.0, 1.0, 2.2])
    # 1/32 of the prompt (BOS included), 1/8 of the output; 16 words per 512-token block.
    assert [p.prompt_tokens for p in plan] == [64, 64, 22, 48]
    assert [p.max_tokens for p in plan] == [2, 8, 1, 3]
    assert args.block_tokens == 16
    capped = open_loop.plan_requests(_args(trace_file, "--max-input", "20", "--max-output", "4",
                                            "--max-requests", "2"))
    assert [(p.prompt_tokens, p.max_tokens) for p in capped] == [(20, 4), (20, 4)]


def test_bad_options_are_refused(trace_file, capsys):
    for bad in (["--min-input", "1"], ["--time-scale", "0"], ["--itl-slo-s", "nan"],
                ["--extra", "[1]"], ["--max-requests", "0"]):
        with pytest.raises(SystemExit) as exc:
            _args(trace_file, *bad)
        assert exc.value.code == 2
    assert "must be" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="no request"):
        open_loop.plan_requests(_args(trace_file, "--start-s", "100"))


def test_equal_block_ids_give_equal_token_prefixes(trace_file, server):
    plan = open_loop.plan_requests(_args(trace_file))
    bt = 16
    ids = [server.host.tokenize(p.prompt, special=True) for p in plan]  # as the routes do
    assert [len(t) for t in ids] == [p.prompt_tokens for p in plan]  # one token per word
    for i, a in enumerate(plan):
        for j, b in enumerate(plan[:i]):
            k = 0
            while k < min(len(a.blocks), len(b.blocks)) and a.blocks[k] == b.blocks[k]:
                k += 1
            n = 1 + min(k * bt, a.prompt_tokens - 1, b.prompt_tokens - 1)  # BOS + shared runs
            assert ids[i][:n] == ids[j][:n], (a.id, b.id)
            if k < min(len(a.blocks), len(b.blocks)):  # the next blocks differ: so do tokens
                m = min(n + bt, len(ids[i]), len(ids[j]))
                assert ids[i][n:m] != ids[j][n:m], (a.id, b.id)
    assert ids[3] == ids[0]
    # The report's share: r1 shares 2 blocks, r3 all, r5 3, r2 one (block 0), r4 and r6 none.
    assert [p.shared_tokens for p in plan] == [0, 32, 16, 63, 0, 47, 0]


def test_replay_against_the_server(trace_file, server, tmp_path):
    out = tmp_path / "load.jsonl"
    # The trace's own output lengths (8 to 64 tokens): the server writes what a wake-up of its
    # stream finds in one chunk, and on a busy machine a short answer may come whole.
    common = ["--time-scale", "0.5", "--token-ids", "--max-input", "200", "--output-scale", "1"]
    assert trace_load.main(["--url", server.url, "--trace", trace_file, "--label", "t",
                            "--progress-s", "0", "--ttft-slo-s", "60", "--itl-slo-s", "60",
                            "--json", str(out), "--requests-out", str(tmp_path / "rq.jsonl"),
                            *common]) == 0
    doc = json.loads(out.read_text().splitlines()[-1])
    rows = [json.loads(line) for line in (tmp_path / "rq.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == [f"r{i}" for i in range(len(ROWS))]
    assert all(r["state"] == "completed" and r["within_slo"] for r in rows)
    assert [r["tokens"] for r in rows] == [r["max_tokens"] for r in rows]
    assert sum(r["stalls"] for r in rows) == doc["stalls"]
    assert max(r["itl_max_s"] for r in rows) == doc["itl_max_s"]
    assert doc["requests"] == doc["sent"] == doc["completed"] == len(ROWS)
    assert doc["failed"] == doc["cut_off"] == 0 and doc["errors"] == []
    expect_tokens = sum(o for _, _, o, _ in ROWS)
    assert doc["output_tokens"] == expect_tokens and doc["short_outputs"] == 0
    assert doc["slo_met"] == len(ROWS) and doc["slo_attainment_pct"] == 100.0
    assert doc["goodput_rps"] == pytest.approx(len(ROWS) / doc["wall_s"])
    assert doc["goodput_tokens_per_s"] == pytest.approx(doc["output_tokens_per_s"])
    assert doc["offered_rps"] == pytest.approx(len(ROWS) / 2.5)  # 7 requests over 2.5 s
    assert 0 < doc["ttft_p50_s"] <= doc["ttft_p99_s"]
    assert 0 < doc["itl_p50_s"] <= doc["itl_p99_s"] <= doc["itl_max_s"]
    assert doc["stalls"] == 0 and doc["requests_with_stalls"] == 0
    assert doc["max_burst"] == 2 and doc["client_lag_max_s"] >= 0
    assert 0 < doc["prefix_shared_pct"] < 100

    # Under an SLO no gap can meet, every gap is a stall and only answers that came in one
    # chunk are within.
    args = _args(trace_file, *common, "--ttft-slo-s", "60", "--itl-slo-s", "1e-9",
                 url=server.url)
    plan = open_loop.plan_requests(args)
    assert [p.max_tokens for p in plan] == [o for _, _, o, _ in ROWS]
    outcomes, wall = asyncio.run(open_loop.replay(plan, args))
    strict = open_loop.report(plan, outcomes, wall, args)
    assert strict["completed"] == len(ROWS) and strict["short_outputs"] == 0
    gaps = sum(len(o.result.gaps) for o in outcomes)
    assert strict["stalls"] == gaps > 0
    one_chunk = sum(not o.result.gaps for o in outcomes)
    assert strict["slo_met"] == one_chunk < len(ROWS)
    assert strict["requests_with_stalls"] == len(ROWS) - one_chunk
    # Every miss is the gaps' alone.
    assert (strict["slo_missed_gaps"], strict["slo_missed_ttft"], strict["slo_missed_both"],
            strict["slo_missed_unserved"]) == (len(ROWS) - one_chunk, 0, 0, 0)
    assert doc["slo_missed_gaps"] == doc["slo_missed_ttft"] == doc["slo_missed_both"] == 0
    assert all(r["slo_miss"] is None for r in rows)


def test_slo_in_ms_and_misses_by_reason(trace_file):
    args = _args(trace_file, "--slo-ttft-ms", "3000", "--slo-itl-ms", "500")
    assert (args.ttft_slo_s, args.itl_slo_s) == (3.0, 0.5)
    assert _args(trace_file).ttft_slo_s == 2.0  # the default stays
    for bad in (["--slo-ttft-ms", "0"], ["--slo-itl-ms", "nan"], ["--slo-itl-ms", "x"]):
        with pytest.raises(SystemExit):
            _args(trace_file, *bad)
    plan = open_loop.plan_requests(args)

    def outcome(first, gaps, ok=True, end=10.0, sent=True):
        o = open_loop.Outcome(plan[0], lag_s=0.0 if sent else -1.0)
        o.result = loads.Result(ok=ok, status=200 if ok else 503, sent=1.0, first=1.0 + first,
                                end=end, gaps=list(gaps))
        return o

    cases = [(outcome(1.0, [0.1, 0.4]), None), (outcome(3.5, [0.1]), "ttft"),
             (outcome(0.5, [0.1, 0.6]), "gaps"), (outcome(4.0, [0.7]), "both"),
             (outcome(0.5, [], ok=False), "unserved"), (outcome(0.5, [], end=0.0), "unserved")]
    assert [open_loop.slo_miss(o, args) for o, _ in cases] == [why for _, why in cases]
    doc = open_loop.report(plan, [o for o, _ in cases], 2.0, args)
    assert (doc["slo_met"], doc["slo_missed_ttft"], doc["slo_missed_gaps"],
            doc["slo_missed_both"], doc["slo_missed_unserved"]) == (1, 1, 1, 1, 2)
    assert doc["goodput_rps"] == 0.5 and doc["slo_attainment_pct"] == pytest.approx(100 / 6)


def test_a_shedding_server_s_503s_are_failures_not_cut_offs(trace_file, model_path):
    """Every request shed (a forced cost no budget meets): each ends with a 503, counted as
    failed, refused and unserved."""
    from serve_support import start_server

    from skippy_scheduler.slack import StepCost

    srv = start_server(model_path, slo_ttft_ms=1.0, slo_shed=True)
    try:
        srv.context.slo.cost = lambda: StepCost(base_us=1e6, per_prefill_token_us=1e6)
        args = _args(trace_file, "--time-scale", "0.1", "--max-input", "200", "--no-warmup",
                     url=srv.url)
        plan = open_loop.plan_requests(args)
        outcomes, wall = asyncio.run(open_loop.replay(plan, args))
        doc = open_loop.report(plan, outcomes, wall, args)
    finally:
        srv.shutdown()
    n = len(ROWS)
    assert (doc["failed"], doc["refused_503"], doc["cut_off"], doc["completed"]) == (n, n, 0, 0)
    assert doc["slo_missed_unserved"] == n and doc["slo_met"] == 0
    assert "over its TTFT budget of 1 ms" in doc["errors"][0]
