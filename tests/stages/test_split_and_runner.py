"""Splitting a model by layers, and running its stages in one process on llama.cpp: logits of
the chained stages equal the unsplit model's, bit for bit, for prefill, decode and ragged
sequences in one batch (docs/stages.md)."""
from __future__ import annotations

import os

import numpy as np
import pytest

pytest.importorskip("llama_cpp")
gguf = pytest.importorskip("gguf")

from skippy_scheduler.hosts.stages.split import (  # noqa: E402
    SplitError, check_stage_set, even_ranges, file_identity, parse_ranges, read_stage_info,
    split_model, stage_paths)
from skippy_scheduler.hosts.stages.runner import StageRunner  # noqa: E402

from stages_common import SHAPE  # noqa: E402


def test_split_writes_renumbered_stages_with_their_identity(model4, splits):
    ident = file_identity(model4)
    for p, d in splits.items():
        paths = stage_paths(d)
        infos = [read_stage_info(x) for x in paths]
        check_stage_set(infos, ident)
        assert [i.index for i in infos] == list(range(p))
        assert all(i.count == p and i.source_layers == 4 and i.source_id == ident for i in infos)
        for info in infos:
            r = gguf.GGUFReader(info.path)
            n = info.layer_end - info.layer_start
            assert int(r.fields["llama.block_count"].contents()) == n
            layers = {int(t.name.split(".")[1]) for t in r.tensors if t.name.startswith("blk.")}
            assert layers == set(range(n))
            names = {t.name for t in r.tensors}
            assert {"token_embd.weight", "output_norm.weight", "output.weight"} <= names
            vocab = len(r.fields["tokenizer.ggml.tokens"].contents())
            # Middle stages carry a tiny vocabulary; the first and last the real one.
            assert vocab == (4 if 0 < info.index < p - 1 else SHAPE.n_vocab)
    src = gguf.GGUFReader(model4)
    stage = gguf.GGUFReader(stage_paths(splits[2])[1])
    a = {t.name: np.array(t.data) for t in src.tensors}
    b = {t.name: np.array(t.data) for t in stage.tensors}
    assert np.array_equal(a["blk.3.ffn_down.weight"], b["blk.1.ffn_down.weight"])
    assert np.array_equal(a["output.weight"], b["output.weight"])


def test_split_refuses_bad_ranges_and_mixed_stages(model4, splits, tmp_path):
    assert even_ranges(4, 3) == [(0, 2), (2, 3), (3, 4)]
    assert parse_ranges("0-0,1-2,3-3", 4) == [(0, 1), (1, 3), (3, 4)]
    for bad in ("0-1,3-3", "0-4", "1-3", "0-1,2-x", "2-1,3-3"):
        with pytest.raises(SplitError):
            parse_ranges(bad, 4)
    with pytest.raises(SplitError, match="cannot split 4 layers into 5"):
        split_model(model4, tmp_path / "x", 5)
    # A model whose block_count is not its layers' count: refused before a stage is written.
    import struct

    with open(model4, "rb") as f:
        data = bytearray(f.read())
    key = b"llama.block_count"
    at = data.index(struct.pack("<Q", len(key)) + key) + 8 + len(key) + 4  # past its type
    for count, said in ((5, r"no tensors for layer\(s\) 4"),
                        (3, r"layer\(s\) 3 past the last")):
        struct.pack_into("<I", data, at, count)
        (tmp_path / f"count{count}.gguf").write_bytes(bytes(data))
        with pytest.raises(SplitError, match=rf"states {count} layers .*{said}"):
            split_model(tmp_path / f"count{count}.gguf", tmp_path / f"out{count}", 1)
        assert not (tmp_path / f"out{count}").exists()
    # A stage of another model, or stages given out of order, or a missing stage: refused.
    from skippy_scheduler.hosts.tiny_model import write_tiny_llama

    other = write_tiny_llama(tmp_path / "other.gguf", seed=6, shape=SHAPE)
    split_model(other, tmp_path / "other", 2)
    mine = [read_stage_info(p) for p in stage_paths(splits[2])]
    theirs = [read_stage_info(p) for p in stage_paths(tmp_path / "other")]
    with pytest.raises(SplitError, match="another model"):
        check_stage_set([mine[0], theirs[1]])
    with pytest.raises(SplitError, match="given as stage"):
        check_stage_set([mine[1], mine[0]])
    with pytest.raises(SplitError, match="stage 0 of 2, but 1 stage was given: give all 2"):
        check_stage_set(mine[:1])
    with pytest.raises(SplitError, match="another model"):
        check_stage_set(mine, file_identity(other))
    with pytest.raises(SplitError, match="not a stage file"):
        read_stage_info(model4)
    os.makedirs(tmp_path / "gap")
    os.link(stage_paths(splits[3])[0], tmp_path / "gap" / "stage-0.gguf")
    os.link(stage_paths(splits[3])[2], tmp_path / "gap" / "stage-2.gguf")
    with pytest.raises(SplitError, match="stage-0.gguf"):
        stage_paths(tmp_path / "gap")


