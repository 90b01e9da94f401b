"""llama.cpp's process-wide setup (the backend, the log sink, the devices), loading, contexts.

llama.cpp and ggml log through one process-wide callback, from whatever thread logs (a GPU
backend's initialisation and its workers included). The sink is C (`_llama_log`): it keeps
warnings and errors (and their continuation lines) in a short ring, so an error message can say
what llama.cpp complained about, and runs no Python, so no llama.cpp thread ever needs the
interpreter. `SKIPPY_LLAMA_LOG=info` (or `debug`, `warn`, `error`) also echoes llama.cpp's log to
stderr from that level up; `SKIPPY_LLAMA_LOG=raw` installs no sink at all (llama.cpp's own
logger writes everything to stderr, and error messages carry no log lines): a way to tell a
problem of the sink from one of llama.cpp.
"""
from __future__ import annotations

import ctypes
import os
import socket
import sys
import threading
from typing import Any, Callable, Optional, Sequence

import llama_cpp as _ll

from ... import _llama_log
from ..._validate import check_int as check_int  # the hosts' argument check (host.py, direct.py)
from ..offload import Device, Placement, RpcError, describe_no_gpu

KV_TYPES = {"f32": 0, "f16": 1}  # ggml_type values of GGML_TYPE_F32 / GGML_TYPE_F16
_SPLIT_MODES = {"none": 0, "layer": 1, "row": 2}
# llama_flash_attn_type: AUTO -1, DISABLED 0, ENABLED 1.
_FLASH_ATTN_TYPES = {"auto": -1, "off": 0, "on": 1}
FLASH_ATTN_NAMES = {v: k for k, v in _FLASH_ATTN_TYPES.items()}


def flash_attn_type(value: bool | str) -> int:
    """True/False or on/off/auto as llama.cpp's flash_attn_type."""
    if isinstance(value, bool):
        return 1 if value else 0
    if value in _FLASH_ATTN_TYPES:
        return _FLASH_ATTN_TYPES[value]
    raise ValueError(f"flash_attn must be on, off or auto, got {value!r}")
_DEVICE_KINDS = ("cpu", "gpu", "igpu", "accel", "meta")  # enum ggml_backend_dev_type
_ECHO_LEVELS = {"debug": 1, "info": 2, "warn": 3, "warning": 3, "error": 4}

# The C sink as a llama_log_callback pointer (kept for the life of the process).
_sink = _ll.llama_log_callback(_llama_log.sink_address())
_RAW = _ll.llama_log_callback(0)
_backend_ready = False


def init_backend() -> None:
    global _backend_ready
    if not _backend_ready:
        echo = os.environ.get("SKIPPY_LLAMA_LOG", "").strip().lower()
        _llama_log.set_echo(_ECHO_LEVELS.get(echo, 0))
        # NULL: llama.cpp's default logger (fputs to stderr), no Python and no sink.
        _ll.llama_log_set(_RAW if echo == "raw" else _sink, ctypes.c_void_p(0))
        _ll.llama_backend_init()
        _backend_ready = True


def recent_log(n: int = 8) -> str:
    """The last `n` warning/error lines llama.cpp logged (for diagnostics)."""
    return "".join(_llama_log.recent(n)).strip()


class LlamaLoadError(RuntimeError):
    """llama.cpp could not load a model or create a context (the reason from its log)."""


def log_mark() -> int:
    """Where llama.cpp's log stands now (lines kept so far): `failure_reason(since=...)`
    then reads only what was logged after it."""
    return int(_llama_log.counts()[1])


def failure_reason(since: Optional[int] = None, n: int = 8) -> str:
    """One line for a failed load or context: llama.cpp's last line naming an error (`error
    loading model: ...`), else its last complaint, with the first allocation failure before it
    when there was one (its size says what did not fit); of the last `n` lines logged, and only
    those logged after `since` (a `log_mark()`) when given."""
    if since is not None:
        n = min(n, max(log_mark() - since, 0))
    lines = [line.strip() for line in recent_log(n).splitlines() if line.strip()] if n else []
    if not lines:
        return "no reason logged"
    last = next((line for line in reversed(lines) if "error" in line.lower()), lines[-1])
    memory = next((line for line in lines if "insufficient memory" in line
                   or "out of memory" in line.lower()), None)
    return f"{last} ({memory})" if memory is not None and memory != last else last


