"""The linear iteration cost model: what one plan costs a runtime, in microseconds.

    duration = iteration_overhead + prefill_token × (Prefill and Recompute tokens)
               + [any Decode row] × (decode_batch + decode_sequence × Decode rows)

(docs/behaviour.md §5.3). The lab's virtual clock charges it per plan, `calibrate` fits it to a
real runtime, and a `CostModelHost` uses it to stand in for a model. Prefix restores cost
nothing here: a restored prefix is simply not in the plan. It lives on its own so that hosts
and the engine need nothing from the lab.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, fields, replace
from typing import Any, Mapping

from .types import IterationPhase

DECODE_PHASE = IterationPhase.DECODE.value


def decode_row_count(phases: Any) -> int:
    """Decode rows of a plan from its `phases` array (uint8 values of `IterationPhase`)."""
    # NOTE: bytes.count is the cheapest exact count for the few hundred rows of a plan.
    return bytes(phases).count(DECODE_PHASE)


@dataclass(frozen=True)
class RuntimeCostModel:
    """Virtual time of one iteration, in µs (§5.3). Prefix restores are free."""

    iteration_overhead_us: float = 50
    prefill_token_us: float = 2
    decode_batch_us: float = 100
    decode_sequence_us: float = 20

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{f.name} must be a number, got {type(value).__name__}")
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{f.name} must be a finite number >= 0, got {value}")

    def duration_us(self, prompt_tokens: int, decode_rows: int) -> float:
        """Cost of an iteration with `prompt_tokens` Prefill/Recompute tokens and `decode_rows`
        Decode rows: overhead + per-token prefill + (batch + per-row) decode; at least 1 µs."""
        d = self.iteration_overhead_us + self.prefill_token_us * prompt_tokens
        if decode_rows:
            d += self.decode_batch_us + self.decode_sequence_us * decode_rows
        return d if d >= 1 else 1

    def plan_duration_us(self, plan: Any) -> float:
        """`duration_us` of a live plan, read from its arrays (phases and token count)."""
        decode_rows = decode_row_count(plan.phases)
        return self.duration_us(int(plan.token_count) - decode_rows, decode_rows)

    def as_dict(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def __str__(self) -> str:
        """The `name=value,...` form that `parse` and the lab's --cost-model accept."""
        return ",".join(f"{f.name}={_fmt_number(getattr(self, f.name))}" for f in fields(self))

    @classmethod
    def parse(cls, spec: str) -> "RuntimeCostModel":
        """Build from `name=value,...` overrides or from the path of a JSON object file."""
        if os.path.exists(spec):
            with open(spec, encoding="utf-8") as fh:
                data = json.load(fh)
            if not isinstance(data, Mapping):
                raise ValueError(f"{spec}: the cost model file must hold a JSON object")
            return cls.from_mapping(data)
        values: dict[str, object] = {}
        for part in spec.split(","):
            part = part.strip()
            if not part:
                continue
            name, sep, text = part.partition("=")
            if not sep:
                raise ValueError(f"cost model override {part!r} is not name=value")
            try:
                number: object = int(text)
            except ValueError:
                try:
                    number = float(text)
                except ValueError:
                    raise ValueError(f"cost model value {text!r} for {name} is not a number") from None
            values[name.strip()] = number
        return cls.from_mapping(values)

    @classmethod
    def from_mapping(cls, values: Mapping[str, object]) -> "RuntimeCostModel":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown cost model field(s): {', '.join(unknown)} "
                             f"(known: {', '.join(sorted(known))})")
        # __post_init__ checks every value.
        return replace(cls(), **values)  # type: ignore[arg-type]


def _fmt_number(value: float) -> str:
    text = f"{value:.3f}".rstrip("0").rstrip(".")
    return text or "0"
