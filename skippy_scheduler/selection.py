"""What a user picks by name: the admission policy and the scheduler implementation.

This is the one name -> policy table and the one native-or-twin selector of the package: the
command line (`--policy`, `--scheduler`), the lab, the server and the benchmarks all resolve
names here, so a name means the same policy wherever it is typed.

Policies (`make_admission`):

* `fcfs`: arrival order (`FcfsAdmission`);
* `cache-aware-aging`: the scheduler's default order, cached-prefix savings plus an aging credit
  per turn (`CacheAwareAdmission()`);
* `cache-aware-noaging`: the same without the aging credit (`aging_cost_per_turn=0`);
* `priority`: explicit priority, then arrival (`PriorityAdmission`);
* `fair-share`: the least-served tenant first, cache-aware within a tenant
  (`FairShareAdmission`); with a single tenant it is the cache-aware order.

Implementations (`scheduler_class`): `native` is `Scheduler` (the C core), `twin` the pure-Python
`TwinScheduler` with the same behaviour (the oracle of the tests, and handy for debugging).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Hashable, Mapping, Optional

if TYPE_CHECKING:  # pragma: no cover
    from .policies import AdmissionPolicy

# In the order the lab runs and reports them.
POLICIES: tuple[str, ...] = ("fcfs", "cache-aware-noaging", "cache-aware-aging", "priority",
                             "fair-share")
DEFAULT_POLICY = "cache-aware-aging"  # what a scheduler built without a policy uses
# Spellings of earlier releases, still accepted (the command line warns): old -> current.
OLD_POLICY_NAMES: dict[str, str] = {"cache-aware": "cache-aware-aging"}

IMPLEMENTATIONS: tuple[str, ...] = ("native", "twin")
DEFAULT_IMPLEMENTATION = "native"


def policy_name(name: str) -> str:
    """The current name of a policy (an old spelling is translated); ValueError if unknown."""
    name = OLD_POLICY_NAMES.get(name, name)
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r} (choose from {', '.join(POLICIES)})")
    return name


def make_admission(name: str,
                   tenant_weights: Optional[Mapping[Hashable, float]] = None) -> AdmissionPolicy:
    """A fresh admission policy object for `name` (policies hold per-run state: one per run).

    tenant_weights: fair-share weights by tenant (default 1 each); refused for other policies.
    """
    from . import policies

    name = policy_name(name)
    if tenant_weights is not None and name != "fair-share":
        raise ValueError(f"tenant weights apply to fair-share, not to {name}")
    if name == "fcfs":
        return policies.FcfsAdmission()
    if name == "cache-aware-noaging":
        return policies.CacheAwareAdmission(aging_cost_per_turn=0)
    if name == "cache-aware-aging":
        return policies.CacheAwareAdmission()
    if name == "priority":
        return policies.PriorityAdmission()
    return policies.FairShareAdmission(tenant_weights)


def scheduler_class(name: str = DEFAULT_IMPLEMENTATION) -> Any:
    """`Scheduler` for "native", `TwinScheduler` for "twin"; ValueError for anything else."""
    if name == "native":
        from ._core import Scheduler

        return Scheduler
    if name == "twin":
        from .reference import TwinScheduler

        return TwinScheduler
    raise ValueError(f"unknown scheduler implementation {name!r} "
                     f"(choose from {', '.join(IMPLEMENTATIONS)})")


def make_scheduler(config: Any, *, policy: str = DEFAULT_POLICY,
                   implementation: str = DEFAULT_IMPLEMENTATION, **kwargs: Any) -> Any:
    """A scheduler of `implementation` with the admission policy named `policy`."""
    return scheduler_class(implementation)(config, admission=make_admission(policy), **kwargs)


__all__ = ["DEFAULT_IMPLEMENTATION", "DEFAULT_POLICY", "IMPLEMENTATIONS", "OLD_POLICY_NAMES",
           "POLICIES", "make_admission", "make_scheduler", "policy_name", "scheduler_class"]
