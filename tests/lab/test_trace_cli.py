"""`skippy-scheduler lab --trace FILE`: the table, the JSON document, user errors."""
from __future__ import annotations

import json

import pytest

from skippy_scheduler.cli import main
from skippy_scheduler.lab.report import TRACE_COLUMNS
from skippy_scheduler.lab.traces import tenant_of_id

ROWS = [
    '{"timestamp": 0, "input_length": 1100, "output_length": 6, "hash_ids": [0, 1, 2]}',
    '{"timestamp": 2, "input_length": 1300, "output_length": 4, "hash_ids": [0, 1, 3]}',
    '{"timestamp": 2, "input_length": 600, "output_length": 9, "hash_ids": [0, 4]}',
    '{"timestamp": 5, "input_length": 1100, "output_length": 2, "hash_ids": [0, 1, 2]}',
]
REQUIRED = ("requests", "completed", "p50_ttft_ms", "p90_ttft_ms", "p99_ttft_ms",
            "p50_queue_ms", "p99_queue_ms", "output_tokens_per_s", "hit_rate", "evictions",
            "stale_refreshes", "preemptions")


@pytest.fixture
def trace_file(tmp_path):
    path = tmp_path / "small.jsonl"
    path.write_text("\n".join(ROWS) + "\n")
    return str(path)


