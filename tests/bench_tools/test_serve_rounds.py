"""bench/serve_rounds.py, smoked tiny: this server gets no tuning flag, greedy outputs are
compared request for request (serve_load keeps each request's text in prompt order), and the
rounds' medians come out per load; on the real tiny model and real server processes."""
from __future__ import annotations

import argparse
import asyncio
import json
import pytest

import serve_rounds
from skippy_bench import loads
from lab_support import mooncake_file

from skippy_scheduler.hosts.tiny_model import write_tiny_llama

TUNING = ("--prefix-cache-tokens", "--prefix-holders", "--planning-rule", "--itl-target-ms",
          "--inflight", "--mixed", "--no-mixed", "--prefill-chunk", "-b",
          "--max-num-batched-tokens", "--max-consecutive-prefill", "--policy")


def contains(cmd, flags):
    return any(cmd[i:i + len(flags)] == flags for i in range(len(cmd)))


def test_this_server_runs_with_no_tuning_flag():
    args = argparse.Namespace(model="m.gguf", threads=2, lanes=16, ctx_size=16384)
    cmd = serve_rounds.ours_cmd(args)
    assert not set(cmd) & set(TUNING)
    args.ours_args = "--itl-target-ms 120 --served-model-name 'a b'"
    assert serve_rounds.ours_cmd(args)[-4:] == ["--itl-target-ms", "120", "--served-model-name",
                                                "a b"]
    theirs = serve_rounds.theirs_cmd(args, "llama-server")
    for flags in (["-np", "16"], ["-c", "16384"], ["-t", "2"], ["-ctk", "f32"], ["-no-kvu"]):
        assert contains(theirs, flags)


def test_both_servers_get_the_same_kernels():
    args = argparse.Namespace(model="m.gguf", threads=2, lanes=16, ctx_size=16384)
    ours, theirs = serve_rounds.ours_cmd(args), serve_rounds.theirs_cmd(args, "llama-server")
    assert contains(ours, ["--flash-attn", "off", "--kv-type", "f32"])
    assert contains(theirs, ["-fa", "off", "-ctk", "f32", "-ctv", "f32"])
    args.flash_attn, args.kv_type = "on", "f16"
    ours, theirs = serve_rounds.ours_cmd(args), serve_rounds.theirs_cmd(args, "llama-server")
    assert contains(ours, ["--flash-attn", "on", "--kv-type", "f16"])
    assert contains(theirs, ["-fa", "on", "-ctk", "f16", "-ctv", "f16"])
    assert not contains(theirs, ["-fa", "off"]) and not contains(ours, ["--kv-type", "f32"])


def test_outputs_are_compared_request_for_request():
    same = {serve_rounds.OURS: {"outputs": ["a", "b"]}, serve_rounds.THEIRS: {"outputs": ["a", "b"]}}
    assert serve_rounds.check_equal("closed c=1", 1, same) is None
    differ = {serve_rounds.OURS: {"outputs": ["a", "b", None]},
              serve_rounds.THEIRS: {"outputs": ["a", "c", "d"]}}
    assert "2 of 3 requests (first: [1, 2])" in serve_rounds.check_equal("closed c=1", 1, differ)


def test_closed_loop_keeps_each_request_text_in_prompt_order(server):
    def load(c):
        args = loads.load_args(server.url, "tiny", concurrency=c, requests=5, prompt_tokens=24,
                               shared_prefix=16, max_tokens=6, seed=1, timeout=60,
                               warmup=False, outputs=True)
        return asyncio.run(loads.run_load(args))

    one, three = load(1), load(3)
    assert one["completed"] == 5 and len(one["outputs"]) == 5
    assert all(isinstance(text, str) for text in one["outputs"])
    assert one["outputs"] == three["outputs"]  # greedy: the same text whatever the batching
    assert len(set(one["outputs"])) > 1  # and not one text for every prompt