# -- devices ---------------------------------------------------------------------------------

_ggml: Any = None


class _DevProps(ctypes.Structure):
    """`struct ggml_backend_dev_props` of the llama.cpp this package pins."""

    _fields_ = [("name", ctypes.c_char_p), ("description", ctypes.c_char_p),
                ("memory_free", ctypes.c_size_t), ("memory_total", ctypes.c_size_t),
                ("type", ctypes.c_int), ("device_id", ctypes.c_char_p),
                ("caps", ctypes.c_bool * 5)]


def _ggml_lib() -> Any:
    """libggml (the device registry), as llama-cpp-python loads it, with the calls typed."""
    global _ggml
    if _ggml is None:
        from llama_cpp import _ggml as ggml_module

        lib = ggml_module.libggml
        vp, sz = ctypes.c_void_p, ctypes.c_size_t
        lib.ggml_backend_dev_count.argtypes, lib.ggml_backend_dev_count.restype = [], sz
        lib.ggml_backend_dev_get.argtypes, lib.ggml_backend_dev_get.restype = [sz], vp
        for name in ("ggml_backend_dev_name", "ggml_backend_dev_description"):
            getattr(lib, name).argtypes = [vp]
            getattr(lib, name).restype = ctypes.c_char_p
        lib.ggml_backend_dev_memory.argtypes = [vp, ctypes.POINTER(sz), ctypes.POINTER(sz)]
        lib.ggml_backend_dev_memory.restype = None
        lib.ggml_backend_dev_type.argtypes, lib.ggml_backend_dev_type.restype = [vp], ctypes.c_int
        lib.ggml_backend_reg_count.argtypes, lib.ggml_backend_reg_count.restype = [], sz
        lib.ggml_backend_reg_get.argtypes, lib.ggml_backend_reg_get.restype = [sz], vp
        lib.ggml_backend_reg_name.argtypes = [vp]
        lib.ggml_backend_reg_name.restype = ctypes.c_char_p
        lib.ggml_backend_reg_dev_count.argtypes = [vp]
        lib.ggml_backend_reg_dev_count.restype = sz
        lib.ggml_backend_reg_by_name.argtypes = [ctypes.c_char_p]
        lib.ggml_backend_reg_by_name.restype = vp
        lib.ggml_backend_reg_get_proc_address.argtypes = [vp, ctypes.c_char_p]
        lib.ggml_backend_reg_get_proc_address.restype = vp
        lib.ggml_backend_register.argtypes, lib.ggml_backend_register.restype = [vp], None
        lib.ggml_backend_dev_backend_reg.argtypes = [vp]
        lib.ggml_backend_dev_backend_reg.restype = vp
        lib.ggml_backend_dev_get_props.argtypes = [vp, ctypes.POINTER(_DevProps)]
        lib.ggml_backend_dev_get_props.restype = None
        _ggml = lib
    return _ggml


def _device_handles() -> list[int]:
    lib = _ggml_lib()
    return [int(lib.ggml_backend_dev_get(i) or 0) for i in range(lib.ggml_backend_dev_count())]


def list_devices() -> list[Device]:
    """The devices llama.cpp sees, with their free and total memory (bytes)."""
    init_backend()
    lib = _ggml_lib()
    out = []
    for i, handle in enumerate(_device_handles()):
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        lib.ggml_backend_dev_memory(handle, ctypes.byref(free), ctypes.byref(total))
        kind = int(lib.ggml_backend_dev_type(handle))
        reg = lib.ggml_backend_dev_backend_reg(handle)
        props = _DevProps()
        lib.ggml_backend_dev_get_props(handle, ctypes.byref(props))
        out.append(Device(
            index=i, name=(lib.ggml_backend_dev_name(handle) or b"?").decode(),
            description=(lib.ggml_backend_dev_description(handle) or b"").decode(),
            kind=_DEVICE_KINDS[kind] if 0 <= kind < len(_DEVICE_KINDS) else str(kind),
            free=int(free.value), total=int(total.value),
            backend=(lib.ggml_backend_reg_name(reg) or b"").decode() if reg else "",
            device_id=(props.device_id or b"").decode(errors="replace")))
    return out