def lab(capsys, *argv):
    code = main(["lab", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_table_and_json(tmp_path, capsys, trace_file, backend):
    out_json = tmp_path / "replay.json"
    code, out, err = lab(capsys, "--trace", trace_file, "--scheduler", backend, "--json",
                         str(out_json), "--policy", "fcfs", "--policy", "fair-share",
                         "--tenants", "3", "--max-active", "2")
    assert code == 0 and err == ""  # no progress bar: stderr is not a terminal
    lines = out.splitlines()
    assert lines[0].startswith(f"# trace {trace_file} format=mooncake requests=4 ")
    header = next(k for k, line in enumerate(lines) if line.startswith("policy "))
    assert lines[header].split()[0] == "policy"
    rows = lines[header + 1:header + 3]
    assert [r.split()[0] for r in rows] == ["fcfs", "fair-share"]
    assert all(len(r.split()) == len(TRACE_COLUMNS) for r in rows)
    assert "# per-tenant service, tokens/s while the trace arrives" in out
    doc = json.loads(out_json.read_text())
    assert list(doc) == ["trace", "policies"] and list(doc["policies"]) == ["fcfs", "fair-share"]
    for name, figures in doc["policies"].items():
        assert all(key in figures for key in REQUIRED), name
        assert figures["requests"] == figures["completed"] == 4
        assert set(figures["tenant_service_tokens_per_s"]) == \
            {tenant_of_id(f"r{k}", 3) for k in range(4)}
    t = doc["trace"]
    assert (t["format"], t["requests"], t["mode"], t["backend"]) == ("mooncake", 4, "mixed",
                                                                     backend)
    assert t["options"]["prefix_cache_tokens"] == 8 << 20 and t["time_scale"] == 1.0
    # Block 0 and 1 are reused: the second and fourth requests restore from the cache.
    assert doc["policies"]["fcfs"]["hit_rate"] > 0


def test_options_reach_the_replay(tmp_path, capsys, trace_file):
    out_json = tmp_path / "r.json"
    code, out, _ = lab(capsys, "--trace", trace_file, "--json", str(out_json), "--policy",
                       "cache-aware-aging", "--no-mixed", "--time-scale", "100",
                       "--limit", "3", "--prefix-cache-tokens", "0", "--format", "mooncake")
    assert code == 0
    doc = json.loads(out_json.read_text())
    t, f = doc["trace"], doc["policies"]["cache-aware-aging"]
    assert (t["mode"], t["time_scale"], t["limit"], t["requests"]) == ("phase", 100.0, 3, 3)
    assert t["options"]["prefix_cache_tokens"] == 0
    assert f["hit_rate"] == 0 and f["requests"] == 3 and f["jain_index"] is None
    assert f["makespan_s"] > 0.2  # arrivals 100 times further apart: 0, 0.2 s, 0.2 s
    code, _, _ = lab(capsys, "--trace", trace_file, "--json", str(out_json), "--policy", "fcfs",
                     "--prefix-cache-tokens", "unlimited")
    assert code == 0
    assert json.loads(out_json.read_text())["trace"]["options"]["prefix_cache_tokens"] is None


def test_plots(tmp_path, capsys, trace_file):
    pytest.importorskip("matplotlib")
    code, _, err = lab(capsys, "--trace", trace_file, "--policy", "fcfs", "--plot",
                       str(tmp_path / "plots"))
    assert code == 0
    for name in ("trace_ttft_cdf.png", "trace_hit_rate.png", "trace_queue_depth.png"):
        assert f"# wrote {tmp_path / 'plots' / name}" in err


def test_malformed_line_is_one_user_error_before_any_replay(tmp_path, capsys, monkeypatch):
    from skippy_scheduler.cli import lab_runs as lab_cli

    def no_run(*args, **kwargs):
        raise AssertionError("a replay started before the trace was checked")

    monkeypatch.setattr(lab_cli, "run_replays", no_run)
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(ROWS[:2] + ['{"timestamp": 3, "input_length": 9, '
                                          '"output_length": 1, "hash_ids": [0, 1]}']) + "\n")
    code, out, err = lab(capsys, "--trace", str(path))
    assert code == 2 and out == ""
    assert err.splitlines()[-1] == (f"skippy-scheduler lab: error: {path}:3: hash_ids: 2 block "
                                    "ids for input_length 9; 512-token blocks need "
                                    "ceil(9 / 512) = 1")


ERRORS = [
    (["--trace", "{missing}"], "trace file not found"),
    (["--trace", "{trace}", "--suite"], "--trace and --suite are two different runs"),
    (["--trace", "{trace}", "--format", "azure"], "header: missing column(s)"),
    (["--trace", "{trace}", "--format", "xml"], "invalid choice: 'xml'"),
    (["--trace", "{trace}", "--policy", "lottery"], "unknown policy 'lottery'"),
    (["--trace", "{trace}", "--mixed", "--prefill-chunk", "0"], "expected an integer >= 1"),
    (["--trace", "{trace}", "--time-scale", "0"], "expected a finite number > 0"),
    (["--trace", "{trace}", "--limit", "0"], "expected an integer >= 1"),
    (["--trace", "{trace}", "--tenants", "0"], "expected an integer >= 1"),
    (["--trace", "{trace}", "--prefix-cache-tokens", "-5"], "expected an integer >= 0"),
    (["--trace", "{trace}", "--requests", "10"], "--requests applies to the synthetic suite"),
    (["--trace", "{trace}", "--scenario", "cold-burst-n1"], "--scenario applies to the "
                                                            "reference scenarios"),
    (["--trace", "{trace}", "--max-active", "0"], "expected an integer >= 1"),
    (["--trace", "{trace}", "--json", "{dir}"], "--json: {dir} is a directory"),
    (["--time-scale", "2"], "--time-scale needs --trace"),
    (["--suite", "--tenants", "3"], "--tenants needs --trace"),
    (["--max-active", "3"], "--max-active needs --suite or --trace"),
]


@pytest.mark.parametrize("argv, fragment", ERRORS, ids=[" ".join(a) for a, _ in ERRORS])
def test_user_errors(tmp_path, capsys, trace_file, argv, fragment):
    names = {"trace": trace_file, "missing": str(tmp_path / "none.jsonl"), "dir": str(tmp_path)}
    code, out, err = lab(capsys, *[a.format(**names) for a in argv])
    lines = err.splitlines()
    assert code == 2 and out == "" and len(lines) == 2, err
    assert lines[0].startswith("usage: skippy-scheduler lab ")
    assert lines[1].startswith("skippy-scheduler lab: error: ")
    assert fragment.format(**names) in lines[1]


def test_progress_bar_on_a_terminal(tmp_path, trace_file, monkeypatch, capsys):
    pytest.importorskip("tqdm")
    import sys

    from skippy_scheduler.lab.replay import run_replay
    from skippy_scheduler.lab.traces import open_trace

    run_replay(open_trace(trace_file), "fcfs", progress=True)
    assert "fcfs/mixed" in capsys.readouterr().err
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)
    run_replay(open_trace(trace_file), "fcfs")
    assert capsys.readouterr().err == ""