def test_rounds_give_medians_per_load(tmp_path, capsys):
    model = write_tiny_llama(tmp_path / "tiny.gguf", seed=5)
    out = tmp_path / "rounds.jsonl"
    assert serve_rounds.main([
        "--model", str(model), "--servers", "ours", "--rounds", "2", "--requests", "3",
        "--concurrency", "1,2", "--prompt-tokens", "24", "--shared-prefix", "16",
        "--max-tokens", "4", "--lanes", "2", "--ctx-size", "1024", "--threads", "1",
        "--json", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    runs = [r for r in rows if r["label"] == serve_rounds.OURS]
    assert sorted((r["load"], r["round"]) for r in runs) == [
        ("closed c=1", 1), ("closed c=1", 2), ("closed c=2", 1), ("closed c=2", 2)]
    assert all(r["completed"] == 3 and "outputs" not in r for r in runs)
    medians = {r["load"]: r for r in rows if r["label"] == "medians"}
    assert set(medians) == {"closed c=1", "closed c=2"}
    for load, row in medians.items():
        values = sorted(r["output_tokens_per_s"] for r in runs if r["load"] == load)
        assert row["rounds"] == 2
        assert row["output_tokens_per_s"][serve_rounds.OURS] == sum(values) / 2
        assert row["output_tokens_per_s"]["ratio"] is None
    assert "| tok/s |" in capsys.readouterr().out


def test_trace_rounds_report_a_second_ttft_bound_from_the_same_replay(tmp_path):
    model = write_tiny_llama(tmp_path / "tiny.gguf", seed=5)
    trace = mooncake_file(tmp_path, [(t, [t, (t + 1, 128)], 24) for t in (0, 0, 50)])
    out = tmp_path / "rounds.jsonl"
    # A TTFT bound nobody meets, and a second one everybody does (gaps bounded generously).
    assert serve_rounds.main([
        "--model", str(model), "--servers", "ours", "--rounds", "1", "--only-trace",
        "--trace", trace, "--max-requests", "3", "--ttft-slo-s", "1e-9",
        "--also-ttft-slo-s", "600", "--itl-slo-s", "600", "--lanes", "2", "--ctx-size", "1024",
        "--threads", "1", "--json", str(out), "--requests-out", str(tmp_path / "req")]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    run = next(r for r in rows if r["label"] == serve_rounds.OURS)
    assert run["completed"] == 3
    reqs = (tmp_path / "req" / f"{serve_rounds.OURS}-r1-trace.jsonl").read_text().splitlines()
    assert len(reqs) == 3
    assert (run["slo_attainment_pct"], run["slo_also_pct"], run["also_ttft_slo_s"]) == (
        0.0, 100.0, 600)
    medians = next(r for r in rows if r["label"] == "medians")
    assert medians["slo_also_pct"][serve_rounds.OURS] == 100.0


def test_this_server_is_told_the_slo_and_llama_server_is_not():
    args = argparse.Namespace(model="m.gguf", threads=2, lanes=16, ctx_size=16384,
                              slo_ttft_ms=3000.0, slo_itl_ms=500.0)
    cmd = serve_rounds.ours_cmd(args)
    assert cmd[-4:] == ["--slo-ttft-ms", "3000", "--slo-itl-ms", "500"]
    assert not set(cmd) & set(TUNING)
    assert not any("slo" in a for a in serve_rounds.theirs_cmd(args, "llama-server"))
    args.slo_itl_ms = None
    assert serve_rounds.ours_cmd(args)[-2:] == ["--slo-ttft-ms", "3000"]


def test_trace_rounds_tell_the_slo_and_count_misses_by_reason(tmp_path, capsys):
    model = write_tiny_llama(tmp_path / "tiny.gguf", seed=5)
    trace = mooncake_file(tmp_path, [(t, [t, (t + 1, 128)], 24) for t in (0, 0, 50)])
    out = tmp_path / "rounds.jsonl"
    assert serve_rounds.main([
        "--model", str(model), "--servers", "ours", "--rounds", "1", "--only-trace",
        "--trace", trace, "--max-requests", "3", "--slo-ttft-ms", "600000",
        "--slo-itl-ms", "600000", "--lanes", "2", "--ctx-size", "1024", "--threads", "1",
        "--json", str(out)]) == 0
    assert "--slo-ttft-ms 600000 --slo-itl-ms 600000" in capsys.readouterr().err
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    run = next(r for r in rows if r["label"] == serve_rounds.OURS)
    assert (run["ttft_slo_s"], run["itl_slo_s"]) == (600, 600)
    assert run["slo_attainment_pct"] == 100.0
    assert [run[f"slo_missed_{why}"] for why in ("ttft", "gaps", "both", "unserved")] == [0] * 4
    medians = next(r for r in rows if r["label"] == "medians")
    assert medians["slo_missed_ttft"][serve_rounds.OURS] == 0
    with pytest.raises(SystemExit) as exc:
        serve_rounds.main(["--model", "x.gguf", "--slo-ttft-ms", "3000"])
    assert exc.value.code == 2


def test_a_bad_second_ttft_bound_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        serve_rounds.main(["--model", "x.gguf", "--trace", "t.jsonl", "--also-ttft-slo-s", "0"])
    assert exc.value.code == 2
    assert "--also-ttft-slo-s" in capsys.readouterr().err


def test_no_byte_tokens_biases_the_models_byte_tokens_in_the_replay(tmp_path):
    model = write_tiny_llama(tmp_path / "tiny.gguf", seed=5)
    ids = serve_rounds.byte_token_ids(str(model))
    assert ids == list(range(3, 259))  # <0x00>..<0xFF> of the tiny SPM vocabulary
    args = argparse.Namespace(trace="t.jsonl", start_s=0.0, max_requests=3, time_scale=1.0,
                              ttft_slo_s=2.0, itl_slo_s=0.2, byte_bias={str(t): -100 for t in ids})
    targs = serve_rounds.trace_args(args, "http://127.0.0.1:9", "ours")
    assert targs.extra == {"logit_bias": {str(t): -100 for t in ids}}
    args.byte_bias = None
    assert serve_rounds.trace_args(args, "http://127.0.0.1:9", "ours").extra == {}


def test_slo_grid_tells_this_server_each_slo_in_turn(tmp_path, capsys):
    """--slo-grid: one run of this server per SLO, each told its SLO and scored under it; the
    medians come out per SLO, and a grid is refused without a trace or beside --slo-ttft-ms."""
    model = write_tiny_llama(tmp_path / "tiny.gguf", seed=5)
    trace = mooncake_file(tmp_path, [(t, [t, (t + 1, 128)], 24) for t in (0, 0, 50)])
    out = tmp_path / "grid.jsonl"
    assert serve_rounds.main([
        "--model", str(model), "--servers", "ours", "--rounds", "1", "--trace", trace,
        "--max-requests", "3", "--slo-grid", "600000x600000,700000x500000", "--lanes", "2",
        "--ctx-size", "1024", "--threads", "1", "--json", str(out),
        "--requests-out", str(tmp_path / "req")]) == 0
    assert "SLO grid (medians of 1 rounds)" in capsys.readouterr().out
    # One file of request rows per replay, named by server, round and SLO.
    names = sorted(p.name for p in (tmp_path / "req").iterdir())
    assert names == [f"{serve_rounds.OURS}-r1-trace-600000x600000.jsonl",
                     f"{serve_rounds.OURS}-r1-trace-700000x500000.jsonl"]
    for name in names:
        reqs = [json.loads(line) for line in (tmp_path / "req" / name).read_text().splitlines()]
        assert len(reqs) == 3
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    runs = [r for r in rows if r["label"] == serve_rounds.OURS]
    assert [(r["slo"], r["ttft_slo_s"], r["itl_slo_s"]) for r in runs] == [
        ("600000/600000", 600, 600), ("700000/500000", 700, 500)]
    assert all(r["slo_attainment_pct"] == 100.0 for r in runs)
    medians = [r for r in rows if r["label"] == "medians"]
    assert [m["slo"] for m in medians] == ["600000/600000", "700000/500000"]
    for bad in (["--slo-grid", "3000x500"], ["--trace", trace, "--slo-grid", "3000"],
                ["--trace", trace, "--slo-grid", "3000x500", "--slo-ttft-ms", "3000"]):
        with pytest.raises(SystemExit) as exc:
            serve_rounds.main(["--model", "x.gguf", *bad])
        assert exc.value.code == 2
