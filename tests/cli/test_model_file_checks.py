"""A model file that is not a whole model is one `error:` line with exit status 2, never a
traceback: a truncated or damaged GGUF in `export-hf-tokenizer` (the check `run` and `split`
make), a stage file (`split` output) where a whole model is expected, and a directory of stages
holding a stage file left from an earlier split."""
from __future__ import annotations

import os
import struct

import pytest

pytest.importorskip("gguf")

from skippy_scheduler.cli import main  # noqa: E402
from skippy_scheduler.hosts.offload import ModelFileError, footprint_from_gguf  # noqa: E402
from skippy_scheduler.hosts.tiny_model import TinyModelShape, write_tiny_llama  # noqa: E402

NUMPY_WORDS = ("axis", "reshape", "dtype", "unpack", "index 0")


@pytest.fixture(scope="module")
def tiny4(tmp_path_factory):
    """A 4-layer tiny model: splits into 2 and into 3 stages."""
    return str(write_tiny_llama(tmp_path_factory.mktemp("tiny4") / "tiny4.gguf", seed=3,
                                shape=TinyModelShape(n_layer=4)))


@pytest.fixture(scope="module")
def split2(tiny4, tmp_path_factory):
    from skippy_scheduler.hosts.stages.split import split_model

    out = tmp_path_factory.mktemp("sp2")
    split_model(tiny4, out, 2)
    return str(out)