class Chain:
    """The stages of a split, run one after another in this process (activations handed on)."""

    def __init__(self, directory: str) -> None:
        self.runners = [StageRunner(p, n_ctx=2048, n_seq_max=4, n_batch=256, n_threads=1)
                        for p in stage_paths(directory)]

    def run(self, lanes, offsets, positions, sample_rows, tokens):
        x = None
        for k, r in enumerate(self.runners):
            x = r.run(lanes, offsets, positions, sample_rows,
                      tokens=tokens if k == 0 else None, embd=None if k == 0 else x.copy())
        return x, self.runners[-1].last_logits.copy()

    def close(self):
        for r in self.runners:
            r.close()


class Reference:
    """The unsplit model with the stages' context settings (unified KV, one ubatch per batch):
    the same batches must give the same logits, bit for bit."""

    def __init__(self, model: str) -> None:
        import llama_cpp as ll

        from skippy_scheduler.hosts.llama import LlamaHost

        # The stage workers decode a plan's rows as they are: the reference does too (no solo
        # filler beside a one-token step, docs/hosts.md "When the tokens are the same").
        self.host = LlamaHost(model, n_ctx=2048, n_seq_max=4, n_batch=256, n_threads=1,
                              kv_unified=True, solo_fill=False)
        self.ll = ll

    def run(self, rows):
        """rows: (lane key, tokens, start, sample); returns logits of the sampled rows."""
        self.host.run_rows(rows)
        ctx = self.host._ctx
        k = sum(1 for r in rows if r[3])
        return np.ctypeslib.as_array(self.ll.llama_get_logits(ctx), shape=(k, SHAPE.n_vocab)).copy()


def _flat(rows):
    lanes = np.array([r[0] for r in rows], dtype=np.int32)
    lengths = [len(r[1]) for r in rows]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    positions = np.concatenate([np.arange(r[2], r[2] + len(r[1])) for r in rows]).astype(np.int32)
    tokens = np.concatenate([np.asarray(r[1], dtype=np.int32) for r in rows])
    sample = np.array([i for i, r in enumerate(rows) if r[3]], dtype=np.int64)
    return lanes, offsets, positions, sample, tokens


@pytest.mark.parametrize("p", [2, 3])
def test_stage_chain_logits_are_bit_identical_to_the_unsplit_model(model4, splits, p):
    rng = np.random.default_rng(p)
    chain, ref = Chain(splits[p]), Reference(model4)
    try:
        # Prefill of two ragged sequences in one batch, then joint decode steps, then a third
        # sequence joining while the others decode (a mixed batch), then a replay after a rewind.
        a = [1] + rng.integers(3, 384, 17).tolist()
        b = [1] + rng.integers(3, 384, 6).tolist()
        c = [1] + rng.integers(3, 384, 40).tolist()
        steps = [[(0, a, 0, True), (1, b, 0, True)]]
        pos = {0: len(a), 1: len(b)}
        for i in range(3):
            steps.append([(0, [int(rng.integers(3, 384))], pos[0] + i, True),
                          (1, [int(rng.integers(3, 384))], pos[1] + i, True)])
        steps.append([(2, c[:25], 0, False), (0, [5], pos[0] + 3, True)])
        steps.append([(2, c[25:], 25, True), (1, [7], pos[1] + 3, True)])
        steps.append([(0, [9], pos[0] + 2, True)])  # rewind: replays position pos+2
        for rows in steps:
            tokens, logits = chain.run(*_flat(rows))
            expect = ref.run([(f"lane{r[0]}", r[1], r[2], r[3]) for r in rows])
            assert np.array_equal(logits, expect), (p, rows)
            greedy = [-1 if ref.host.is_eog(t) else t for t in expect.argmax(1).tolist()]
            assert tokens.tolist() == greedy
        # Every stage holds what the unsplit model holds for each lane.
        for r in chain.runners:
            assert r.held(0) == pos[0] + 3 and r.held(1) == pos[1] + 4 and r.held(2) == len(c)
    finally:
        chain.close()
        ref.host.close()


