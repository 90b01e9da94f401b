"""Where a model's layers and KV cache go: the device arithmetic, without llama.cpp.

llama.cpp counts a model of `n_layer` repeating layers as `n_layer + 1` offloadable layers (the
repeating ones and the output layer; the token embeddings stay on the CPU). With
`n_gpu_layers = g` it puts layers `n_layer + 1 - g` .. `n_layer` on the GPUs (the output layer
first, then the repeating layers from the last one down), spread over the devices in proportion
to the tensor split (by default each device's free memory), each device taking a contiguous run.
A layer's KV cache lives where the layer lives: `cells × (K + V values per cell) × bytes per
value`, where a context of `n_ctx` cells over `s` KV streams (one per sequence id unless the
cache is unified) has `s × pad256(pad256(n_ctx) / s)` cells (llama.cpp pads each stream to 256).

`place()` reproduces that assignment, adds the KV and a compute-buffer estimate per device and
compares each device's total with its free memory less a margin:

* `auto` puts every layer on the GPUs when everything fits; otherwise (with the context left to
  the default) it first lowers the context towards `ctx_floor`, then offloads the most layers
  that fit, as llama-server's fit does;
* a number or `all` is taken as asked and refused (`FitError`, with the numbers) when the
  estimate exceeds a device's free memory;
* a context whose KV does not fit anywhere (host memory included) is refused with the numbers.

The inputs are plain numbers (`ModelFootprint` from the GGUF's tensor sizes, `Device` from what
llama.cpp reports), so the arithmetic is tested with made-up device sizes.
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Mapping, Sequence, Union

GiB = 1 << 30
MiB = 1 << 20
DEFAULT_MARGIN = 1 * GiB     # per GPU, like llama-server's fit target
HOST_MARGIN = 2 * GiB        # left to the rest of the machine when the host holds weights/KV
CTX_FLOOR = 4096             # auto never lowers a default context below this
CPU_BATCH = 512              # the batch on the CPU (with layers on a GPU: llama-server's 2048)
CELL_PAD = 256               # llama.cpp pads each KV stream to a multiple of this

KV_BYTES = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}
SPLIT_MODES = ("none", "layer", "row")
GPU_KINDS = ("gpu", "igpu")  # devices llama.cpp offloads layers to

LayerCount = Union[int, Literal["auto", "all"]]

NO_GPU_BACKEND = "this llama.cpp has no GPU backend"
# Backends that hold no GPU whatever they find (a registry of another name with no device is a
# GPU backend whose driver or devices are missing).
HOST_BACKENDS = ("CPU", "BLAS", "RPC")


class FitError(ValueError):
    """The model and context asked for cannot be placed on the devices (the message has the
    numbers)."""


class ModelFileError(ValueError):
    """A model file that cannot be read as a GGUF model (truncated, foreign, missing keys)."""


class RpcError(ValueError):
    """An RPC server (`--rpc`) that cannot be used: no RPC backend in this llama.cpp, nothing
    answering at the address, or a server that offers no device."""


@dataclass(frozen=True)
class Device:
    """A device as llama.cpp reports it (`ggml_backend_dev_*`)."""

    index: int
    name: str           # "CUDA0", "CPU", ...
    description: str
    kind: str           # "cpu", "gpu", "igpu", "accel", "meta"
    free: int           # bytes
    total: int          # bytes
    backend: str = ""   # its backend's name ("CUDA", "RPC", ...; "": not known)
    device_id: str = ""  # the device's own id, such as its PCI bus id ("": not known)

    @property
    def is_gpu(self) -> bool:
        return self.kind in GPU_KINDS


@dataclass(frozen=True)
class ModelFootprint:
    """A model's sizes as the GGUF states them."""

    n_layer: int
    n_ctx_train: int
    layer_bytes: tuple[int, ...]        # repeating layer i's weights
    output_bytes: int                   # the output layer (with tied embeddings, their copy)
    input_bytes: int                    # token embeddings (always on the CPU)
    kv_values: tuple[int, ...]          # repeating layer i's K + V values per KV cell
    n_embd: int = 0
    n_head: int = 0
    n_vocab: int = 0

    @property
    def offloadable(self) -> int:
        return self.n_layer + 1

    @property
    def weight_bytes(self) -> int:
        return sum(self.layer_bytes) + self.output_bytes + self.input_bytes


