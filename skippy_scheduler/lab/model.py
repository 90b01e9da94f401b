"""Simulated requests, the virtual cost model and the reference request generators (§5.2-§5.4).

The lab never runs a model: a request is a prompt length, an output length and an arrival time,
and the time an iteration takes comes from a `StepCost` (by default `LAB_COST`). Prompt token ids
are synthetic (`token_offset + i`), so two requests share a prompt prefix exactly when their
offsets are equal.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable

from .._validate import I32_MAX, I32_MIN, U32_MAX, check_int, check_uint
from ..cache_policy import CacheAffinity, StageCacheAffinity
from ..types import PrefixRestore, PrefixRestoreKind, Sequence

if TYPE_CHECKING:  # pragma: no cover
    from ..radix import UnifiedRadixCache
from ..cost_model import LAB_COST as LAB_COST  # re-exported: the lab's cost model
from ..cost_model import StepCost as StepCost


@dataclass
class SimRequest:
    """One simulated request: arrival time (µs), prompt and output lengths, optional prefix hit."""

    id: str
    arrival_us: int
    prompt_tokens: int
    output_tokens: int
    prefix_tokens: int = 0  # prompt tokens restored from a resident prefix (free in the model)
    priority: int = 0
    token_offset: int = 0  # first prompt token id; equal offsets mean shared prompts
    cache_affinity: CacheAffinity = field(default_factory=CacheAffinity)

    def __post_init__(self) -> None:
        if not isinstance(self.id, str):
            raise TypeError("SimRequest.id must be a str")
        check_uint("arrival_us", self.arrival_us, exact=True)
        check_uint("prompt_tokens", self.prompt_tokens, exact=True)
        check_uint("output_tokens", self.output_tokens, U32_MAX, exact=True)
        check_uint("prefix_tokens", self.prefix_tokens, exact=True)
        check_uint("priority", self.priority, exact=True)
        check_int("token_offset", self.token_offset, I32_MIN, I32_MAX, exact=True)
        if not isinstance(self.cache_affinity, CacheAffinity):
            raise TypeError("SimRequest.cache_affinity must be a CacheAffinity")

    def with_prefix_tokens(self, prefix_tokens: int) -> "SimRequest":
        self.prefix_tokens = min(check_uint("prefix_tokens", prefix_tokens, exact=True),
                                 self.prompt_tokens)
        return self

    def with_token_offset(self, token_offset: int) -> "SimRequest":
        self.token_offset = check_int("token_offset", token_offset, I32_MIN, I32_MAX, exact=True)
        return self

    def with_cache_affinity(self, affinity: CacheAffinity) -> "SimRequest":
        if not isinstance(affinity, CacheAffinity):
            raise TypeError("affinity must be a CacheAffinity")
        self.cache_affinity = affinity
        return self

    def with_priority(self, priority: int) -> "SimRequest":
        self.priority = check_uint("priority", priority, exact=True)
        return self

    def to_sequence(self) -> Sequence:
        """The scheduler Sequence this request submits as (§5.2): its prompt, output length and
        priority, plus a resident-KV prefix restore and the cache affinity when it has them."""
        seq = Sequence(self.id, self.prompt_ids(), self.output_tokens, None, self.priority)
        if self.prefix_tokens > 0:
            seq = seq.with_prefix_restore(PrefixRestore(
                f"sim-prefix-{self.id}", self.prefix_tokens, PrefixRestoreKind.RESIDENT_KV))
        return seq.with_cache_affinity(self.cache_affinity)

    def prompt_ids(self) -> list[int]:
        """Prompt token ids: token_offset + i, saturating at 2**31 - 1 (docs/behaviour.md §5.2)."""
        start = self.token_offset
        stop = start + self.prompt_tokens
        if stop - 1 <= I32_MAX:
            return list(range(start, stop))
        head = list(range(start, I32_MAX + 1)) if start <= I32_MAX else []
        return head + [I32_MAX] * (self.prompt_tokens - len(head))


def burst_requests(n: int, prompt_tokens: int, output_tokens: int,
                   prefix_tokens: int = 0) -> list[SimRequest]:
    """n identical requests "request-0".."request-(n-1)", all arriving at 0 µs."""
    return [SimRequest(f"request-{i}", 0, prompt_tokens, output_tokens).with_prefix_tokens(prefix_tokens)
            for i in range(n)]


def staggered_prefill_requests() -> list[SimRequest]:
    """A short decoder at 0 µs, then four 1 024-token prompts arriving every millisecond."""
    requests = [SimRequest("decoder", 0, 32, 64)]
    requests += [SimRequest(f"prefill-{i}", 1_000 + 1_000 * i, 1_024, 4) for i in range(4)]
    return requests


def apply_resident_radix_affinity(cache: UnifiedRadixCache, namespace: str, stage_index: int,
                                  prefill_cost_per_token: int,
                                  requests: Iterable[SimRequest]) -> list[SimRequest]:
    """Peek the resident radix (no LRU change) for each prompt; a hit becomes a prefix restore
    plus a one-stage affinity tagged with the cache epoch. Misses are left unchanged."""
    out = list(requests)
    epoch = cache.epoch()
    for request in out:
        match = cache.peek_resident(namespace, request.prompt_ids())
        if match is None:
            continue
        request.with_prefix_tokens(min(match.matched_tokens, request.prompt_tokens))
        request.with_cache_affinity(CacheAffinity.from_stage(StageCacheAffinity(
            stage_index=stage_index, matched_tokens=request.prefix_tokens,
            prefill_cost_per_token=prefill_cost_per_token, restore_cost=0, cache_epoch=epoch)))
    return out