def rpc_function(name: bytes) -> int:
    """The address of one of llama.cpp's RPC backend functions (`ggml_backend_rpc_add_server`,
    `..._start_server`); RpcError when this llama.cpp has no RPC backend."""
    lib = _ggml_lib()
    reg = lib.ggml_backend_reg_by_name(b"RPC")
    address = lib.ggml_backend_reg_get_proc_address(reg, name) if reg else None
    if not address:
        raise RpcError("this llama.cpp was built without its RPC backend; build "
                       "llama-cpp-python with CMAKE_ARGS=\"-DGGML_RPC=on\" (docs/gpu.md)")
    return int(address)


_RPC_ADD_SERVER = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_char_p)
_rpc_servers: list[str] = []  # registered in this process, in order (RPC0, RPC1, ...)
_rpc_lock = threading.Lock()
RPC_NOTE_S = 2.0  # a server still silent after this is said to be waited for


def add_rpc_servers(endpoints: Sequence[str], timeout: float = 30.0,
                    note: Optional[Callable[[str], None]] = None) -> None:
    """llama.cpp RPC servers (`host:port`, llama-server's `--rpc`) as devices of this process:
    each server's devices join the list as RPC0, RPC1, ... (GPUs to llama.cpp, whatever the
    server computes on). Registering one again does nothing; servers before one that fails
    stay registered.

    RpcError, before anything is registered for that server, when this llama.cpp has no RPC
    backend or nothing listens at the address (llama.cpp's client ends the process when it
    cannot connect), and when the server does not answer within `timeout` seconds: it serves
    one process at a time, and llama.cpp's handshake waits for it without a limit, so the
    handshake runs on a thread of its own (`note` is told, after RPC_NOTE_S, that it waits;
    default: a line on stderr).
    An address where something else than an RPC server answers ends the process (llama.cpp's
    client aborts on the malformed answer)."""
    init_backend()
    lib = _ggml_lib()
    with _rpc_lock:
        todo = [e for e in dict.fromkeys(endpoints) if e not in _rpc_servers]
        if not todo:
            return
        try:
            add = rpc_function(b"ggml_backend_rpc_add_server")
        except RpcError as exc:
            raise RpcError(f"--rpc: {exc}") from None
        for endpoint in todo:
            host, _, port = endpoint.partition(":")
            try:  # IPv4, as llama.cpp's client resolves the host
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
                    probe.settimeout(min(timeout, 5.0))
                    probe.connect((host, int(port)))
            except socket.timeout:
                raise RpcError(_busy(endpoint, "accept a connection", min(timeout, 5.0))) \
                    from None
            except (OSError, ValueError) as exc:
                raise RpcError(f"--rpc: no RPC server answers at {endpoint} ({exc})") from None
            server = _handshake(_RPC_ADD_SERVER(add), endpoint, timeout, note)
            if not server:
                raise RpcError(f"--rpc: the RPC server at {endpoint} offers no device")
            lib.ggml_backend_register(server)
            _rpc_servers.append(endpoint)


def _handshake(add: Any, endpoint: str, timeout: float,
               note: Optional[Callable[[str], None]]) -> int:
    """`ggml_backend_rpc_add_server(endpoint)` on a thread, waited for at most `timeout` s
    (a thread left waiting holds llama.cpp's lock of RPC servers until the server answers)."""
    done: list[int] = []
    worker = threading.Thread(target=lambda: done.append(int(add(endpoint.encode()) or 0)),
                              name=f"rpc-hello-{endpoint}", daemon=True)
    worker.start()
    worker.join(min(RPC_NOTE_S, timeout))
    if worker.is_alive():
        said = f"waiting for the RPC server at {endpoint}: it serves one process at a time"
        if note is None:
            print(f"skippy-scheduler: {said}", file=sys.stderr, flush=True)
        else:
            note(said)
    worker.join(max(0.0, timeout - RPC_NOTE_S))
    if worker.is_alive():
        raise RpcError(_busy(endpoint, "answer", timeout))
    return done[0]


def _busy(endpoint: str, what: str, seconds: float) -> str:
    return (f"--rpc: the RPC server at {endpoint} did not {what} within {seconds:g} s (it "
            "serves one process at a time: is another process using it?)")


