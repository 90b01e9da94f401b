"""Fitting a model to this machine's devices: the offload flags and the device-dependent defaults
resolved against the GGUF's sizes and the memory llama.cpp reports (hosts/offload.py does the
arithmetic).

With layers on a GPU the defaults are llama-server's: KV cache f16, flash attention `auto`, a
batch of 2048 tokens in micro-batches of 512. On the CPU they stay what they were: f32 KV, flash
attention off and one micro-batch per batch, the settings under which a sequence's greedy
tokens do not depend on what it was batched with.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Union

from ..offload import (CPU_BATCH, NO_GPU_BACKEND, Device, OffloadSpec, Placement,
                       footprint_from_gguf, place)
from .backend import add_rpc_servers, list_devices, no_gpu_reason

GPU_BATCH, GPU_UBATCH = 2048, 512
FLASH_ATTN = ("on", "off", "auto")


@dataclass(frozen=True)
class Resolved:
    """The settings a host is built with on this machine."""

    placement: Placement
    n_ctx: int                # the context (-c), as resolved
    kv_type: str
    flash_attn: str           # on, off or auto
    n_batch: int
    n_ubatch: Optional[int]   # None: the batch


def flash_attn_mode(value: Union[bool, str, None]) -> Optional[str]:
    """True/False/"on"/"off"/"auto"/None (left to the device) as a mode name or None."""
    if value is None or isinstance(value, str) and value in FLASH_ATTN:
        return value
    if isinstance(value, bool):
        return "on" if value else "off"
    raise ValueError(f"flash_attn must be one of {', '.join(FLASH_ATTN)}, got {value!r}")


def resolve(model_path: Union[str, os.PathLike[str]], spec: OffloadSpec, *, n_ctx: Optional[int],
            lanes: int, holders: int = 0, unified: bool = False, share_ctx: bool = True,
            kv_type: Optional[str] = None, flash_attn: Union[bool, str, None] = None,
            n_batch: Optional[int] = None, n_ubatch: Optional[int] = None,
            cpu_batch: int = CPU_BATCH, devices: Optional[list[Device]] = None,
            lower: str = "-c/--ctx-size or -np") -> Resolved:
    """The placement and the defaults for `model_path` (FitError, ModelFileError: refused with
    the numbers, before anything is loaded; RpcError: `spec.rpc` names a server that cannot
    be used). `n_ctx=None`: from the model. `share_ctx`: the
    lanes share `n_ctx` and each holder gets a lane's share on top (serve); otherwise `n_ctx`
    is the llama.cpp context as it is (run, calibrate, stage). `lower`: the flags a refusal
    tells the user to lower."""
    fp = footprint_from_gguf(model_path, allow_stage=False)  # a whole model, not a stage
    if devices is None and spec.rpc:
        add_rpc_servers(spec.rpc)
    devs = list_devices() if devices is None else devices
    # Why no GPU, asked of llama.cpp only where it lists none (and devices were not given).
    no_gpu = (no_gpu_reason() if devices is None and not any(d.is_gpu for d in devs)
              else NO_GPU_BACKEND)
    host = next((d for d in devs if d.kind == "cpu"), None)
    gpus_possible = spec.n_gpu_layers != 0 and any(d.is_gpu for d in devs) and \
        tuple(n.lower() for n in spec.devices) != ("none",)
    fa = flash_attn_mode(flash_attn)
    kv = kv_type or ("f16" if gpus_possible else "f32")
    batch = n_batch or (GPU_BATCH if gpus_possible else cpu_batch)
    ubatch = n_ubatch if n_ubatch is not None else (min(GPU_UBATCH, batch) if gpus_possible
                                                    else None)
    placement = place(fp, devs, spec, n_ctx=n_ctx, streams=lanes + holders, unified=unified,
                      kv_type=kv, n_ubatch=ubatch or batch,
                      flash_attn=(fa or ("auto" if gpus_possible else "off")) != "off",
                      lanes=lanes if share_ctx else 0, host=host,
                      ctx_quantum=256 * lanes if share_ctx and not unified else 256,
                      no_gpu=no_gpu, lower=lower)
    if not placement.on_gpu and gpus_possible:
        # Nothing went to a GPU after all: the CPU's defaults for what was left to the device.
        kv = kv_type or "f32"
        batch = n_batch or cpu_batch
        ubatch = n_ubatch
    mode = fa or ("auto" if placement.on_gpu else "off")
    return Resolved(placement=placement, n_ctx=placement.n_ctx, kv_type=kv, flash_attn=mode,
                    n_batch=batch, n_ubatch=ubatch)
