"""Split a GGUF model by layer range into one model file per stage (docs/stages.md).

A stage file is an ordinary GGUF that stock llama.cpp loads: it holds the blocks of its layer
range renumbered from 0, `{arch}.block_count` set to their number, and every non-block tensor
(token embedding, output norm, head), because llama.cpp's loader demands them. A middle stage
never sees a token id nor computes logits, so it carries a four-token vocabulary and
four-row embedding and head matrices instead of vocabulary-sized ones. The first stage keeps the
full vocabulary: its token embedding is read, and the loader checks the head against the token
list. Every stage records `skippy.stage.*` keys: its index, the stage count, its layer range in
the source model, the source's layer count and identity (the SHA-256 of the source file), so
that a driver can refuse stages cut from different models or left incomplete.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import Any, Iterable, Sequence as _Seq

import numpy as np

KEY_PREFIX = "skippy.stage."
# Architectures whose layers behave the same whatever their index: renumbering is all a split
# needs (others keep per-layer patterns in metadata; see docs/stages.md).
SUPPORTED_ARCHITECTURES = frozenset({"llama"})
# A middle stage's vocabulary: SPM specials and the newline byte, enough for the loader.
_TINY_TOKENS = ("<unk>", "<s>", "</s>", "<0x0A>")
_TINY_TYPES = (2, 3, 3, 6)  # UNKNOWN, CONTROL, CONTROL, BYTE


class SplitError(ValueError):
    """A model that cannot be split as asked (bad ranges, unsupported architecture)."""


@dataclass(frozen=True)
class StageInfo:
    """What a stage file says about itself (its `skippy.stage.*` keys)."""

    path: str
    index: int
    count: int
    layer_start: int  # first source layer held (inclusive)
    layer_end: int  # one past the last source layer held
    source_layers: int
    source_id: str  # hex SHA-256 of the source model file
    source_name: str
    n_embd: int = 0  # the embedding width (the activations' row size); 0: not read

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.count - 1


def file_identity(path: str | os.PathLike[str]) -> str:
    """Hex SHA-256 of a file: the identity stages carry of the model they were cut from."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def even_ranges(n_layer: int, stages: int) -> list[tuple[int, int]]:
    """`stages` contiguous layer ranges covering [0, n_layer), the first ones one layer longer
    when the layers do not divide evenly."""
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
        raise SplitError(f"the stage count must be a positive int, got {stages!r}")
    if stages > n_layer:
        raise SplitError(f"cannot split {n_layer} layers into {stages} stages")
    base, extra = divmod(n_layer, stages)
    out, start = [], 0
    for k in range(stages):
        end = start + base + (1 if k < extra else 0)
        out.append((start, end))
        start = end
    return out


def parse_ranges(text: str, n_layer: int) -> list[tuple[int, int]]:
    """Layer ranges written `A-B,C-D,...` (inclusive ends, e.g. `0-1,2-3`), checked to cover
    [0, n_layer) contiguously."""
    ranges = []
    for part in text.split(","):
        bits = part.strip().split("-")
        try:
            lo, hi = (int(bits[0]), int(bits[-1])) if len(bits) in (1, 2) else (-1, -1)
        except ValueError:
            raise SplitError(f"layer range {part.strip()!r} is not A-B with integers") from None
        if lo < 0 or hi < lo:
            raise SplitError(f"layer range {part.strip()!r} is not A-B with 0 <= A <= B")
        ranges.append((lo, hi + 1))
    check_ranges(ranges, n_layer)
    return ranges


def check_ranges(ranges: _Seq[tuple[int, int]], n_layer: int) -> None:
    expect = 0
    for lo, hi in ranges:
        if lo != expect or hi <= lo:
            raise SplitError(f"layer ranges must be contiguous and non-empty from 0: got "
                             f"{[(a, b - 1) for a, b in ranges]}")
        expect = hi
    if expect != n_layer:
        raise SplitError(f"layer ranges cover [0, {expect}) but the model has {n_layer} layers")