def backends() -> list[tuple[str, int]]:
    """llama.cpp's backends (CPU, CUDA, ...) with the number of devices each found."""
    init_backend()
    lib = _ggml_lib()
    out = []
    for i in range(lib.ggml_backend_reg_count()):
        reg = lib.ggml_backend_reg_get(i)
        out.append(((lib.ggml_backend_reg_name(reg) or b"?").decode(),
                    int(lib.ggml_backend_reg_dev_count(reg))))
    return out


def no_gpu_reason() -> str:
    """Why llama.cpp would see no GPU: no GPU backend in this build, or one that found no
    device (with its complaint from the log, e.g. a driver older than the CUDA runtime).
    Meaningful only where no device is a GPU."""
    return describe_no_gpu(backends(), recent_log(32))


def load_model(path: str, placement: Placement | None = None) -> Any:
    """The model at `path`, its layers where `placement` says (None: all on the CPU);
    RuntimeError with llama.cpp's complaint otherwise."""
    mparams = _ll.llama_model_default_params()
    keep: list[Any] = []  # arrays llama.cpp reads during the load
    if placement is None or not placement.on_gpu:
        mparams.n_gpu_layers = 0
        if placement is not None and placement.cpu_only:  # no device at all, not even for ops
            none = (ctypes.c_void_p * 1)(None)
            keep.append(none)
            mparams.devices = ctypes.cast(none, ctypes.c_void_p)
    else:
        mparams.n_gpu_layers = placement.n_gpu_layers
        mparams.split_mode = _SPLIT_MODES[placement.split_mode]
        by_name = {d.name: h for d, h in zip(list_devices(), _device_handles())}
        chosen = [by_name[name] for name in placement.gpus]
        devices = (ctypes.c_void_p * (len(chosen) + 1))(*chosen, None)
        keep.append(devices)
        mparams.devices = ctypes.cast(devices, ctypes.c_void_p)
        # With the device list given, the main GPU is an index into it: the one kept.
        mparams.main_gpu = 0 if placement.split_mode == "none" else placement.main_gpu
        if placement.tensor_split:
            n = int(_ll.llama_max_devices())
            split = (ctypes.c_float * n)(*placement.tensor_split[:n])
            keep.append(split)
            mparams.tensor_split = split
    mark = log_mark()
    model = _ll.llama_model_load_from_file(path.encode(), mparams)
    del keep
    if not model:
        raise LlamaLoadError(f"llama.cpp could not load {path}: {failure_reason(mark)}")
    return model


def create_context(model: Any, *, n_ctx: int, n_batch: int, n_ubatch: int, sequence_ids: int,
                   n_threads: int, kv_type: str, flash_attn: bool | int, unified: bool,
                   cb_eval: Any = None) -> Any:
    """A context as asked (NULL when llama.cpp cannot make one); it may get less than asked,
    so read its sizes back (`llama_n_batch`, `llama_n_ctx`, ...). `cb_eval`: a graph
    evaluation callback (`ggml_backend_sched_eval_callback`; the caller keeps it alive)."""
    # Fields are set by name: the struct layout changes between llama.cpp versions.
    cparams = _ll.llama_context_default_params()
    cparams.n_ctx = n_ctx
    cparams.n_batch = n_batch
    cparams.n_ubatch = n_ubatch
    cparams.n_seq_max = sequence_ids
    # NOTE: llama.cpp reserves one output row per sequence id at creation and asserts that
    # this fits its output limit, which defaults to n_batch: with fewer batch tokens than
    # sequence ids (a 3-token batch over 4 lanes) the context aborts the process. A plan
    # never samples more rows than it has tokens, so raising the limit to the id count only
    # sizes the reserve llama.cpp makes anyway.
    cparams.n_outputs_max = max(n_batch, sequence_ids)
    cparams.n_threads = n_threads
    cparams.n_threads_batch = n_threads
    # flash_attn: a bool, or llama_flash_attn_type (-1 auto, 0 off, 1 on)
    cparams.flash_attn_type = int(flash_attn) if not isinstance(flash_attn, bool) \
        else (1 if flash_attn else 0)
    cparams.type_k = KV_TYPES[kv_type]
    cparams.type_v = KV_TYPES[kv_type]
    cparams.kv_unified = unified
    cparams.embeddings = False
    cparams.no_perf = True
    if cb_eval is not None:
        cparams.cb_eval = cb_eval
        cparams.cb_eval_user_data = None
    return _ll.llama_init_from_model(model, cparams)
