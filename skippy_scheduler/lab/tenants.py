"""Per-tenant service in a lab run: tokens computed for each tenant, and how fair that was.

The lab host hands every plan to `TenantService.account` when the run has more than one tenant.
A tenant's service is the number of tokens the plans compute for it (prefill and decode rows).
The report gives each tenant's service rate while the trace is arriving (tokens computed from the
first arrival to the last, per second) and Jain's index over those rates. When the trace arrives
within about one iteration (a burst), that window holds at most one plan, which serves a few
tenants and none of the others: the rates are then over the whole run (tokens computed from the
first arrival to the end of the makespan) instead, and `window` says which it was. Under fair
share the scheduler charges its native counters itself; only a fair-share policy run from Python
(a non-default inner order) is charged here.
"""
from __future__ import annotations

import re
from typing import Any, Iterable, Optional

import numpy as np

from ..cost_model import DECODE_PHASE
from ..policies import FairShareAdmission


NO_TENANT = "(none)"  # the name of the requests of a multi-tenant trace that name no tenant


def natural_key(name: object) -> tuple[tuple[int, int, str], ...]:
    """Sort key: "t2" before "t10"."""
    return tuple((0, int(part), "") if part.isdigit() else (1, 0, part)
                 for part in re.split(r"(\d+)", str(name)) if part)


def jain_index(values: Iterable[float]) -> Optional[float]:
    """(Σx)² / (n Σx²) over the given rates; None for fewer than two."""
    x = np.asarray(list(values), dtype=np.float64)
    if len(x) < 2:
        return None
    denominator = len(x) * float((x * x).sum())
    return float(x.sum() ** 2 / denominator) if denominator > 0 else None


class TenantService:
    """Tenant names by index, and the tokens computed for each (cumulative and in the window
    that ends when the clock passes the last arrival)."""

    def __init__(self, fair_share: Optional[FairShareAdmission] = None) -> None:
        self.fair_share = fair_share
        self.names: list[Any] = []
        self._index: dict[Any, int] = {}
        self.enabled = False  # account plans (more than one tenant)
        self.service: list[float] = []  # tokens computed per tenant index
        self.window_service: Optional[list[float]] = None
        self.window_end_us: Optional[float] = None
        self.stream_done = False
        self.first_arrival_us: Optional[float] = None
        self.last_arrival_us: Optional[float] = None
        self.plans = 0  # plans accounted
        self.window_plans = 0  # of them, the ones in the window

    @property
    def window(self) -> str:
        """What the rates of `figures` are over: "arrivals" (from the first arrival to the
        first plan at or after the last one) or "run" (to the end of the makespan: the window
        never closed, or holds at most one plan, less than one iteration of service)."""
        if self.window_service is None or self.window_plans <= 1:
            return "run"
        return "arrivals"

    def arrived(self, arrival_us: float) -> None:
        """A request of the trace was pulled by the engine."""
        if self.first_arrival_us is None:
            self.first_arrival_us = arrival_us
        self.last_arrival_us = arrival_us

    def index(self, name: Any) -> int:
        """The index of tenant `name` (registered on first sight)."""
        k = self._index.get(name)
        if k is None:
            k = self._index[name] = len(self.names)
            self.names.append(name)
        return k

    def account(self, plan: Any, phases: bytes, tenant_of_row: list[int], now: float) -> None:
        """Add the tokens `plan` computes to each row's tenant (`tenant_of_row[i]`)."""
        # Plain Python: plans are small (most are a few decode rows), where numpy's per-call
        # overhead would cost more than the loop.
        service = self.service
        if len(service) < len(self.names):
            service.extend([0.0] * (len(self.names) - len(service)))
        if self.window_service is None and self.stream_done \
                and self.last_arrival_us is not None and now >= self.last_arrival_us:
            self.window_service = list(service)
            self.window_end_us = now
            self.window_plans = self.plans
        self.plans += 1
        served: dict[int, list[int]] = {}
        if phases.count(DECODE_PHASE) == len(phases):
            for t in tenant_of_row:
                service[t] += 1
                entry = served.get(t)
                if entry is None:
                    served[t] = [0, 1]
                else:
                    entry[1] += 1
        else:
            offsets = plan.row_offsets.tolist()
            for i, t in enumerate(tenant_of_row):
                tokens = offsets[i + 1] - offsets[i]
                service[t] += tokens
                entry = served.setdefault(t, [0, 0])
                entry[1 if phases[i] == DECODE_PHASE else 0] += tokens
        fair = self.fair_share
        if fair is not None and fair.native_kind is None:
            names = self.names
            for t, (prefill, decode) in served.items():
                fair.charge(names[t], prefill, decode)

    def figures(self, makespan_us: float) -> tuple[int, dict[str, float], Optional[float]]:
        """(tenants, service rate per tenant in natural name order, Jain's index)."""
        if not self.enabled:
            return 1, {}, None
        if not self.names:
            return 0, {}, None
        arrivals = self.window == "arrivals"
        window = np.asarray(self.window_service if arrivals else self.service,
                            dtype=np.float64)
        end = self.window_end_us if arrivals and self.window_end_us is not None \
            else makespan_us
        start = self.first_arrival_us or 0.0
        span_s = max(end - start, 1.0) / 1e6
        rates = np.zeros(len(self.names))
        rates[:len(window)] = window / span_s
        names = [NO_TENANT if name is None else str(name) for name in self.names]
        tenants = {name: float(rate) for name, rate in
                   sorted(zip(names, rates), key=lambda item: natural_key(item[0]))}
        return len(self.names), tenants, jain_index(rates)
