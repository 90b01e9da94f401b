"""Sequence-side types (behaviour.md §1.3); re-exported by `skippy_scheduler.types`."""
from __future__ import annotations

import enum
import warnings
from dataclasses import dataclass
from typing import Any, Hashable, Iterable

from ._validate import (
    U32_MAX,
    U64_MAX,
    USIZE_MAX,
    check_id,
    check_optional_uint,
    check_str,
    check_tokens,
    check_uint,
    sat,
    sat_sub,
)
from .cache_policy import CacheAffinity
from .sampling import check_sampling
from .slack import check_optional_seconds


# Enum classes whose members were once spelled in CamelCase: old spelling -> member name.
_OLD_SPELLINGS: dict[type, dict[str, str]] = {}


class RenamedMembers(enum.EnumMeta):
    """Metaclass of the enums whose members were renamed to Python style (`PREFILL`): the old
    CamelCase spelling (`Prefill`) still reads the member, with a DeprecationWarning."""

    def __getattr__(cls, name: str) -> Any:
        new = _OLD_SPELLINGS.get(cls, {}).get(name)
        if new is None:
            raise AttributeError(f"type object {cls.__name__!r} has no attribute {name!r}")
        warnings.warn(f"{cls.__name__}.{name} is deprecated: use {cls.__name__}.{new}",
                      DeprecationWarning, stacklevel=2)
        return cls[new]


def keep_old_spellings(cls: type[enum.Enum]) -> None:
    """Register `cls`'s CamelCase member spellings (PREFILL -> Prefill) as deprecated aliases."""
    _OLD_SPELLINGS[cls] = {m.name.title().replace("_", ""): m.name for m in cls}


