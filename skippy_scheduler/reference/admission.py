"""The reference scheduler's admission order (behaviour.md §2.3, §3, §3.6).

Owns `AdmissionOrder`: the resolved admission policy that ranks the waiting queue and, when the
policy is the core's fair share, this scheduler's own service counters and the tenants it has
seen (charged per completed row, weighted by `set_tenant_weight`).
"""
from __future__ import annotations

from typing import Hashable, Optional

from .._validate import sat_sub
from ..cache_policy import CacheAwareCandidate
from ..policies import AdmissionKind, AdmissionPolicy, FairShareAdmission, VirtualTokenCounters
from ..types import IterationPhase, IterationWork, Sequence


class AdmissionOrder:
    """Ranks waiting sequences with `policy`; runs fair share as the native core does."""

    def __init__(self, policy: AdmissionPolicy) -> None:
        self.policy = policy
        # Fair share as the core runs it (AdmissionKind.FAIR_SHARE): counters seeded with the
        # policy's settings, and the tenants seen (submitted or weighted), None first.
        self._fair: Optional[FairShareAdmission] = None
        self._tenants: dict[Hashable, None] = {}
        if type(policy) is FairShareAdmission and policy.native_kind == AdmissionKind.FAIR_SHARE:
            self._fair = FairShareAdmission(within=policy.within, counters=policy.counters.blank())
            self._tenants = dict.fromkeys([None, *policy.counters.weights])

    def tenant_of(self, s: Sequence) -> Hashable:
        """Whose service `s` is under fair share (None otherwise); the tenant is now seen."""
        if self._fair is None:
            return None
        tenant = FairShareAdmission.tenant_of_sequence(s)
        self._tenants.setdefault(tenant, None)
        return tenant

    def rank(self, waiting: list[Sequence], turn: int, tenants: list[Hashable],
             requests: list[int]) -> list[Sequence]:
        """`waiting` in admission order. `tenants[i]` / `requests[i]` name whose service the
        i-th one is and which submission (fair share's lift rule); ValueError / TypeError when
        a user policy returns no permutation (nothing has changed then)."""
        candidates = [
            CacheAwareCandidate(
                index=i,
                priority=s.priority,
                affinity=s.cache_affinity,
                prompt_tokens=tuple(s.prompt_tokens),  # a policy cannot edit the queue's prompts
                enqueued_turn=s.enqueued_turn,
                order=s.enqueue_order,
                tenant=s.tenant,
                ttft_deadline=s.ttft_deadline,
            )
            for i, s in enumerate(waiting)
        ]
        if self._fair is not None:
            order = self._fair.rank(
                candidates, turn, tenants, requests,
                [sat_sub(len(s.prompt_tokens),
                         s.prefix_restore.token_count if s.prefix_restore is not None else 0)
                 for s in waiting])
        else:
            order = self.policy.order(candidates, turn)
        try:
            order = [int(i) for i in order]
        except (TypeError, ValueError):
            raise TypeError("admission policy must return a list of candidate indexes") from None
        if sorted(order) != list(range(len(candidates))):
            raise ValueError("admission policy must return a permutation of the candidate indexes")
        return [waiting[i] for i in order]

    @property
    def fair(self) -> bool:
        return self._fair is not None

    def charge(self, row: IterationWork, tenant: Hashable) -> None:
        """Fair share: a completed row adds its tokens to its tenant's counter (§3.6)."""
        assert self._fair is not None
        if row.phase is IterationPhase.DECODE:
            self._fair.counters.charge(tenant, 0, len(row.tokens))
        else:
            self._fair.counters.charge(tenant, len(row.tokens), 0)

    def set_tenant_weight(self, tenant: Hashable, weight: float) -> None:
        if self._fair is None:
            raise ValueError("tenant weights apply to the native fair-share admission only")
        weight = VirtualTokenCounters.check_weight("weight", weight)
        self._tenants.setdefault(tenant, None)
        self._fair.counters.weights[tenant] = weight

    def tenant_counters(self) -> dict[Hashable, float]:
        if self._fair is None:
            return {}
        return {t: self._fair.counters.counter(t) for t in self._tenants}

    @property
    def lifts(self) -> int:
        return self._fair.counters.lifts if self._fair is not None else 0
