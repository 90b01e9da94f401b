"""The offload flags of every command that loads a model, spelled as llama-server spells them.

    -ngl/--n-gpu-layers N|auto|all   -sm/--split-mode none|layer|row   -ts/--tensor-split 3,1
    -mg/--main-gpu I                 -dev/--device CUDA0[,CUDA1]       --list-devices
    --rpc HOST:PORT[,HOST:PORT]

`auto` (the default) puts every layer on the GPUs when the weights and the KV cache fit their
free memory with a margin, else the most layers that fit (hosts/offload.py); on a llama.cpp
without a GPU backend everything stays on the CPU. docs/gpu.md has the whole story.
"""
from __future__ import annotations

import argparse
import sys
from typing import Any, Optional, Sequence

from ..hosts.offload import (CPU_BATCH, NO_GPU_BACKEND, FitError, GiB, OffloadSpec, RpcError,
                             SPLIT_MODES, parse_layers, parse_rpc_servers, parse_tensor_split,
                             select_gpus)
from ._common import CommandError


def _layers(text: str) -> Any:
    try:
        return parse_layers(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _split(text: str) -> tuple[float, ...]:
    try:
        return parse_tensor_split(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _rpc(text: str) -> tuple[str, ...]:
    try:
        return parse_rpc_servers(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def device_names(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if not names:
        raise argparse.ArgumentTypeError("expected device names such as CUDA0,CUDA1 or none")
    return names


def _main_gpu(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a GPU index, got {text!r}") from None
    if value < -1:
        raise argparse.ArgumentTypeError(f"expected a GPU index >= 0 (or -1: with -sm none, "
                                         f"no GPU), got {value}")
    return value


class _ListDevices(argparse.Action):
    """`--list-devices`: print what llama.cpp sees and exit, as llama-server does."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: Optional[str] = None) -> None:
        try:
            print(devices_text(getattr(namespace, "rpc", ())))
        except CommandError as exc:
            parser.error(str(exc))
        parser.exit(0)


def devices_text(rpc: Sequence[str] = ()) -> str:
    """The devices llama.cpp sees, one line each, with their free and total memory (`rpc`:
    RPC servers registered first, as `--rpc` given before `--list-devices`)."""
    try:
        from ..hosts.llama.backend import add_rpc_servers, list_devices, no_gpu_reason
    except ImportError as exc:
        raise CommandError(f"llama.cpp is not available ({exc}); install it with: "
                           "pip install 'skippy-scheduler[llama]'") from None
    try:
        add_rpc_servers(rpc)
    except RpcError as exc:
        raise CommandError(str(exc)) from None
    devices = list_devices()
    lines = ["Available devices:"]
    for d in devices:
        lines.append(f"  {d.name}: {d.description} ({d.kind}, {d.free / GiB:.1f} GiB free of "
                     f"{d.total / GiB:.1f} GiB)")
    if not any(d.is_gpu for d in devices):
        why = no_gpu_reason()
        hint = ("build llama-cpp-python with CMAKE_ARGS=\"-DGGML_CUDA=on\" for NVIDIA GPUs"
                if why == NO_GPU_BACKEND
                else "check the GPU and its driver (nvidia-smi for NVIDIA's)")
        lines.append(f"  (no GPU: {why}; {hint}, docs/gpu.md)")
    return "\n".join(lines)


def add_offload_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("devices (llama-server's spellings; docs/gpu.md)")
    g.add_argument("-ngl", "--n-gpu-layers", "--gpu-layers", dest="n_gpu_layers", type=_layers,
                   default="auto", metavar="N|auto|all",
                   help="layers to put on the GPUs (llama.cpp counts the output layer as one): "
                        "auto puts all of them there when the weights and the KV cache fit the "
                        "free memory with a margin, else the most that fit (default: auto)")
    g.add_argument("-sm", "--split-mode", choices=SPLIT_MODES, default="layer",
                   help="how to use several GPUs: none (only --main-gpu), layer (runs of "
                        "layers and their KV per GPU), row (rows of each weight) "
                        "(default: layer)")
    g.add_argument("-ts", "--tensor-split", type=_split, default=(), metavar="N0,N1,...",
                   help="share of the offloaded layers per GPU, e.g. 3,1 (default: in "
                        "proportion to each GPU's free memory)")
    g.add_argument("-mg", "--main-gpu", type=_main_gpu, default=0, metavar="I",
                   help="the GPU used with --split-mode none; -1 with it: no GPU (default: 0)")
    g.add_argument("-dev", "--device", dest="device", type=device_names, default=(),
                   metavar="DEV[,DEV...]",
                   help="the GPUs to use, by the names --list-devices prints, or none for the "
                        "CPU only (default: llama.cpp's pick: RPC servers, then every discrete "
                        "GPU, integrated ones only without a discrete one)")
    g.add_argument("--rpc", type=_rpc, action="extend", default=[], metavar="HOST:PORT[,...]",
                   help="llama.cpp RPC servers whose devices join this process's as RPC0, "
                        "RPC1, ... (GPUs to llama.cpp); give it before --list-devices "
                        "(default: none)")
    g.add_argument("--list-devices", action=_ListDevices,
                   help="print the devices llama.cpp sees, with their free and total memory, "
                        "and exit")


def offload_given(args: argparse.Namespace) -> list[str]:
    """The offload flags given a value other than their default (by their short names)."""
    given = []
    for flag, dest, default in (("-ngl", "n_gpu_layers", "auto"), ("-sm", "split_mode", "layer"),
                                ("-ts", "tensor_split", ()), ("-mg", "main_gpu", 0),
                                ("-dev", "device", ())):
        value = getattr(args, dest, default)
        if (tuple(value) if isinstance(value, (list, tuple)) else value) != default:
            given.append(flag)
    return given


def refuse_offload_with_stage_addresses(args: argparse.Namespace) -> None:
    """With --stage-addresses the stage workers were started with their own offload flags:
    the driver's would change nothing, so they are refused rather than ignored."""
    if not getattr(args, "stage_addresses", None):
        return
    given = offload_given(args)
    if given:
        raise CommandError(f"{', '.join(given)} with --stage-addresses: the stage workers load "
                           "the layers, with the flags each `skippy-scheduler stage` was "
                           "started with; give them there (docs/gpu.md)")


def check_device_names(names: Sequence[str]) -> None:
    """-dev / --stage-devices names are checked as each stage worker will check its own
    (`select_gpus`: a name llama.cpp here does not see, or a device that is not a GPU), before
    any worker starts (local workers see this machine's devices)."""
    wanted = tuple(n for n in names if n.lower() != "none")
    if not wanted:
        return
    from ..hosts.llama.backend import list_devices

    try:
        select_gpus(list_devices(), OffloadSpec(devices=wanted))
    except FitError as exc:
        raise CommandError(str(exc)) from None


def offload_spec(args: argparse.Namespace) -> OffloadSpec:
    return OffloadSpec(n_gpu_layers=args.n_gpu_layers, split_mode=args.split_mode,
                       tensor_split=tuple(args.tensor_split), main_gpu=args.main_gpu,
                       devices=tuple(args.device),
                       rpc=tuple(dict.fromkeys(getattr(args, "rpc", ()))))


def offload_argv(args: argparse.Namespace) -> list[str]:
    """The flags again, for a child process (a stage worker) that loads its own layers."""
    out = ["-ngl", str(args.n_gpu_layers), "-sm", args.split_mode, "-mg", str(args.main_gpu)]
    if args.tensor_split:
        out += ["-ts", ",".join(f"{v:g}" for v in args.tensor_split)]
    if args.device:
        out += ["-dev", ",".join(args.device)]
    return out


def resolve_for(args: argparse.Namespace, model: str, *, n_ctx: Optional[int], lanes: int,
                holders: int = 0, unified: bool = False, share_ctx: bool = False,
                n_batch: Optional[int] = None, cpu_batch: int = CPU_BATCH,
                lower: str = "-c/--ctx-size or -np") -> Any:
    """`hosts.llama.fit.resolve` with the command's flags; its refusals as CommandError
    (`lower`: the flags they tell the user to lower)."""
    from ..hosts.llama.fit import resolve
    from ..hosts.offload import ModelFileError

    try:
        return resolve(model, offload_spec(args), n_ctx=n_ctx, lanes=lanes, holders=holders,
                       unified=unified, share_ctx=share_ctx, kv_type=args.kv_type,
                       flash_attn=args.flash_attn, n_batch=n_batch, cpu_batch=cpu_batch,
                       lower=lower)
    except ModelFileError as exc:
        raise CommandError(f"--model: {exc}") from None  # as check_model_file names it
    except (FitError, RpcError) as exc:
        raise CommandError(str(exc)) from None


def print_placement(command: str, resolved: Any, always: bool = True) -> None:
    """The startup line's placement part, on stderr (`always=False`: only when layers went to
    a GPU, for commands whose stderr is otherwise quiet)."""
    if not always and not resolved.placement.on_gpu:
        return
    print(f"skippy-scheduler {command}: {resolved.placement.line()}", file=sys.stderr,
          flush=True)