@pytest.fixture(scope="module")
def damaged(tiny4, tmp_path_factory):
    """Damaged copies of the model: cut in its header, cut in its tensor data, version 99."""
    import pathlib

    import gguf

    data = pathlib.Path(tiny4).read_bytes()
    header_end = gguf.GGUFReader(tiny4).data_offset
    d = tmp_path_factory.mktemp("damaged")
    files = {"header": data[: header_end // 2], "data": data[: (header_end + len(data)) // 2],
             "version": data[:4] + struct.pack("<I", 99) + data[8:]}
    for name, content in files.items():
        (d / f"{name}.gguf").write_bytes(content)
    return {name: str(d / f"{name}.gguf") for name in files}


def _error(capsys, argv: list[str]) -> str:
    """Run `main(argv)`: exit status 2, nothing on stdout, the usage and one `error:` line."""
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 2, err
    assert out == ""
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 2 and lines[0].startswith("usage: "), err
    assert lines[1].startswith(f"skippy-scheduler {argv[0]}: error: "), err
    return lines[1]


# -- truncated, damaged ---------------------------------------------------------------------


@pytest.mark.parametrize("kind, words", [
    ("header", "its header runs past the end of the file"),
    ("data", "its tensor data runs past the end of the file"),
    ("version", "GGUF version 99, which the gguf package cannot read"),
])
def test_a_damaged_model_is_one_readable_line(damaged, kind, words):
    with pytest.raises(ModelFileError) as caught:
        footprint_from_gguf(damaged[kind])
    text = str(caught.value)
    assert "is not a whole GGUF model" in text and words in text
    assert not any(w in text for w in NUMPY_WORDS), text  # numpy's internals stay out


@pytest.mark.parametrize("kind", ["header", "data", "version"])
def test_export_hf_tokenizer_refuses_a_damaged_model(capsys, damaged, tmp_path, kind):
    pytest.importorskip("llama_cpp")
    pytest.importorskip("tokenizers")
    line = _error(capsys, ["export-hf-tokenizer", damaged[kind], str(tmp_path / "hf")])
    assert f"error: GGUF: {damaged[kind]} is not a whole GGUF model" in line
    assert not any(w in line for w in NUMPY_WORDS), line
    assert not (tmp_path / "hf").exists()  # refused before anything is written


# -- a stage file where a whole model is expected -------------------------------------------


def test_a_stage_file_is_refused_as_a_whole_model_but_not_as_a_stage(split2):
    stage0 = os.path.join(split2, "stage-0.gguf")
    with pytest.raises(ModelFileError, match="is stage 0 of 2 of a split model"):
        footprint_from_gguf(stage0, allow_stage=False)
    # The stage worker (and `stage`'s up-front check) still read stage files.
    assert footprint_from_gguf(stage0).n_layer == 2
    from skippy_scheduler.cli._common import check_model_file

    check_model_file("--model", stage0)


def test_split_refuses_a_stage_file(capsys, split2, tmp_path):
    stage0 = os.path.join(split2, "stage-0.gguf")
    line = _error(capsys, ["split", "-m", stage0, "--stages", "2", "--out",
                           str(tmp_path / "sp3")])
    assert (f"--model: {stage0} is stage 0 of 2 of a split model (skippy-scheduler split), "
            f"not a whole model: run or serve its directory with --stages {split2}") in line
    assert not (tmp_path / "sp3").exists()


def test_export_hf_tokenizer_refuses_a_stage_file(capsys, split2, tmp_path):
    pytest.importorskip("llama_cpp")
    pytest.importorskip("tokenizers")
    stage1 = os.path.join(split2, "stage-1.gguf")
    line = _error(capsys, ["export-hf-tokenizer", stage1, str(tmp_path / "hf")])
    assert f"GGUF: {stage1} is stage 1 of 2 of a split model" in line


def test_run_serve_and_calibrate_placement_refuses_a_stage_file(split2):
    # run, serve, calibrate and dynamo-worker place their model with fit.resolve.
    pytest.importorskip("llama_cpp")
    from skippy_scheduler.hosts.llama.fit import resolve
    from skippy_scheduler.hosts.offload import OffloadSpec

    with pytest.raises(ModelFileError, match="is stage 0 of 2 of a split model"):
        resolve(os.path.join(split2, "stage-0.gguf"), OffloadSpec(n_gpu_layers=0), n_ctx=256,
                lanes=1, devices=[])


@pytest.mark.parametrize("command", ["run", "serve"])
def test_a_stage_file_as_the_model_of_stages_is_refused_as_such(capsys, split2, command):
    """With --stage-addresses (or --stages), --model names the model the stages were cut
    from: a stage file there is refused as a stage file before any worker is asked."""
    pytest.importorskip("zmq")
    stage0 = os.path.join(split2, "stage-0.gguf")
    line = _error(capsys, [command, "-m", stage0, "--stage-addresses",
                           "tcp://127.0.0.1:9,tcp://127.0.0.1:10"])
    assert f"--model: {stage0} is stage 0 of 2 of a split model" in line


# -- stage files left from an earlier split -------------------------------------------------


def test_split_removes_stage_files_left_from_a_split_into_more(capsys, tiny4, tmp_path):
    from skippy_scheduler.hosts.stages.split import stage_paths

    out = tmp_path / "sp"
    assert main(["split", "-m", tiny4, "--stages", "3", "--out", str(out)]) == 0
    capsys.readouterr()
    assert main(["split", "-m", tiny4, "--layers", "0-1,2-3", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "removed" in err and "stage-2.gguf, left from an earlier split" in err
    assert sorted(os.listdir(out)) == ["stage-0.gguf", "stage-1.gguf"]
    assert len(stage_paths(out)) == 2


def _with_leftover(tiny4, split2, tmp_path):
    """`tmp_path/mixed`: stages 0 and 1 of a split into 2, and stage 2 of a split into 3 (what
    a split into fewer stages would leave behind); `tmp_path/sp3` holds that split into 3."""
    from skippy_scheduler.hosts.stages.split import split_model

    split_model(tiny4, tmp_path / "sp3", 3)
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    for k in (0, 1):
        os.link(os.path.join(split2, f"stage-{k}.gguf"), mixed / f"stage-{k}.gguf")
    os.link(tmp_path / "sp3" / "stage-2.gguf", mixed / "stage-2.gguf")
    return mixed


def test_a_stage_file_left_from_an_earlier_split_is_named(capsys, tiny4, split2, tmp_path):
    from skippy_scheduler.hosts.stages.split import SplitError, stage_paths

    mixed = _with_leftover(tiny4, split2, tmp_path)
    with pytest.raises(SplitError, match=r"stage-2\.gguf is left from an earlier split into 3 "
                                         r"stages; remove it"):
        stage_paths(mixed)
    # Stages of two splits into the same count: the odd one is named.
    os.remove(mixed / "stage-2.gguf")
    os.remove(mixed / "stage-1.gguf")
    os.link(tmp_path / "sp3" / "stage-1.gguf", mixed / "stage-1.gguf")
    with pytest.raises(SplitError, match=r"stage-1\.gguf is stage 1 of 3, but stage-0\.gguf is "
                                         r"stage 0 of 2"):
        stage_paths(mixed)


def test_run_with_a_leftover_stage_names_it(capsys, tiny4, split2, tmp_path):
    pytest.importorskip("llama_cpp")
    pytest.importorskip("zmq")
    mixed = _with_leftover(tiny4, split2, tmp_path)
    line = _error(capsys, ["run", "--stages", str(mixed)])
    assert "stage-2.gguf is left from an earlier split into 3 stages" in line


@pytest.mark.parametrize("command", ["run", "serve"])
@pytest.mark.parametrize("flag", [["-bs", "on"], ["--backend-sampling", "off"],
                                  ["--stage-ahead", "on"]])
def test_the_llama_host_s_own_flags_are_refused_with_stages(capsys, tiny4, split2, flag,
                                                           command):
    """--backend-sampling and --stage-ahead do nothing on stage workers: refused by name
    before a worker starts, not silently ignored."""
    pytest.importorskip("zmq")
    line = _error(capsys, [command, "-m", tiny4, "--stages", split2, *flag])
    assert "--backend-sampling and --stage-ahead are the llama.cpp host's" in line
