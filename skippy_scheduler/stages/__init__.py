"""Staged serving: a model split by layer range across processes, driven by one plan per step.

* `split`: cut a GGUF model into stage files (`skippy-scheduler split`).
* `wire`: the plan, activation and output frames (docs/wire-format.md).
* `runner`: one stage's layers on llama.cpp (`StageRunner`).
* `worker`: a stage behind a pyzmq socket (`skippy-scheduler stage`).
* `host`: the engine's host that drives the workers (`StageHost`, `LocalStages`).

Only `split` and `wire` are imported here; the others need llama.cpp and pyzmq.
"""
from __future__ import annotations

from .split import SplitError, StageInfo, read_stage_info, split_model
from .wire import WireError, decode_plan, encode_plan

__all__ = ["SplitError", "StageInfo", "WireError", "decode_plan", "encode_plan",
           "read_stage_info", "split_model"]