@dataclass(frozen=True)
class OffloadSpec:
    """The offload flags as given (llama-server's spellings)."""

    n_gpu_layers: LayerCount = "auto"
    split_mode: str = "layer"
    tensor_split: tuple[float, ...] = ()
    main_gpu: int = 0
    devices: tuple[str, ...] = ()       # -dev: names, or ("none",) for the CPU only
    rpc: tuple[str, ...] = ()           # --rpc: llama.cpp RPC servers (host:port) as devices


@dataclass(frozen=True)
class Placement:
    """Where the layers and the KV cache go, and what the host asks llama.cpp for."""

    n_gpu_layers: int                   # passed to llama.cpp
    offloadable: int
    gpus: tuple[str, ...]               # the devices layers may go to, in llama.cpp's order
    split_mode: str
    tensor_split: tuple[float, ...]     # per entry of `gpus` (empty: by free memory)
    main_gpu: int
    n_ctx: int                          # the context (-c; the lanes' when lanes share it)
    llama_n_ctx: int                    # the context asked of llama.cpp (holders included)
    kv_cells: int
    weights: Mapping[str, int] = field(default_factory=dict)   # bytes per device name
    kv: Mapping[str, int] = field(default_factory=dict)        # bytes per device name
    note: str = ""                      # why not every layer is on a GPU (empty: all are)
    # -dev none, or -sm none -mg -1: llama.cpp is given no device at all, so no work of the
    # model's (a large batch's matrix products included) goes to a GPU, as in llama-server;
    # -ngl 0 alone leaves llama.cpp its GPUs for such work.
    cpu_only: bool = False

    @property
    def on_gpu(self) -> bool:
        return self.n_gpu_layers > 0

    @property
    def over_rpc(self) -> bool:
        """Every GPU that holds layers is a llama.cpp RPC server's (`--rpc`: RPC0, RPC1, ...)."""
        held = [name for name in self.gpus if self.weights.get(name)]
        return self.on_gpu and bool(held) and all(name.startswith("RPC") for name in held)

    def line(self) -> str:
        """`17/17 layers on CUDA0, KV 2.0 GiB on CUDA0` or `0 layers on a GPU: <why>`."""
        if not self.on_gpu:
            return f"0 layers on a GPU: {self.note}"
        where = ", ".join(name for name in self.gpus if self.weights.get(name))
        kv = ", ".join(f"{_gib(b)} on {name}" for name, b in self.kv.items() if b)
        text = f"{self.n_gpu_layers}/{self.offloadable} layers on {where}, KV {kv or '0 B'}"
        return text + (f" ({self.note})" if self.note else "")


def _gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB" if n >= 0.1 * GiB else f"{n / MiB:.0f} MiB"


def parse_layers(text: str) -> LayerCount:
    """`-ngl` as llama-server takes it: a count >= 0, `auto` or `all` (-1: auto, -2 or less:
    all, as llama.cpp reads them)."""
    low = text.strip().lower()
    if low in ("auto", "all"):
        return "auto" if low == "auto" else "all"
    try:
        value = int(low)
    except ValueError:
        raise ValueError(f"expected a layer count, auto or all, got {text!r}") from None
    if value < 0:
        return "auto" if value == -1 else "all"
    return value


def parse_tensor_split(text: str) -> tuple[float, ...]:
    """`-ts 3,1` or `-ts 3/1`: a non-negative proportion per GPU, in the GPUs' order (split on
    runs of `,` and `/`, as llama-server splits it; all 0: by each GPU's free memory)."""
    parts = re.split(r"[,/]+", text.strip())
    if parts and not parts[-1].strip():
        parts.pop()  # a trailing separator: llama.cpp's split yields nothing after it
    if any(not p.strip() for p in parts):  # a leading one: llama.cpp refuses it too
        raise ValueError(f"expected proportions such as 3,1, got {text!r}")
    try:
        values = tuple(float(p) for p in parts)
    except ValueError:
        raise ValueError(f"expected proportions such as 3,1, got {text!r}") from None
    if not values or any(not (v >= 0 and math.isfinite(v)) for v in values):
        raise ValueError(f"expected non-negative proportions such as 3,1, got {text!r}")
    return values


