"""The plan wire format: round trips, zero-copy views, refusal of malformed frames, in Python
and in C (docs/wire-format.md)."""
from __future__ import annotations

import pathlib
import shutil
import struct
import subprocess

import numpy as np
import pytest

from skippy_scheduler.hosts.stages import wire

from harness_build import BASE_FLAGS, ROOT, SANITIZE


def make_plan(rng: np.random.Generator, rows: int = 4, deferred: bool = True) -> dict:
    lengths = rng.integers(1, 6, size=rows)
    if deferred:
        lengths[0] = 1
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    starts = rng.integers(0, 50, size=rows)
    positions = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, lengths)])
    new = [r for r in range(rows) if r % 2]
    restore = [-1] * rows
    if new:
        restore[new[0]] = 3
    return dict(step=int(rng.integers(0, 1 << 40)), serial=int(rng.integers(0, 1 << 40)),
                row_offsets=offsets, row_lanes=rng.permutation(8)[:rows],
                tokens=rng.integers(0, 384, size=int(offsets[-1])), positions=positions,
                sample_last=rng.integers(0, 2, size=rows), phases=rng.integers(0, 3, size=rows),
                new_rows=new, row_restore=restore,
                deferred=([0], [7], [2]) if deferred else None, release_lanes=[5, 6])


def test_round_trip_and_views_share_the_frame():
    rng = np.random.default_rng(1)
    for trial in range(50):
        p = make_plan(rng, rows=int(rng.integers(1, 9)), deferred=bool(trial % 2))
        frame = wire.encode_plan(**p)
        assert len(frame) == wire.plan_bytes(len(p["row_offsets"]) - 1, len(p["tokens"]),
                                             1 if p["deferred"] else 0, 2)
        v = wire.decode_plan(frame)
        assert (v.step, v.serial) == (p["step"], p["serial"])
        assert v.row_offsets.tolist() == list(p["row_offsets"])
        assert v.row_lanes.tolist() == list(p["row_lanes"])
        assert v.tokens.tolist() == list(p["tokens"])
        assert v.positions.tolist() == list(p["positions"])
        assert v.sample_rows.tolist() == np.flatnonzero(p["sample_last"]).tolist()
        assert v.phases.tolist() == list(p["phases"])
        assert v.new_rows.tolist() == p["new_rows"]
        assert v.row_restore.tolist() == p["row_restore"]
        assert v.release_lanes.tolist() == [5, 6]
        if p["deferred"]:
            assert (v.deferred_rows.tolist(), v.deferred_steps.tolist(),
                    v.deferred_index.tolist()) == ([0], [7], [2])
        whole = np.frombuffer(frame, dtype=np.uint8)
        for arr in (v.row_offsets, v.row_lanes, v.tokens, v.positions, v.row_flags,
                    v.release_lanes):
            assert np.shares_memory(arr, whole)
        # A view reads the frame as it is now: no copy was taken.
        frame[wire.HEADER_BYTES] = frame[wire.HEADER_BYTES]  # bytearray stays writable
        assert not v.tokens.flags.owndata


def test_a_zmq_frame_is_decoded_in_place():
    zmq = pytest.importorskip("zmq")
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        a.bind("inproc://wire-test")
        b.connect("inproc://wire-test")
        frame = wire.encode_plan(**make_plan(np.random.default_rng(2), rows=3))
        a.send(frame, copy=False)
        got = b.recv(copy=False)
        v = wire.decode_plan(got.buffer)
        assert np.shares_memory(v.tokens, np.frombuffer(got.buffer, dtype=np.uint8))
        assert bytes(got.buffer) == bytes(frame)
    finally:
        a.close(0)
        b.close(0)
        ctx.term()


