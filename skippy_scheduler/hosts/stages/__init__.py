"""The stage host: a model split by layer range across processes, driven by one plan per step.

* `split`: cut a GGUF model into stage files (`skippy-scheduler split`).
* `wire`: the plan, activation and output frames (docs/wire-format.md).
* `runner`: one stage's layers on llama.cpp (`StageRunner`).
* `worker`: a stage behind a pyzmq socket (`skippy-scheduler stage`).
* `host`: the engine's host that drives the workers (`StageHost`; `local`: `LocalStages`).
* `opening`: the host a driver asks for (`open_stage_host`: local workers or running ones).

A host like the llama host: the server's side of a staged model (its engine runner, the
stages' metrics) is skippy_scheduler/serve/staged.py, and nothing here imports the server.
Only `split` and `wire` are imported here; the others need llama.cpp and pyzmq.
"""
from __future__ import annotations

from .split import SplitError, StageInfo, read_stage_info, split_model
from .wire import WireError, decode_plan, encode_plan

__all__ = ["SplitError", "StageInfo", "WireError", "decode_plan", "encode_plan",
           "read_stage_info", "split_model"]