def parse_rpc_servers(text: str) -> tuple[str, ...]:
    """`--rpc host:port[,host:port...]` as llama-server takes it (llama.cpp's RPC client splits
    an address at its first colon, so an IPv6 address cannot be given)."""
    out = []
    for part in (p.strip() for p in text.split(",")):
        host, _, port = part.partition(":")
        if not host or ":" in port or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"expected RPC servers as host:port[,host:port...], got {text!r}")
        if part not in out:
            out.append(part)
    return tuple(out)


def kv_cells(n_ctx: int, streams: int, unified: bool) -> int:
    """The KV cells llama.cpp allocates for a context of `n_ctx` over `streams` sequence ids."""
    total = _pad(n_ctx, CELL_PAD)
    if unified or streams <= 1:
        return total
    return streams * _pad(total // streams, CELL_PAD)


def _pad(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def compute_bytes(fp: ModelFootprint, *, n_ubatch: int, stream_cells: int,
                  flash_attn: bool) -> int:
    """An estimate of one device's compute buffer: the micro-batch's logits and activations,
    and (without flash attention) its attention scores over one stream's cells."""
    logits = n_ubatch * max(fp.n_vocab, 1) * 4
    acts = n_ubatch * max(fp.n_embd, 1) * 4 * 8
    scores = 0 if flash_attn else n_ubatch * max(fp.n_head, 1) * stream_cells * 4
    return logits + acts + scores + 64 * MiB


def describe_no_gpu(backends: Sequence[tuple[str, int]], log: str = "") -> str:
    """Why llama.cpp offers no GPU, from its backends (name, devices found) and its recent log:
    a GPU backend that found no device (with its complaint, the last log line naming it), or
    no GPU backend in this build."""
    empty = [name for name, n in backends if n == 0 and name.upper() not in HOST_BACKENDS]
    if not empty:
        return NO_GPU_BACKEND
    name = empty[0]
    said = [line.strip() for line in log.splitlines() if name.lower() in line.lower()]
    return f"this llama.cpp's {name} backend found no device" + (f" ({said[-1]})" if said else "")


def default_gpus(devices: Sequence[Device]) -> list[Device]:
    """The GPUs llama.cpp uses when no `-dev` names them, in its order: RPC servers first,
    then the discrete GPUs (one per device id: a card two backends both see counts once),
    and the integrated GPUs of one backend only when there is no discrete one."""
    rpc: list[Device] = []
    gpus: list[Device] = []
    igpus: list[Device] = []
    for d in devices:
        if d.kind == "gpu":
            if d.backend.upper() == "RPC" or (not d.backend and d.name.upper().startswith("RPC")):
                rpc.append(d)
            elif not (d.device_id and any(g.device_id == d.device_id for g in gpus)):
                gpus.append(d)
        elif d.kind == "igpu" and (not igpus or d.backend == igpus[-1].backend):
            igpus.append(d)
    return rpc + gpus + (igpus if not gpus else [])


def no_device(spec: OffloadSpec) -> str:
    """The flags that give llama.cpp no device at all ("": they do not): `-dev none`, or
    `-sm none -mg -1` (llama.cpp's reading)."""
    if tuple(n.lower() for n in spec.devices) == ("none",):
        return "-dev none"
    if spec.split_mode == "none" and spec.main_gpu < 0:
        return f"-sm none -mg {spec.main_gpu}"
    return ""


def select_gpus(devices: Sequence[Device], spec: OffloadSpec,
                no_gpu: str = NO_GPU_BACKEND) -> tuple[list[Device], str]:
    """The GPUs layers may go to (by -dev, split mode and main GPU), and why none when empty
    (`no_gpu` when llama.cpp sees no GPU at all: `describe_no_gpu`). Device names match
    whatever their case, as llama.cpp matches them."""
    none = no_device(spec)
    if none:
        return [], none
    gpus = default_gpus(devices)
    if spec.devices:
        by_name = {d.name.lower(): d for d in devices}
        missing = [n for n in spec.devices if n.lower() not in by_name]
        if missing:
            known = ", ".join(d.name for d in devices) or "none"
            raise FitError(f"-dev: no device named {', '.join(missing)} (llama.cpp sees: "
                           f"{known})")
        chosen = [by_name[n.lower()] for n in spec.devices]
        not_gpu = [d.name for d in chosen if not d.is_gpu]
        if not_gpu:
            raise FitError(f"-dev: {', '.join(not_gpu)} is not a GPU; layers go to GPUs only "
                           "(the CPU holds what they do not)")
        gpus = chosen
    if not gpus:
        return [], no_gpu
    if spec.main_gpu < 0 and spec.split_mode != "none":
        raise FitError(f"-mg {spec.main_gpu} (no GPU) is read only with -sm none")
    if spec.split_mode == "none":
        if spec.main_gpu >= len(gpus):
            raise FitError(f"-mg {spec.main_gpu}: there are {len(gpus)} GPU(s) "
                           f"({', '.join(d.name for d in gpus)})")
        gpus = [gpus[spec.main_gpu]]
    return gpus, ""


def assign(fp: ModelFootprint, gpus: Sequence[Device], n_gpu_layers: int,
           tensor_split: Sequence[float]) -> list[int]:
    """The device of each offloadable layer (index into `gpus`, -1: the CPU), as llama.cpp
    assigns them: the last `n_gpu_layers` layers, split points by the normalised split."""
    n_all = fp.offloadable
    g = min(max(n_gpu_layers, 0), n_all) if gpus else 0
    # Proportions past the last GPU are not read (as llama.cpp reads -ts).
    weights = list(tensor_split[:len(gpus)]) + [0.0] * (len(gpus) - len(tensor_split))
    if not any(weights):
        weights = [float(d.free) for d in gpus]
    total = sum(weights) or 1.0
    points, acc = [], 0.0
    for w in weights:
        acc += w
        points.append(acc / total)
    start = n_all - g
    out = []
    for il in range(n_all):
        if il < start:
            out.append(-1)
            continue
        x = (il - start) / g
        dev = next((k for k, p in enumerate(points) if p > x), len(points) - 1)
        out.append(dev)
    return out


def _loads(fp: ModelFootprint, gpus: Sequence[Device], layer_dev: Sequence[int], cells: int,
           kv_bytes: float, compute: int) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
    weights: dict[str, int] = {"CPU": fp.input_bytes}
    kv: dict[str, int] = {}
    for d in gpus:
        weights[d.name] = 0
        kv[d.name] = 0
    kv["CPU"] = 0
    for il, dev in enumerate(layer_dev):
        name = "CPU" if dev < 0 else gpus[dev].name
        if il < fp.n_layer:
            weights[name] += fp.layer_bytes[il]
            kv[name] += int(cells * fp.kv_values[il] * kv_bytes)
        else:
            weights[name] += fp.output_bytes
    need = {name: weights[name] + kv[name] + (compute if name != "CPU" and
                                              (weights[name] or kv[name]) else 0)
            for name in weights}
    return weights, kv, need


def place(fp: ModelFootprint, devices: Sequence[Device], spec: OffloadSpec, *,
          n_ctx: int | None, streams: int, unified: bool, kv_type: str, n_ubatch: int,
          flash_attn: bool, lanes: int = 0, host: Device | None = None,
          margin: int = DEFAULT_MARGIN, ctx_floor: int = CTX_FLOOR,
          ctx_quantum: int = CELL_PAD, no_gpu: str = NO_GPU_BACKEND,
          lower: str = "-c/--ctx-size or -np") -> Placement:
    """Place the model (see the module docstring). `n_ctx=None`: the context from the model
    (its training context, at least `ctx_quantum`, lowered towards `ctx_floor` when that does
    not fit, never below the smaller of the two unless asked). `host`: the CPU device, whose free memory
    bounds what stays on the CPU; `ctx_quantum`: a default context is a multiple of it (the
    caller passes 256 × lanes so every lane gets whole padded cells). `lanes` > 0: the context
    is the lanes' (`-c`), and each of the other `streams - lanes` sequence ids (prefix holders)
    gets a lane's share on top, as the server sizes them. `no_gpu`: why no layer goes to a
    GPU when the devices hold none (`describe_no_gpu`). `lower`: the flags a refusal tells the
    user to lower (the command's own)."""
    if spec.split_mode not in SPLIT_MODES:
        raise FitError(f"-sm must be one of {', '.join(SPLIT_MODES)}, got {spec.split_mode!r}")
    if kv_type not in KV_BYTES:
        raise FitError(f"unknown KV cache type {kv_type!r}")
    gpus, why_none = select_gpus(devices, spec, no_gpu)
    kvb = KV_BYTES[kv_type]
    split = tuple(spec.tensor_split)[:len(gpus)] if spec.split_mode != "none" else ()
    asked = spec.n_gpu_layers
    n_all = fp.offloadable

    def total_ctx(ctx: int) -> int:
        return ctx + (streams - lanes) * (ctx // lanes) if lanes else ctx

    def evaluate(g: int, ctx: int) -> tuple[dict[str, int], dict[str, int], dict[str, int], int]:
        cells = kv_cells(total_ctx(ctx), streams, unified)
        stream_cells = cells if unified else cells // max(streams, 1)
        compute = compute_bytes(fp, n_ubatch=n_ubatch, stream_cells=stream_cells,
                                flash_attn=flash_attn)
        w, k, need = _loads(fp, gpus, assign(fp, gpus, g, split), cells, kvb, compute)
        return w, k, need, cells

    def over(need: Mapping[str, int], with_margin: bool) -> list[str]:
        bad = []
        for d in gpus:
            room = d.free - (margin if with_margin else 0)
            if need.get(d.name, 0) > room:
                bad.append(f"{d.name} needs {_gib(need[d.name])}, has {_gib(d.free)} free"
                           + (f" ({_gib(margin)} kept free)" if with_margin else ""))
        if host is not None:
            room = host.free - (HOST_MARGIN if with_margin else 0)
            if need.get("CPU", 0) > room:
                bad.append(f"the host needs {_gib(need['CPU'])} for what stays on the CPU, "
                           f"has {_gib(host.free)} free")
        return bad

    # The prefix holders' cells count too (a lane's share each): a hint names them.
    holders = (f", or keep fewer prefix holders ({streams - lanes} now: --prefix-holders, or "
               "--prefix-cache-tokens 0 for none)" if lanes and streams > lanes else "")
    default_ctx = n_ctx is None
    # A default context is the model's training context (each lane's share of it, as
    # llama-server's slots share theirs, at least a quantum's), lowered towards the floor
    # when that does not fit.
    start = _pad(max(fp.n_ctx_train, ctx_quantum), ctx_quantum)
    floor = min(_pad(max(ctx_floor, ctx_quantum), ctx_quantum), start)
    ctx = start if default_ctx else int(n_ctx)  # type: ignore[arg-type]

    if asked == "auto":
        if not gpus:
            g = 0
        else:
            g = n_all
        # The context first (down to the floor), then the layers.
        w, k, need, cells = evaluate(g, ctx)
        if over(need, True) and default_ctx:
            lo, hi = floor, ctx
            if not over(evaluate(g, lo)[2], True):
                while hi - lo > ctx_quantum:
                    mid = _pad((lo + hi) // 2, ctx_quantum)
                    if mid >= hi:
                        break
                    if over(evaluate(g, mid)[2], True):
                        hi = mid
                    else:
                        lo = mid
                ctx = lo
            else:
                ctx = floor
        w, k, need, cells = evaluate(g, ctx)
        while g > 0 and over(need, True):
            g -= 1
            w, k, need, cells = evaluate(g, ctx)
        bad = over(need, False)
        if bad:
            raise FitError(f"a context of {ctx} tokens ({cells} KV cells, {kv_type}) does not "
                           f"fit: {'; '.join(bad)}; lower {lower}{holders}")
        note = why_none if not gpus else ("" if g == n_all else
                                          f"the rest does not fit in {_gib(margin)} less than "
                                          "the free memory")
        if gpus and g == 0:
            note = "no layer fits in the GPU's free memory"
    else:
        g = n_all if asked == "all" else min(int(asked), n_all)
        if not gpus:
            g = 0
        w, k, need, cells = evaluate(g, ctx)
        bad = over(need, False)
        if bad:
            what = f"{g}/{n_all} layers" if g else "the model"
            raise FitError(f"{what} with a context of {ctx} tokens ({cells} KV cells, "
                           f"{kv_type}) do not fit: {'; '.join(bad)}; lower -ngl, {lower}"
                           f"{holders}")
        note = why_none if not gpus else ("" if g == n_all else f"-ngl {asked}")
        if gpus and g == 0:
            note = f"-ngl {asked}"
    used = tuple(d.name for d in gpus)
    return Placement(n_gpu_layers=g, offloadable=n_all, gpus=used, split_mode=spec.split_mode,
                     tensor_split=split, main_gpu=spec.main_gpu if gpus else 0, n_ctx=ctx,
                     llama_n_ctx=total_ctx(ctx), kv_cells=cells, weights={n: b for n, b in w.items() if b},
                     kv={n: b for n, b in k.items() if b}, note=note,
                     cpu_only=bool(no_device(spec)))


# -- the GGUF side -------------------------------------------------------------------------


def open_gguf(path: str | os.PathLike[str]) -> Any:
    """`gguf.GGUFReader` of `path` (header and tensor table read, no weights); `ModelFileError`
    with one readable line for a file the gguf package cannot read (truncated, damaged, of an
    unknown GGUF version)."""
    try:
        from gguf import GGUFReader
    except ImportError as exc:  # pragma: no cover - the llama extra brings gguf
        raise ModelFileError(f"reading a model's sizes needs the gguf package ({exc})") from None
    path = os.fspath(path)
    try:
        return GGUFReader(path, "r")
    except (ValueError, OSError, IndexError, KeyError, TypeError, OverflowError) as exc:
        unknown = re.search(r"(\d+)\)? is not a valid GGMLQuantizationType", str(exc))
        if unknown is not None:  # a tensor type newer than the gguf package
            raise ModelFileError(
                f"{path} has tensors of type {unknown.group(1)}, which the gguf package "
                f"(version {_gguf_version()}) that reads model sizes here does not know; a "
                "newer gguf may know it") from None
        raise ModelFileError(f"{path} is not a whole GGUF model: "
                             f"{_why_unreadable(path, exc)}") from None


def _gguf_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gguf")
    except PackageNotFoundError:  # pragma: no cover - imported, so installed
        return "unknown"


def footprint_from_gguf(path: str | os.PathLike[str], *, allow_stage: bool = True,
                        reader: Any = None) -> ModelFootprint:
    """Read a model's sizes from its GGUF header (the `gguf` package; no weights are read).
    `ModelFileError` for a file that is not a whole GGUF model. `allow_stage=False`: the
    caller loads it as a whole model, so a stage file (`skippy-scheduler split`) is refused
    too; the stage worker, which loads stage files, leaves it True. `reader`: the file's
    `open_gguf` reader, when the caller has it already (the header is read once)."""
    path = os.fspath(path)
    if reader is None:
        reader = open_gguf(path)
    size = os.path.getsize(path)
    fields = reader.fields

    def value(key: str) -> object:
        f = fields.get(key)
        return None if f is None else f.contents()

    if not allow_stage:
        refuse_stage_file(path, value)
    arch = value("general.architecture")
    if not isinstance(arch, str):
        raise ModelFileError(f"{path} has no general.architecture")
    n_layer = value(f"{arch}.block_count")
    if not isinstance(n_layer, int) or n_layer < 1:
        raise ModelFileError(f"{path} has no {arch}.block_count")
    n_ctx_train = value(f"{arch}.context_length")
    n_embd = value(f"{arch}.embedding_length")
    n_head = value(f"{arch}.attention.head_count")
    n_head_kv = value(f"{arch}.attention.head_count_kv")
    k_len = value(f"{arch}.attention.key_length")
    v_len = value(f"{arch}.attention.value_length")
    embd = int(n_embd) if isinstance(n_embd, int) else 0
    heads = _per_layer(n_head, n_layer)
    heads_kv = _per_layer(n_head_kv if n_head_kv is not None else n_head, n_layer)
    kv_values = []
    for il in range(n_layer):
        head_dim = embd // heads[il] if heads[il] else 0
        kd = int(k_len) if isinstance(k_len, int) else head_dim
        vd = int(v_len) if isinstance(v_len, int) else head_dim
        kv_values.append(heads_kv[il] * (kd + vd))

    layer_bytes = [0] * n_layer
    output = inputs = 0
    has_output = False
    end = 0
    n_vocab = 0
    for t in reader.tensors:
        nbytes = int(t.n_bytes)
        end = max(end, int(t.data_offset) + nbytes)
        name = t.name
        if name.startswith("blk."):
            try:
                il = int(name.split(".")[1])
            except ValueError:
                il = -1
            if 0 <= il < n_layer:
                layer_bytes[il] += nbytes
                continue
        if name.startswith("token_embd."):
            inputs += nbytes
            if name == "token_embd.weight":
                n_vocab = int(max(t.shape)) if len(t.shape) else 0
            continue
        if name == "output.weight":
            has_output = True
        output += nbytes
    if end > size:
        raise ModelFileError(f"{path} is not a whole GGUF model: truncated: its tensors end "
                             f"at byte {end}, the file has {size} bytes")
    if not has_output:
        output += inputs  # tied embeddings: the output layer gets its own copy
    return ModelFootprint(
        n_layer=n_layer, n_ctx_train=int(n_ctx_train) if isinstance(n_ctx_train, int) else 0,
        layer_bytes=tuple(layer_bytes), output_bytes=output, input_bytes=inputs,
        kv_values=tuple(kv_values), n_embd=embd, n_head=max(heads) if heads else 0,
        n_vocab=n_vocab)


def _per_layer(v: object, n: int) -> list[int]:
    if isinstance(v, int):
        return [v] * n
    if isinstance(v, (list, tuple)) and len(v) == n:
        return [int(x) for x in v]
    return [0] * n


def refuse_stage_file(path: str, value: Callable[[str], object]) -> None:
    """`ModelFileError` if the GGUF whose metadata `value(key)` reads is a stage file (it has
    `skippy.stage.index`): one stage's layers, not the model a whole-model command loads."""
    from .stages.split import KEY_PREFIX

    index = value(KEY_PREFIX + "index")
    if index is None:
        return
    count = value(KEY_PREFIX + "count")
    of = f" of {count}" if isinstance(count, int) else ""
    raise ModelFileError(
        f"{path} is stage {index}{of} of a split model (skippy-scheduler split), not a whole "
        f"model: run or serve its directory with --stages {os.path.dirname(path) or '.'}, or "
        "give the model it was cut from")


def _why_unreadable(path: str, exc: BaseException) -> str:
    """Why the gguf package could not read `path`, in words: its own errors are numpy's, which
    name array shapes and axes (a file that ends early, or a count or offset that points past
    its end, fails as an index or a reshape)."""
    if isinstance(exc, OSError):
        return f"cannot read it ({exc.strerror or _brief(exc)})"
    text = str(exc)
    version = re.search(r"version (\d+)", text)
    if version is not None and "cannot handle" in text:
        return (f"GGUF version {version.group(1)}, which the gguf package cannot read (it "
                f"reads versions {_reader_versions()})")
    try:
        size = os.path.getsize(path)
    except OSError:
        size = -1
    if size == 0:
        return "the file is empty"
    numpy = isinstance(exc, IndexError) or any(
        t in text for t in ("reshape", "dtype", "unpack", "out of bounds"))
    if size > 0 and numpy:
        # Where the reader was: building the tensors from the data (the header read whole)?
        tb, in_data = exc.__traceback__, False
        while tb is not None:
            in_data = in_data or tb.tb_frame.f_code.co_name == "_build_tensors"
            tb = tb.tb_next
        part = "tensor data" if in_data else "header"
        return (f"truncated or damaged: its {part} runs past the end of the file ({size} "
                "bytes)")
    return f"truncated, damaged or of another format ({_brief(exc)})"


def _reader_versions() -> str:
    try:
        from gguf.gguf_reader import READER_SUPPORTED_VERSIONS
    except ImportError:  # pragma: no cover - gguf moved it
        return "it knows"
    return " and ".join(str(v) for v in READER_SUPPORTED_VERSIONS)


def _brief(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text[:160] or type(exc).__name__