def test_an_slo_told_prints_the_share_within_it_per_policy(tmp_path, capsys, trace_file):
    out_json = tmp_path / "slo.json"
    code, out, err = lab(capsys, "--trace", trace_file, "--slack", "--slo", "--policy", "fcfs",
                         "--ttft-target-ms", "100", "--itl-target-ms", "2", "--json",
                         str(out_json))
    assert code == 0, err
    assert "# SLO told: first token within 100 ms, every gap within 2 ms" in out
    assert any(line.startswith("fcfs: ") and "% within" in line for line in out.splitlines())
    doc = json.loads(out_json.read_text())
    assert doc["trace"]["options"]["slo_told"] is True
    assert {"slo_fraction", "slo_goodput_rps", "slo_missed_ttft"} <= set(doc["policies"]["fcfs"])
    code, out, err = lab(capsys, "--trace", trace_file, "--slo", "--policy", "fcfs")
    assert code != 0 and "--slo tells the slack rule the SLO: give --slack too" in err
    code, out, err = lab(capsys, "--suite", "--slo")
    assert code != 0 and "--slo" in err


def test_one_tenant_reads_one_everywhere_and_hit_rate_is_a_percent(tmp_path, capsys,
                                                                     trace_file):
    """Without a tenant field or --tenants the header, the JSON and the tails all say one
    tenant (`tenants=1`, `tenants: 1`, `all:N`); the table's hit rate is a percent, as in
    docs/lab.md and trace_hit_rate.png, and the JSON keeps the fraction."""
    out_json = tmp_path / "r.json"
    code, out, _ = lab(capsys, "--trace", trace_file, "--policy", "fcfs", "--slack", "--slo",
                       "--json", str(out_json))
    assert code == 0
    assert " tenants=1\n" in out.splitlines(keepends=True)[0]
    doc = json.loads(out_json.read_text())
    assert doc["trace"]["tenants"] == 1
    fraction = doc["policies"]["fcfs"]["hit_rate"]
    row = next(line for line in out.splitlines() if line.startswith("fcfs "))
    hit = [name for name, *_ in TRACE_COLUMNS].index("hit_rate")
    assert row.split()[hit] == f"{100 * fraction:.1f}%"
    tails = out.split("# tails: ")[1].splitlines()[2].split("\t")
    assert tails[-1].startswith("all:") and "None" not in out
    assert list(doc["tails"][0]["stalls_by_group"]) == ["all"]


def test_tenants_named_after_the_first_row_are_accounted(tmp_path, capsys, backend):
    """Whether a replay accounts tenant service is decided from the whole trace, not its first
    row; rows without a tenant are the tenant `(none)`. A policy given twice runs once."""
    rows = [json.loads(r) for r in ROWS]
    for i, row in enumerate(rows[1:], 1):
        row["tenant"] = "ab"[i % 2]
    path = tmp_path / "late_tenants.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out_json = tmp_path / "r.json"
    code, out, err = lab(capsys, "--trace", str(path), "--scheduler", backend, "--json",
                         str(out_json), "--policy", "fcfs", "--policy", "fcfs")
    assert code == 0, err
    doc = json.loads(out_json.read_text())
    (figures,) = doc["policies"].values()
    assert figures["tenants"] == 3 and figures["jain_index"] is not None
    assert doc["trace"]["tenants"] == 3  # the header counts "(none)" too
    assert sorted(figures["tenant_service_tokens_per_s"]) == ["(none)", "a", "b"]
    assert sum(line.startswith("fcfs ") for line in out.splitlines()) == 2  # table, tenants


def test_requests_out_holds_each_request_and_agrees_with_the_figures(tmp_path, capsys,
                                                                     trace_file):
    from skippy_scheduler.lab.driver import nearest_rank

    lines_path, out_json = tmp_path / "requests.jsonl", tmp_path / "r.json"
    code, _, err = lab(capsys, "--trace", trace_file, "--policy", "fcfs", "--policy",
                       "cache-aware", "--requests-out", str(lines_path), "--json",
                       str(out_json))
    assert code == 0, err
    rows = [json.loads(line) for line in lines_path.read_text().splitlines()]
    doc = json.loads(out_json.read_text())
    assert len(rows) == len(ROWS) * 2
    for policy, figures in doc["policies"].items():
        mine = [r for r in rows if r["policy"] == policy]
        assert [r["id"] for r in mine] == [f"r{i}" for i in range(len(ROWS))]
        assert [r["generated"] for r in mine] == [json.loads(x)["output_length"] for x in ROWS]
        ttft = [(r["first_token_us"] - r["arrival_us"]) / 1e3 for r in mine]
        assert nearest_rank(ttft, 50) == pytest.approx(figures["p50_ttft_ms"])
        assert sum(r["restored_tokens"] for r in mine) == figures["hit_tokens"]