def test_runner_refuses_bad_rows_without_changing_anything(splits):
    r0 = StageRunner(stage_paths(splits[2])[0], n_ctx=1024, n_seq_max=2, n_batch=64, n_threads=1)
    try:
        lanes, offsets, positions, sample, tokens = _flat([(0, [1, 5, 6], 0, True)])
        r0.run(lanes, offsets, positions, sample, tokens=tokens)
        for bad in ([(0, [1], 5, True)], [(2, [1], 0, True)], [(1, [1], 0, True),
                                                               (1, [2], 1, True)]):
            with pytest.raises(ValueError):
                r0.run(*_flat(bad)[:4], tokens=_flat(bad)[4])
        with pytest.raises(ValueError, match="tokens must be in"):
            r0.run(lanes[:1], np.array([0, 1]), np.array([3], np.int32), sample,
                   tokens=np.array([999], np.int32))
        assert r0.held(0) == 3 and r0.held(1) == 0
        r1 = StageRunner(stage_paths(splits[2])[1], n_ctx=1024, n_seq_max=2, n_batch=64,
                         n_threads=1)
        with pytest.raises(ValueError, match="activations"):
            r1.run(lanes, offsets, positions, sample, embd=np.zeros((3, 5), np.float32))
        assert r1.held(0) == 0
        r1.close()
    finally:
        r0.close()


def test_a_prefix_kept_in_a_holder_restores_exactly_on_every_stage(model4, splits):
    """Lane 0 prefills a prompt; its cells are shared into holder 3 and the lane is freed; lane 1
    then starts from the holder's first 20 positions and prefills only the rest: its logits are
    those of the full prompt prefilled from scratch."""
    from skippy_scheduler.hosts.stages.runner import OP_COPY, OP_REMOVE

    rng = np.random.default_rng(9)
    prompt = [1] + rng.integers(3, 384, 29).tolist()
    chain = Chain(splits[3])
    fresh = Chain(splits[3])
    try:
        chain.run(*_flat([(0, prompt, 0, True)]))
        for r in chain.runners:
            r.apply_ops([[OP_COPY, 0, 3, 0, 20], [OP_REMOVE, 0, -1, -1, 0]])
            assert r.held(3) == 20 and r.held(0) == 0
            r.apply_ops([[OP_REMOVE, 1, -1, -1, 0], [OP_COPY, 3, 1, 0, 20]])
            assert r.held(1) == 20
        _, restored = chain.run(*_flat([(1, prompt[20:], 20, True)]))
        _, full = fresh.run(*_flat([(1, prompt, 0, True)]))
        assert np.array_equal(restored, full)
        with pytest.raises(ValueError, match="outside"):
            chain.runners[0].apply_ops([[OP_COPY, 3, 9, 0, 5]])
        with pytest.raises(ValueError, match="unknown"):
            chain.runners[0].apply_ops([[7, 0, 0, 0, 0]])
        assert chain.runners[0].held(3) == 20
    finally:
        chain.close()
        fresh.close()


def test_a_stage_worker_that_refuses_its_file_says_why_through_run(model4, splits, tmp_path,
                                                                   capsys):
    """A whole model where stage 0 should be: its local worker exits at configuration, and the
    command's one line carries the worker's own reason, not only its exit status."""
    import shutil

    from skippy_scheduler.cli import main

    shutil.copy(model4, tmp_path / "stage-0.gguf")
    shutil.copy(os.path.join(splits[2], "stage-1.gguf"), tmp_path / "stage-1.gguf")
    assert main(["run", "--stages", str(tmp_path), "-n", "2"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "exited with status 2 while configuring (each stage loads its layers): " in err, err
    assert "is not a stage file (no skippy.stage.index)" in err, err


def test_local_workers_share_the_cores_this_process_may_run_on(splits, monkeypatch):
    """The default compute threads divide the CPU affinity (a container's or taskset's limit),
    not the machine's core count, among the local stages."""
    from skippy_scheduler.hosts.stages import local

    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    for cores, want in (({0}, 1), ({0, 1, 2, 3}, 2)):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid, cores=cores: cores,
                            raising=False)
        assert local.usable_cores() == len(cores)
        with local.LocalStages(splits[2]) as stages:
            assert stages.n_threads == want