class SequenceStatus(enum.Enum, metaclass=RenamedMembers):
    """Lifecycle state; the values match the C core."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED = 3
    FAILED = 4
    CANCELLED = 5  # only in `retired()` snapshots: a cancelled sequence is never submitted


class PrefixRestoreKind(enum.Enum, metaclass=RenamedMembers):
    """What a prefix restore brings back; carried only, never read by scheduling."""

    RESIDENT_KV = 0
    RECURRENT_WHOLE_STATE = 1
    KV_AND_RECURRENT_WHOLE_STATE = 2


keep_old_spellings(SequenceStatus)
keep_old_spellings(PrefixRestoreKind)


@dataclass(frozen=True)
class PrefixRestore:
    """A cached prefix of `token_count` prompt tokens the runtime restores instead of prefilling."""

    page_id: str
    token_count: int
    kind: PrefixRestoreKind = PrefixRestoreKind.RESIDENT_KV

    def __post_init__(self) -> None:
        check_str("page_id", self.page_id)
        object.__setattr__(self, "token_count", check_uint("token_count", self.token_count, USIZE_MAX))
        if not isinstance(self.kind, PrefixRestoreKind):
            raise TypeError(f"kind must be a PrefixRestoreKind, got {type(self.kind).__name__}")


_FIELDS = (
    "id",
    "prompt_tokens",
    "generated_tokens",
    "max_tokens",
    "sampling",
    "priority",
    "admission_tokens",
    "status",
    "prefix_restore",
    "cache_affinity",
    "admitted_at",
    "prefill_cursor",
    "enqueued_turn",
    "enqueue_order",
    "tenant",
    "ttft_deadline",
    "itl_target",
)


def _check_tenant(tenant: Hashable) -> Hashable:
    try:
        hash(tenant)
    except TypeError:
        raise TypeError(f"tenant must be hashable, got {type(tenant).__name__}") from None
    return tenant


class Sequence:
    """One generation request and its progress.

    `prefill_cursor` counts the replay tokens (prompt + generated[:-1]) already fed to the model;
    `enqueued_turn` and `enqueue_order` are set by `submit`. `tenant` (any hashable, None by
    default) names whose service the request is, for fair-share admission. Builders modify the
    sequence and return it, so they chain. `ttft_deadline` (seconds on the scheduler's clock)
    and `itl_target` (seconds) are the request's own deadlines, None by default: the slack rule
    reads `itl_target` (§2.13); cache-aware admission reads `ttft_deadline`, nearer first
    among waiting sequences of equal priority and score (§3.3a).
    """

    __slots__ = _FIELDS

    def __init__(
        self,
        id: str,  # noqa: A002 - the public field name
        prompt_tokens: Iterable[int],
        max_tokens: int,
        sampling: Any = None,
        priority: int = 0,
        tenant: Hashable = None,
    ) -> None:
        self.id = check_id("id", id)
        self.prompt_tokens = check_tokens("prompt_tokens", prompt_tokens)
        self.generated_tokens: list[int] = []
        self.max_tokens = check_uint("max_tokens", max_tokens, U32_MAX)
        self.sampling = check_sampling(sampling)
        self.priority = check_uint("priority", priority, U64_MAX)
        self.admission_tokens = sat(len(self.prompt_tokens) + self.max_tokens)
        self.status = SequenceStatus.WAITING
        self.prefix_restore: PrefixRestore | None = None
        self.cache_affinity = CacheAffinity()
        self.admitted_at: int | None = None
        self.prefill_cursor = 0
        self.enqueued_turn = 0
        self.enqueue_order = 0
        self.tenant = _check_tenant(tenant)
        self.ttft_deadline: float | None = None
        self.itl_target: float | None = None

    # -- builders -----------------------------------------------------------------------------

    def with_admission_tokens(self, admission_tokens: int) -> "Sequence":
        tokens = check_uint("admission_tokens", admission_tokens, USIZE_MAX)
        self.admission_tokens = max(tokens, len(self.prompt_tokens))
        return self

    def with_prefix_restore(self, restore: PrefixRestore) -> "Sequence":
        if not isinstance(restore, PrefixRestore):
            raise TypeError(f"restore must be a PrefixRestore, got {type(restore).__name__}")
        # Keep the last replay token runnable so the runtime produces logits for it.
        self.prefill_cursor = min(restore.token_count, sat_sub(self.recompute_token_count(), 1))
        self.prefix_restore = restore
        return self

    def with_cache_affinity(self, affinity: CacheAffinity) -> "Sequence":
        if not isinstance(affinity, CacheAffinity):
            raise TypeError(f"affinity must be a CacheAffinity, got {type(affinity).__name__}")
        self.cache_affinity = affinity
        return self

    def with_tenant(self, tenant: Hashable) -> "Sequence":
        self.tenant = _check_tenant(tenant)
        return self

    def with_deadlines(self, *, ttft_deadline: float | None = None,
                       itl_target: float | None = None) -> "Sequence":
        """Its first-token deadline (seconds on the scheduler's clock, see `set_clock`) and its
        inter-token target (seconds); None leaves one unset."""
        self.ttft_deadline = check_optional_seconds("ttft_deadline", ttft_deadline)
        self.itl_target = check_optional_seconds("itl_target", itl_target)
        return self

    def with_prefilled_generation(self, tokens: Iterable[int]) -> "Sequence":
        generated = check_tokens("generated_tokens", tokens)
        if not generated:
            # An empty generation would leave nothing runnable (§0.4b).
            raise ValueError("with_prefilled_generation needs at least one token")
        self.generated_tokens = generated
        self.prefill_cursor = self.recompute_token_count()
        return self

    # -- queries ------------------------------------------------------------------------------

    def is_finished(self) -> bool:
        """True once the sequence has left the scheduler (finished, failed or cancelled)."""
        return self.status in (SequenceStatus.FINISHED, SequenceStatus.FAILED,
                               SequenceStatus.CANCELLED)

    def recompute_tokens(self) -> list[int]:
        """Prompt plus every generated token except the pending (last) one."""
        return list(self.prompt_tokens) + list(self.generated_tokens[:-1])

    def recompute_token_count(self) -> int:
        return len(self.prompt_tokens) + max(len(self.generated_tokens) - 1, 0)

    def pending_decode_token(self) -> int | None:
        return self.generated_tokens[-1] if self.generated_tokens else None

    # -- comparison and display -------------------------------------------------------------

    def _values(self) -> tuple[Any, ...]:
        return tuple(
            list(v) if isinstance(v, tuple) else v for v in (getattr(self, f) for f in _FIELDS)
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence):
            return NotImplemented
        return self._values() == other._values()

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(id={self.id!r}, prompt={len(self.prompt_tokens)} tokens, "
            f"generated={list(self.generated_tokens)!r}, max_tokens={self.max_tokens}, "
            f"priority={self.priority}, status={self.status.name}, cursor={self.prefill_cursor})"
        )

    # -- scheduler support --------------------------------------------------------------------

    def _validated_copy(self) -> "Sequence":
        """An independent copy with every (public, mutable) field checked again."""
        copy = Sequence.__new__(Sequence)
        copy.id = check_id("id", self.id)
        copy.prompt_tokens = check_tokens("prompt_tokens", self.prompt_tokens)
        copy.generated_tokens = check_tokens("generated_tokens", self.generated_tokens)
        copy.max_tokens = check_uint("max_tokens", self.max_tokens, U32_MAX)
        copy.sampling = check_sampling(self.sampling)
        copy.priority = check_uint("priority", self.priority, U64_MAX)
        # Never below the prompt (as `with_admission_tokens` sets it; the core does the same).
        copy.admission_tokens = max(check_uint("admission_tokens", self.admission_tokens,
                                               USIZE_MAX), len(copy.prompt_tokens))
        if not isinstance(self.status, SequenceStatus):
            raise TypeError(f"status must be a SequenceStatus, got {type(self.status).__name__}")
        if self.status is SequenceStatus.CANCELLED:
            raise ValueError("a cancelled sequence cannot be submitted (status Cancelled)")
        copy.status = self.status
        if self.prefix_restore is not None and not isinstance(self.prefix_restore, PrefixRestore):
            raise TypeError("prefix_restore must be a PrefixRestore or None")
        copy.prefix_restore = self.prefix_restore
        if not isinstance(self.cache_affinity, CacheAffinity):
            raise TypeError("cache_affinity must be a CacheAffinity")
        copy.cache_affinity = self.cache_affinity
        copy.admitted_at = check_optional_uint("admitted_at", self.admitted_at)
        copy.prefill_cursor = check_uint("prefill_cursor", self.prefill_cursor, USIZE_MAX)
        copy.enqueued_turn = check_uint("enqueued_turn", self.enqueued_turn)
        copy.enqueue_order = check_uint("enqueue_order", self.enqueue_order)
        copy.tenant = _check_tenant(self.tenant)
        copy.ttft_deadline = check_optional_seconds("ttft_deadline", self.ttft_deadline)
        copy.itl_target = check_optional_seconds("itl_target", self.itl_target)
        return copy

    def _snapshot(self, status: "SequenceStatus | None" = None) -> "Sequence":
        values = {name: getattr(self, name) for name in _FIELDS}
        if status is not None:
            values["status"] = status
        return Sequence._frozen_snapshot(**values)

    @classmethod
    def _frozen_snapshot(cls, **values: Any) -> "Sequence":
        """A read-only sequence built from field values (lists become tuples)."""
        missing = set(_FIELDS) - values.keys()
        unknown = values.keys() - set(_FIELDS)
        if missing or unknown:
            raise TypeError(f"snapshot fields mismatch: missing {sorted(missing)}, unknown {sorted(unknown)}")
        snap = _FrozenSequence.__new__(_FrozenSequence)
        for name in _FIELDS:
            value = values[name]
            if name in ("prompt_tokens", "generated_tokens"):
                value = tuple(value)
            object.__setattr__(snap, name, value)
        return snap


class _FrozenSequence(Sequence):
    """Read-only view of a scheduler's sequence, returned by `Scheduler.sequence(id)`."""

    __slots__ = ()

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"sequence snapshots are read-only (cannot set {name!r})")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"sequence snapshots are read-only (cannot delete {name!r})")