def _field_value(field: Any) -> tuple[Any, Any, Any]:
    import gguf

    kind = field.types[0]
    sub = field.types[1] if kind == gguf.GGUFValueType.ARRAY and len(field.types) > 1 else None
    return field.contents(), kind, sub


def split_model(src: str | os.PathLike[str], out_dir: str | os.PathLike[str],
                ranges: Iterable[tuple[int, int]] | int) -> list[str]:
    """Write `out_dir/stage-K.gguf` for every layer range (or for `ranges` even stages); return
    the paths. Refuses an unsupported architecture or ranges that do not tile the layers."""
    import gguf

    src = os.fspath(src)
    reader = gguf.GGUFReader(src)
    arch = str(reader.fields["general.architecture"].contents())
    if arch not in SUPPORTED_ARCHITECTURES:
        raise SplitError(f"architecture {arch!r} cannot be split by renumbering layers "
                         f"(supported: {sorted(SUPPORTED_ARCHITECTURES)})")
    n_layer = int(reader.fields[f"{arch}.block_count"].contents())
    ranges = even_ranges(n_layer, ranges) if isinstance(ranges, int) else list(ranges)
    check_ranges(ranges, n_layer)
    _check_layers(reader, n_layer)
    identity = file_identity(src)
    name_field = reader.fields.get("general.name")
    name = str(name_field.contents()) if name_field is not None else os.path.basename(src)
    os.makedirs(out_dir, exist_ok=True)
    paths: list[str] = []
    for k, (lo, hi) in enumerate(ranges):
        path = os.path.join(os.fspath(out_dir), f"stage-{k}.gguf")
        tiny = 0 < k < len(ranges) - 1
        keys: dict[str, int | str] = {"index": k, "count": len(ranges), "layer_start": lo, "layer_end": hi,
                "source_layers": n_layer, "source_id": identity, "source_name": name}
        _write_stage(reader, arch, path, lo, hi, tiny, keys)
        paths.append(path)
    for stale in stale_stage_paths(out_dir, len(ranges)):
        os.remove(stale)  # left from an earlier split into more stages: not one of these
    return paths


def _check_layers(reader: Any, n_layer: int) -> None:
    """`SplitError` unless the tensors are of exactly `n_layer` layers (`block_count`): a
    stage of a layer with no tensors would only fail when a worker loads it."""
    seen: set[int] = set()
    for t in reader.tensors:
        part = t.name.split(".")
        if part[0] == "blk" and len(part) > 1 and part[1].isdigit():
            seen.add(int(part[1]))
    missing = sorted(set(range(n_layer)) - seen)
    extra = sorted(i for i in seen if i >= n_layer)
    if missing or extra:
        what = (f"no tensors for layer(s) {_spans(missing)}" if missing
                else f"tensors of layer(s) {_spans(extra)} past the last")
        raise SplitError(f"the model states {n_layer} layers (block_count) but has {what}")


def _spans(layers: list[int]) -> str:
    """`0-2, 5` for [0, 1, 2, 5]."""
    out: list[str] = []
    for i in layers:
        if out and int(out[-1].split("-")[-1]) == i - 1:
            out[-1] = f"{out[-1].split('-')[0]}-{i}"
        else:
            out.append(str(i))
    return ", ".join(out)


def _stage_files(directory: str) -> dict[int, str]:
    """The `stage-K.gguf` entries of `directory` by K."""
    found = {}
    for entry in os.listdir(directory):
        if entry.startswith("stage-") and entry.endswith(".gguf"):
            try:
                k = int(entry[6:-5])
            except ValueError:
                continue
            if k >= 0:
                found[k] = os.path.join(directory, entry)
    return found


