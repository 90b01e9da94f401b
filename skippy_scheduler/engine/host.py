"""What a runtime implements to be driven by the `Engine` (docs/hosts.md).

A host runs plans. It must have two verbs:

* `execute(plan)`: run the plan's rows and write one sampled output per sampling row into
  `plan.outputs` (work index, token; a negative token ends the sequence), then set
  `plan.outputs.count`. A sampling row left without an entry fails its sequence.
* `release(sequence_id)`: free whatever the runtime holds for a sequence (KV cells, a lane).
  The engine calls it when a sequence finishes, fails or is cancelled, and for every id that a
  preemption returns (its KV is gone; it will recompute).

and may have two optional hooks, found by name:

* `prepare_sequence(sequence) -> Sequence`: called at submit; the host may return the sequence
  with a `PrefixRestore` and a `CacheAffinity` for the prefix it holds resident.
* `memory_used() -> list[int] | None`: measured bytes per configured memory component, asked
  after every completion; the engine hands it to `preempt_for_component_pressure` and
  releases the victims on the host. `None` means "nothing measured this time".

`CostModelHost` is the model-free host of the lab, the benchmarks and the tests.
"""
from __future__ import annotations

from typing import Any, Optional, Protocol, Sequence as _Seq, runtime_checkable

from ..types import Sequence


@runtime_checkable
class Host(Protocol):
    """The two verbs every runtime has (see the module docstring)."""

    def execute(self, plan: Any) -> None:
        """Run `plan` and write its sampled outputs into `plan.outputs`."""

    def release(self, sequence_id: str) -> None:
        """Free the runtime state of `sequence_id` (finish, failure, cancel, preemption)."""


@runtime_checkable
class PrefixRestoringHost(Host, Protocol):
    """A host that can restore resident prefixes into new sequences."""

    def prepare_sequence(self, sequence: Sequence) -> Sequence:
        """`sequence`, with a prefix restore and cache affinity for what is resident."""


@runtime_checkable
class MemoryReportingHost(Host, Protocol):
    """A host that measures what its memory components hold."""

    def memory_used(self) -> Optional[_Seq[int]]:
        """Measured bytes per memory component, in the config's order (or None)."""


class CostModelHost:
    """A stand-in runtime: samples a fixed token (or echoes each row's last input token).

    `token=None` makes the "model" predict each sampling row's last input token, which keeps a
    token that a workload planted at the end of a prompt flowing through the decode rows. The
    host itself takes no time: run it under `VirtualClock(cost_model)`, which charges each plan.
    """

    def __init__(self, token: Optional[int] = 1) -> None:
        if token is not None and (isinstance(token, bool) or not isinstance(token, int)):
            raise TypeError(f"token must be an int or None, got {type(token).__name__}")
        self.token = token

    def execute(self, plan: Any) -> None:
        rows = plan.sample_rows
        k = len(rows)
        out = plan.outputs
        out.request_indexes[:k] = rows
        if self.token is None:
            if k == len(plan) and plan.token_count == k:
                out.predicted_tokens[:k] = plan.tokens  # one token per row (decode)
            elif k:
                out.predicted_tokens[:k] = plan.tokens[plan.row_offsets[1:][rows] - 1]
        else:
            out.predicted_tokens[:k] = self.token
        out.count = k

    def release(self, sequence_id: str) -> None:
        return None
