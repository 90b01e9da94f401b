"""skippy_bench, the scripts' library, on its own: figures, tables and a load's options."""
from __future__ import annotations

import json
import math

import pytest
from skippy_bench.loads import LOAD_DEFAULTS, Result, errors, load_args
from skippy_bench.reports import emit, markdown_table, median, percentile


def test_percentiles_are_nearest_rank():
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert [percentile(values, p) for p in (0, 20, 50, 99, 100)] == [1.0, 1.0, 3.0, 5.0, 5.0]
    assert math.isnan(percentile([], 50))


def test_medians_skip_results_without_the_figure():
    rows = [{"x": 1.0}, {"x": None}, {"x": 3.0}, {}]
    assert median(rows, "x") == 2.0
    assert math.isnan(median(rows, "y"))


def test_results_are_printed_and_appended_as_json_lines(tmp_path, capsys):
    path = tmp_path / "out.jsonl"
    emit({"a": 1}, str(path))
    emit({"b": 2}, str(path))
    emit({"c": 3}, None)
    assert capsys.readouterr().out.splitlines() == ['{"a": 1}', '{"b": 2}', '{"c": 3}']
    assert [json.loads(line) for line in path.read_text().splitlines()] == [{"a": 1}, {"b": 2}]


def test_markdown_tables_align_by_column():
    assert markdown_table(["k", "v"], "lr", [["a", 1], ["b", 2.5]]) == [
        "| k | v |", "|---|---:|", "| a | 1 |", "| b | 2.5 |"]


def test_load_options_default_to_serve_load_s_and_refuse_unknown_ones():
    args = load_args("http://127.0.0.1:1", "x", concurrency=2)
    assert (args.url, args.label, args.concurrency) == ("http://127.0.0.1:1", "x", 2)
    assert args.requests == LOAD_DEFAULTS["requests"] and args.extra == {}
    assert args.extra is not load_args("u").extra  # each load its own
    with pytest.raises(TypeError, match="concurency"):
        load_args("u", concurency=2)


def test_errors_name_the_first_five_distinct_failures():
    failed = [Result(status=500, error=f"e{i % 6}") for i in range(12)]
    assert errors([Result(ok=True), None, *failed]) == [f"500 e{i}" for i in range(5)]
