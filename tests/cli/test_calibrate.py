"""`calibrate --json` is what `lab --cost-model` reads; calibrate sizes its context for its
shapes (on the tiny llama.cpp model written on the fly)."""
from __future__ import annotations

import argparse
import json

import pytest

from skippy_scheduler.cli import main

pytest.importorskip("llama_cpp")
pytest.importorskip("gguf")


def test_calibrate_json_round_trips_into_the_lab(tmp_path, capsys):
    fit = tmp_path / "fit.json"
    # Few repeats: the fit may be called untrustworthy (status 1); it is printed and saved.
    status = main(["calibrate", "--repeats", "2", "--warmup", "0", "--json", str(fit)])
    out, _ = capsys.readouterr()
    assert status in (0, 1)
    printed = out.strip()
    lab_json = tmp_path / "lab.json"
    assert main(["lab", "--cost-model", str(fit), "--scenario", "cold-burst-n1",
                 "--bench-reps", "0", "--json", str(lab_json)]) == 0
    err = capsys.readouterr().err
    assert ("calibration reported problems" in err) == (status == 1)
    # The lab runs on exactly the model calibrate printed, as if it was typed.
    typed = tmp_path / "typed.json"
    assert main(["lab", "--cost-model", printed, "--scenario", "cold-burst-n1",
                 "--bench-reps", "0", "--json", str(typed)]) == 0
    capsys.readouterr()
    from skippy_scheduler.lab.model import LAB_COST, StepCost

    from_file = json.loads(lab_json.read_text())["cost_model"]
    assert from_file == json.loads(typed.read_text())["cost_model"]
    assert from_file == StepCost.parse(printed).lab_dict()
    assert from_file != LAB_COST.lab_dict()  # not the lab's default model


def test_many_repeats_get_a_context_that_holds_them(tmp_path):
    from skippy_scheduler.cli import calibrate as cli
    from skippy_scheduler.hosts.calibrate import calibrate_host, positions_needed
    from skippy_scheduler.hosts.llama import LlamaHost
    from skippy_scheduler.hosts.tiny_model import write_tiny_llama

    args = argparse.Namespace(repeats=500, warmup=3, ctx_size=None)
    lane = cli._lane_cells(args)
    # 500 repeats over two passes: the decoders reach 37 + 3 + 250 positions.
    assert positions_needed([(0, 1)], 500, 3) == 290 and lane == 512
    args.repeats = 2000
    assert cli._lane_cells(args) == 1280  # 37 + 3 + 1000 -> rounded up to 256
    model = write_tiny_llama(str(tmp_path / "tiny.gguf"), seed=0)
    with LlamaHost(model, n_ctx=2 * 256, n_seq_max=2, n_threads=1, n_batch=64) as small:
        with pytest.raises(ValueError, match="would reach position 537"):
            calibrate_host(small, repeats=1000, warmup=0, shapes=[(0, 1)])
    with LlamaHost(model, n_ctx=2 * 768, n_seq_max=2, n_threads=1, n_batch=64) as host:
        result = calibrate_host(host, repeats=1000, warmup=0, shapes=[(0, 1), (0, 2)])
    assert [len(t.durations_us) for t in result.timings] == [1000, 1000]


@pytest.mark.parametrize("repeats", [2, 1])
def test_each_shape_is_printed_as_it_is_timed(tmp_path, capsys, monkeypatch, repeats):
    from skippy_scheduler.hosts import calibrate as calibration

    real_fit = calibration.fit_cost_model
    before_fit = []

    def fit(samples):  # every shape is timed by now, and nothing is fitted yet
        before_fit.append(capsys.readouterr().err)
        return real_fit(samples)

    monkeypatch.setattr(calibration, "fit_cost_model", fit)
    fit_json = tmp_path / "fit.json"
    status = main(["calibrate", "--repeats", str(repeats), "--warmup", "0", "--json",
                   str(fit_json)])
    after = capsys.readouterr().err
    assert status in (0, 1) and len(before_fit) == 1
    lines = before_fit[0].splitlines()
    shapes = json.loads(fit_json.read_text())["shapes"]
    finals = [f"# prefill_tokens={s['prefill_tokens']} decode_rows={s['decode_rows']} "
              f"fastest_us={s['fastest_us']:.1f} median_us={s['median_us']:.1f}" for s in shapes]
    assert [l for l in lines if l.startswith("# prefill_tokens=")] == finals
    passes = [l for l in lines if l.startswith("# pass ")]
    if repeats == 1:  # one pass times each shape: its line is final at once
        assert passes == []
    else:  # the first pass's line of every shape comes before any final line
        first = f"# pass 1 of 2: prefill_tokens={shapes[0]['prefill_tokens']} decode_rows=" \
                f"{shapes[0]['decode_rows']} fastest_us="
        assert lines.index(next(l for l in lines if l.startswith(first))) < \
            lines.index(finals[0])
        assert len(passes) >= len(shapes)
    assert "prefill_tokens=" not in after and "# fit: rms residual" in after