def stale_stage_paths(directory: str | os.PathLike[str], count: int) -> list[str]:
    """The `stage-K.gguf` files of `directory` with K >= `count`, in order: what an earlier
    split into more stages left there, which a split into `count` stages removes (a directory
    of stages is read as every stage-K.gguf in it)."""
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        return []
    found = _stage_files(directory)
    return [found[k] for k in sorted(found) if k >= count and os.path.isfile(found[k])]


def _write_stage(reader: Any, arch: str, path: str, lo: int, hi: int, tiny: bool,
                 keys: dict[str, int | str]) -> None:
    import gguf

    part = path + ".part"
    writer = gguf.GGUFWriter(part, arch)
    try:
        for key, val in keys.items():
            if isinstance(val, str):
                writer.add_string(KEY_PREFIX + key, val)
            else:
                writer.add_uint32(KEY_PREFIX + key, val)
        n_layer = hi - lo
        for fname, field in reader.fields.items():
            if fname.startswith("GGUF.") or fname == "general.architecture":
                continue
            if fname.startswith(KEY_PREFIX):
                continue  # a stage of a stage: the new keys replace the old ones
            if tiny and fname.startswith("tokenizer."):
                continue  # replaced by the tiny vocabulary below
            value, kind, sub = _field_value(field)
            if fname == f"{arch}.block_count":
                value = n_layer
            elif fname == f"{arch}.vocab_size" and tiny:
                value = len(_TINY_TOKENS)
            elif fname.startswith(f"{arch}.") and isinstance(value, list) and sub is not None \
                    and len(value) == int(reader.fields[f"{arch}.block_count"].contents()):
                value = value[lo:hi]  # a per-layer array (e.g. head_count_kv per layer)
            writer.add_key_value(fname, value, kind, sub_type=sub)
        if tiny:
            writer.add_tokenizer_model("llama")
            writer.add_token_list(list(_TINY_TOKENS))
            writer.add_token_scores([0.0] * len(_TINY_TOKENS))
            writer.add_token_types(list(_TINY_TYPES))
            writer.add_bos_token_id(1)
            writer.add_eos_token_id(2)
            writer.add_unk_token_id(0)
        for t in reader.tensors:
            name = str(t.name)
            data = np.array(t.data)
            if name.startswith("blk."):
                layer = int(name.split(".")[1])
                if not lo <= layer < hi:
                    continue
                name = f"blk.{layer - lo}." + name.split(".", 2)[2]
            elif tiny and name in ("token_embd.weight", "output.weight"):
                data = data[: len(_TINY_TOKENS)]
            writer.add_tensor(name, data, raw_dtype=t.tensor_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    os.replace(part, path)  # a reader never sees half a stage


def read_stage_info(path: str | os.PathLike[str]) -> StageInfo:
    """The `skippy.stage.*` keys of a stage file; `SplitError` if it is not one."""
    import gguf

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(path)
    fields = gguf.GGUFReader(path).fields
    vals: dict[str, Any] = {}
    for key in ("index", "count", "layer_start", "layer_end", "source_layers", "source_id",
                "source_name"):
        field = fields.get(KEY_PREFIX + key)
        if field is None:
            raise SplitError(f"{path} is not a stage file (no {KEY_PREFIX}{key}); "
                             "make stages with `skippy-scheduler split`")
        vals[key] = field.contents()
    arch = fields.get("general.architecture")
    width = fields.get(f"{arch.contents()}.embedding_length") if arch is not None else None
    return StageInfo(path=path, index=int(vals["index"]), count=int(vals["count"]),
                     layer_start=int(vals["layer_start"]), layer_end=int(vals["layer_end"]),
                     source_layers=int(vals["source_layers"]),
                     source_id=str(vals["source_id"]), source_name=str(vals["source_name"]),
                     n_embd=int(width.contents()) if width is not None else 0)


def check_stage_set(infos: _Seq[StageInfo], source_id: str | None = None) -> None:
    """Refuse stages that do not make one whole model, in order: one source, one count,
    indexes 0..P-1, layer ranges tiling the source's layers (and the given source, if any)."""
    if not infos:
        raise SplitError("no stages given")
    first = infos[0]
    for k, info in enumerate(infos):
        if info.source_id != first.source_id:
            raise SplitError(f"{info.path} was cut from another model than {first.path} "
                             f"({info.source_id[:12]} vs {first.source_id[:12]})")
        if info.count != len(infos):
            raise SplitError(f"{info.path} is stage {info.index} of {info.count}, but "
                             f"{len(infos)} stage{'s were' if len(infos) != 1 else ' was'} "
                             f"given: give all {info.count}, stage 0 first")
        if info.index != k:
            raise SplitError(f"{info.path} is stage {info.index} of {info.count}, but it is "
                             f"given as stage {k}")
    check_ranges([(i.layer_start, i.layer_end) for i in infos], first.source_layers)
    if source_id is not None and source_id != first.source_id:
        raise SplitError(f"the stages were cut from another model (source {first.source_id[:12]}"
                         f", the model given is {source_id[:12]})")


def stage_paths(directory: str | os.PathLike[str]) -> list[str]:
    """`directory/stage-0.gguf` ... in order; `SplitError` if there are none, gaps, or files of
    different splits (a stage-K.gguf left from an earlier split into more stages is named)."""
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        raise SplitError(f"{directory} is not a directory of stages")
    found = _stage_files(directory)
    if not found or sorted(found) != list(range(len(found))):
        raise SplitError(f"{directory} must hold stage-0.gguf ... stage-(P-1).gguf, found "
                         f"{sorted(found)}")
    paths = [found[k] for k in range(len(found))]
    _check_stage_counts(directory, paths)
    return paths


def _check_stage_counts(directory: str, paths: list[str]) -> None:
    """Refuse stage files whose own index and count (read from their headers) disagree with
    their names and with stage-0.gguf's count. An unreadable header is left to the worker that
    loads the file (it refuses it with the reason)."""
    keys = [_stage_keys(p) for p in paths]
    first = keys[0]
    if first is None:
        return
    count = first[1]
    extra = [(p, k) for p, k in zip(paths[count:], keys[count:])]
    if extra:
        names = ", ".join(os.path.basename(p) for p, _ in extra)
        are, them = ("is", "it") if len(extra) == 1 else ("are", "them")
        was = {k[1] for _, k in extra if k is not None}
        earlier = "another split"
        if len(was) == 1 and min(was) > count:
            earlier = f"an earlier split into {min(was)} stages"
        raise SplitError(f"{directory} holds {len(paths)} stage files, but stage-0.gguf is "
                         f"stage 0 of {count}: {names} {are} left from {earlier}; remove {them}, "
                         "or split into the directory again")
    if count > len(paths):
        raise SplitError(f"{directory} holds {len(paths)} stage files, but stage-0.gguf is "
                         f"stage 0 of {count}: stage-{len(paths)}.gguf ... "
                         f"stage-{count - 1}.gguf are missing")
    for k, (path, key) in enumerate(zip(paths, keys)):
        if key is not None and key != (k, count):
            raise SplitError(f"{path} is stage {key[0]} of {key[1]}, but stage-0.gguf is "
                             f"stage 0 of {count}: the files are from different splits; split "
                             "into the directory again")


def _stage_keys(path: str) -> tuple[int, int] | None:
    """(index, count) of a stage file; None where its header cannot be read as one (the worker
    that loads it says why)."""
    try:
        info = read_stage_info(path)
    except Exception:  # SplitError, or whatever a damaged header makes the reader raise
        return None
    return info.index, info.count


def read_layer_count(path: str | os.PathLike[str]) -> int:
    """`{arch}.block_count` of a GGUF model."""
    import gguf

    fields = gguf.GGUFReader(os.fspath(path)).fields
    arch = str(fields["general.architecture"].contents())
    return int(fields[f"{arch}.block_count"].contents())