def _malformed(frame: bytearray) -> dict[str, bytes]:
    """Named corruptions of a valid frame, each one a frame both decoders must refuse."""
    v = wire.decode_plan(frame)
    at = {name: arr.ctypes.data - np.frombuffer(frame, np.uint8).ctypes.data
          for name, arr in (("offsets", v.row_offsets), ("lanes", v.row_lanes),
                            ("restore", v.row_restore), ("flags", v.row_flags),
                            ("positions", v.positions), ("deferred", v.deferred_rows),
                            ("release", v.release_lanes))}
    del v

    def patch(offset: int, fmt: str, value: int, base: bytes = bytes(frame)) -> bytes:
        out = bytearray(base)
        struct.pack_into(fmt, out, offset, value)
        return bytes(out)

    n_rows = struct.unpack_from("<I", frame, 32)[0]
    cases = {
        "magic": patch(0, "<I", 0x12345678),
        "version": patch(4, "<H", 2),
        "header size": patch(6, "<H", 32),
        "total size": patch(8, "<Q", len(frame) + 8),
        "reserved": patch(48, "<I", 1),
        "rows above tokens": patch(32, "<I", 10_000),
        "count vs size": patch(44, "<I", 0),
        "first offset": patch(at["offsets"], "<I", 1),
        "empty row": patch(at["offsets"] + 4, "<I", 0),
        "negative lane": patch(at["lanes"], "<i", -3),
        "restore below -1": patch(at["restore"], "<i", -2),
        "restore not new": patch(at["restore"], "<i", 4),
        "unknown flag": patch(at["flags"], "<B", 0x40),
        "phase 3": patch(at["flags"], "<B", 0x06),
        "position gap": patch(at["positions"] + 4, "<i", 1000),
        "position at the top": patch(at["positions"] + 8, "<i", 2**31 - 1,
                                     patch(at["positions"] + 4, "<i", 2**31 - 1)),
        "negative position": patch(at["positions"], "<i", -1),
        "deferred row": patch(at["deferred"], "<I", n_rows),
        "negative release": patch(at["release"], "<i", -1),
        "trailing byte": bytes(frame) + b"\0",
    }
    for cut in (0, 1, 63, 64, len(frame) // 2, len(frame) - 8, len(frame) - 1):
        cases[f"truncated at {cut}"] = bytes(frame[:cut])
    return cases


def _frame_for_corruption() -> bytearray:
    # Row 0: 1 token (deferred), row 1: 3 tokens; row 1 is new (restore only on it).
    return wire.encode_plan(step=9, serial=4, row_offsets=[0, 1, 4], row_lanes=[2, 5],
                            tokens=[7, 8, 9, 10], positions=[12, 0, 1, 2], sample_last=[1, 1],
                            phases=[2, 0], new_rows=[1], row_restore=[-1, 3],
                            deferred=([0], [8], [1]), release_lanes=[1])


def test_python_refuses_malformed_frames_with_a_reason():
    frame = _frame_for_corruption()
    for name, bad in _malformed(frame).items():
        with pytest.raises(wire.WireError):
            wire.decode_plan(bad)
    # Every shorter prefix is refused too.
    for cut in range(len(frame)):
        with pytest.raises(wire.WireError, match="truncated|size|counts"):
            wire.decode_plan(frame[:cut])


def test_encoder_refuses_what_it_cannot_send():
    with pytest.raises(wire.WireError, match="consecutive"):
        wire.encode_plan(step=0, serial=0, row_offsets=[0, 2], row_lanes=[0], tokens=[1, 2],
                         positions=[0, 5], sample_last=[1], phases=[0])
    with pytest.raises(wire.WireError, match="entries"):
        wire.encode_plan(step=0, serial=0, row_offsets=[0, 2], row_lanes=[0, 1], tokens=[1, 2],
                         positions=[0, 1], sample_last=[1], phases=[0])


def test_activation_and_output_frames():
    rows = np.arange(12, dtype=np.float32).reshape(3, 4)
    head, data = wire.encode_activations(5, rows)
    got = wire.decode_activations(head, data.data, 5, 3, 4)
    assert np.array_equal(got, rows) and np.shares_memory(got, data)
    for args in ((6, 3, 4), (5, 2, 4), (5, 3, 5)):
        with pytest.raises(wire.WireError):
            wire.decode_activations(head, data.data, *args)
    with pytest.raises(wire.WireError, match="truncated"):
        wire.decode_activations(head, memoryview(data.tobytes())[:-4], 5, 3, 4)
    with pytest.raises(wire.WireError, match="has 4 bytes after the 48 its header states"):
        wire.decode_activations(head, data.tobytes() + b"1234", 5, 3, 4)
    out = wire.encode_outputs(11, [0, 3], [42, -1])
    step, r, t = wire.decode_outputs(out)
    assert (step, r.tolist(), t.tolist()) == (11, [0, 3], [42, -1])
    for bad in (out[:-1], out[:10], b"x" * len(out)):
        with pytest.raises(wire.WireError):
            wire.decode_outputs(bad)


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    """tests/stages/wire_harness.c linked with the decoder alone (sanitized when possible)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None or not (ROOT / "csrc" / "sk_wire.c").exists():
        pytest.skip("no C compiler or no source tree")
    exe = tmp_path_factory.mktemp("wire") / "wire_harness"
    sources = [str(pathlib.Path(__file__).with_name("wire_harness.c")),
               str(ROOT / "csrc" / "sk_wire.c")]
    for extra in (SANITIZE, []):
        build = subprocess.run([cc, *sources, *BASE_FLAGS, *extra, "-o", str(exe)],
                               capture_output=True, text=True)
        if build.returncode == 0:
            return exe
    pytest.fail(build.stderr)


def _run_c(harness, tmp_path, frames: list[bytes]) -> list[str]:
    paths = []
    for i, f in enumerate(frames):
        p = tmp_path / f"frame-{i}.bin"
        p.write_bytes(bytes(f))
        paths.append(str(p))
    out = subprocess.run([str(harness), *paths], capture_output=True, text=True, check=True)
    lines = out.stdout.splitlines()
    assert lines[-1] == "misaligned 6"
    return lines[:-1]


def test_c_decoder_matches_python(harness, tmp_path):
    rng = np.random.default_rng(3)
    frames = [wire.encode_plan(**make_plan(rng, rows=int(rng.integers(1, 7)),
                                           deferred=bool(i % 2))) for i in range(20)]
    for frame, line in zip(frames, _run_c(harness, tmp_path, frames)):
        v = wire.decode_plan(frame)
        base = np.frombuffer(frame, np.uint8).ctypes.data
        fields = dict(kv.split("=", 1) for kv in line.split()[1:])

        def ints(a: np.ndarray) -> str:
            return ",".join(str(x) for x in a.tolist())
        assert line.startswith("ok ")
        assert int(fields["step"]) == v.step and int(fields["serial"]) == v.serial
        assert int(fields["sample"]) == len(v.sample_rows)
        for key, arr in (("offsets", v.row_offsets), ("lanes", v.row_lanes),
                         ("restore", v.row_restore), ("flags", v.row_flags),
                         ("tokens", v.tokens), ("positions", v.positions),
                         ("deferred_rows", v.deferred_rows), ("deferred_steps", v.deferred_steps),
                         ("deferred_index", v.deferred_index), ("release", v.release_lanes)):
            assert fields[key] == ints(arr), key
        # The C view points where the Python view does: into the frame, at the same offsets.
        assert int(fields["at_tokens"]) == v.tokens.ctypes.data - base
        assert int(fields["at_release"]) == v.release_lanes.ctypes.data - base


def _frame_ending_in_positions() -> bytes:
    """Two one-token rows at consecutive positions, nothing after the positions; row 0's end
    offset moved past the arena (a decoder that trusted it would read past the frame)."""
    frame = wire.encode_plan(step=1, serial=1, row_offsets=[0, 1, 2], row_lanes=[0, 1],
                             tokens=[7, 8], positions=[5, 6], sample_last=[1, 1],
                             phases=[2, 2])
    v = wire.decode_plan(frame)
    at = v.row_offsets.ctypes.data - np.frombuffer(frame, np.uint8).ctypes.data
    assert v.positions.ctypes.data + 8 == np.frombuffer(frame, np.uint8).ctypes.data + len(frame)
    del v
    out = bytearray(frame)
    struct.pack_into("<I", out, at + 4, 1000)
    return bytes(out)


def test_c_decoder_refuses_malformed_frames_and_leaves_the_view(harness, tmp_path):
    cases = _malformed(_frame_for_corruption())
    cases["offset past the arena"] = _frame_ending_in_positions()
    with pytest.raises(wire.WireError):
        wire.decode_plan(cases["offset past the arena"])
    lines = _run_c(harness, tmp_path, list(cases.values()))
    for name, line in zip(cases, lines):
        assert line.startswith("refused "), (name, line)
        assert line.endswith("untouched=1"), (name, line)


def test_c_header_constants_match_python():
    text = (ROOT / "abi" / "sk_wire.h").read_text()
    assert f"SK_WIRE_PLAN_MAGIC 0x{wire.PLAN_MAGIC:08x}u" in text
    assert f"SK_WIRE_VERSION {wire.VERSION}u" in text
    assert f"SK_WIRE_HEADER_BYTES {wire.HEADER_BYTES}u" in text
