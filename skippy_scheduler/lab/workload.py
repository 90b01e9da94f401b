"""Seeded synthetic workloads for the suite: Poisson arrivals, heavy-tailed lengths, prompt
families that share a prefix (a few hot, many cold), and a share of high-priority requests.

Everything is drawn from one `numpy.random.Generator(PCG64(seed))`, so a (spec, seed) pair
always gives the same trace. Lengths are lognormal and clipped, which gives the long right
tail real prompt and answer lengths have without unbounded outliers.

Token ids encode who a token belongs to (the suite relies on it to map plan rows back to
requests without reading row objects):
* family f's shared prefix: FAMILY_BASE + f * FAMILY_STRIDE + i
* request r's own suffix:   SUFFIX_BASE + r * SUFFIX_STRIDE + i
* request r's last prompt token, and every token the fake runtime samples for it: MARKER_BASE + r
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

FAMILY_BASE = 0
FAMILY_STRIDE = 8_192
SUFFIX_BASE = 100_000_000
SUFFIX_STRIDE = 4_096
MARKER_BASE = 1_500_000_000
MAX_REQUESTS = 200_000
# The longest a workload may span: arrivals are whole µs, exact in a float64 to 2^53.
MAX_SPAN_S = 2.0 ** 53 / 1e6 / 100
MAX_FAMILIES = 10_000
MAX_PREFIX = FAMILY_STRIDE
MAX_SUFFIX = SUFFIX_STRIDE


@dataclass(frozen=True)
class WorkloadSpec:
    requests: int = 1_000
    seed: int = 0
    rate: float = 360.0  # mean arrivals per second (Poisson); near saturation by default
    families: int = 64  # prompt families; popularity is Zipf-like, so few are hot
    family_zipf: float = 1.1  # popularity exponent: weight of family k is 1 / (k+1)^s
    family_share: float = 0.7  # fraction of requests that belong to some family
    prefix_median: int = 768  # family prefix length (tokens), lognormal, clipped
    prefix_sigma: float = 0.6
    prefix_min: int = 64
    prefix_max: int = 4_096
    suffix_median: int = 128  # per-request prompt tail, lognormal, clipped
    suffix_sigma: float = 1.0
    suffix_max: int = 4_096
    output_median: int = 48  # generated tokens, lognormal, clipped
    output_sigma: float = 1.0
    output_max: int = 1_024
    priority_share: float = 0.1  # fraction of requests with priority 1 (others 0)

    def validate(self) -> "WorkloadSpec":
        if not 1 <= self.requests <= MAX_REQUESTS:
            raise ValueError(f"requests must be in [1, {MAX_REQUESTS}], got {self.requests}")
        if not (self.rate > 0 and np.isfinite(self.rate)):
            raise ValueError(f"rate must be a positive number, got {self.rate}")
        if self.requests / self.rate > MAX_SPAN_S:
            raise ValueError(f"rate {self.rate:g}/s spreads {self.requests} requests over about "
                             f"{self.requests / self.rate:.3g} s; the lab allows at most "
                             f"{MAX_SPAN_S:.3g} s (its clock counts µs): give a larger rate")
        if not 0 <= self.families <= MAX_FAMILIES:
            raise ValueError(f"families must be in [0, {MAX_FAMILIES}], got {self.families}")
        for name in ("family_share", "priority_share"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {value}")
        if not 1 <= self.prefix_min <= self.prefix_max <= MAX_PREFIX:
            raise ValueError(f"need 1 <= prefix_min <= prefix_max <= {MAX_PREFIX}")
        if not 1 <= self.suffix_max <= MAX_SUFFIX:
            raise ValueError(f"suffix_max must be in [1, {MAX_SUFFIX}]")
        if not 1 <= self.output_max <= (1 << 32) - 1:
            raise ValueError("output_max must be >= 1")
        for name in ("prefix_median", "suffix_median", "output_median"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        for name in ("prefix_sigma", "suffix_sigma", "output_sigma", "family_zipf"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0")
        return self

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Workload:
    """Column arrays, one entry per request, sorted by arrival (ids are zero-padded indexes)."""

    spec: WorkloadSpec
    arrival_us: np.ndarray  # int64
    family: np.ndarray  # int32, -1 = no family
    family_prefix: np.ndarray  # int64, prefix length of each family
    suffix_len: np.ndarray  # int64, >= 1 (the last suffix token is the request's marker)
    output_len: np.ndarray  # int64, >= 1
    priority: np.ndarray  # int64

    @property
    def n(self) -> int:
        return len(self.arrival_us)

    @property
    def prompt_len(self) -> np.ndarray:
        if len(self.family_prefix) == 0:
            return self.suffix_len.copy()
        prefix = np.where(self.family >= 0, self.family_prefix[np.maximum(self.family, 0)], 0)
        lengths: np.ndarray = prefix + self.suffix_len
        return lengths

    def request_id(self, r: int) -> str:
        return f"r{r:06d}"

    def prompt(self, r: int) -> np.ndarray:
        """Request r's prompt token ids as an int32 array (family prefix, own suffix, marker)."""
        suffix_start = SUFFIX_BASE + r * SUFFIX_STRIDE
        own = np.arange(suffix_start, suffix_start + int(self.suffix_len[r]), dtype=np.int32)
        own[-1] = MARKER_BASE + r
        f = int(self.family[r])
        if f < 0:
            return own
        start = FAMILY_BASE + f * FAMILY_STRIDE
        prefix = np.arange(start, start + int(self.family_prefix[f]), dtype=np.int32)
        return np.concatenate((prefix, own))

    def family_prompt_prefix(self, f: int) -> list[int]:
        start = FAMILY_BASE + f * FAMILY_STRIDE
        return list(range(start, start + int(self.family_prefix[f])))

    def summary(self) -> dict[str, Any]:
        prompt = self.prompt_len
        span = float(self.arrival_us[-1] - self.arrival_us[0]) if self.n > 1 else 0.0
        return {
            "requests": self.n,
            "arrival_span_s": span / 1e6,
            "prompt_tokens_mean": float(prompt.mean()),
            "prompt_tokens_p99": float(np.sort(prompt)[int(np.ceil(self.n * 0.99)) - 1]),
            "output_tokens_mean": float(self.output_len.mean()),
            "output_tokens_p99": float(np.sort(self.output_len)[int(np.ceil(self.n * 0.99)) - 1]),
            "family_requests": int((self.family >= 0).sum()),
            "families_used": int(len(np.unique(self.family[self.family >= 0]))),
            "priority_requests": int((self.priority > 0).sum()),
        }


def _lognormal(rng: np.random.Generator, median: int, sigma: float, size: int, lo: int,
              hi: int) -> np.ndarray:
    values = rng.lognormal(np.log(median), sigma, size)
    return np.clip(np.rint(values), lo, hi).astype(np.int64)


def generate(spec: WorkloadSpec) -> Workload:
    spec.validate()
    rng = np.random.Generator(np.random.PCG64(spec.seed))
    n = spec.requests
    gaps = rng.exponential(1e6 / spec.rate, n)
    gaps[0] = 0.0
    arrival = np.floor(np.cumsum(gaps)).astype(np.int64)
    families = spec.families
    if families:
        weights = 1.0 / np.arange(1, families + 1, dtype=np.float64) ** spec.family_zipf
        weights /= weights.sum()
        member = rng.random(n) < spec.family_share
        drawn = rng.choice(families, size=n, p=weights).astype(np.int32)
        family = np.where(member, drawn, -1).astype(np.int32)
        family_prefix = _lognormal(rng, spec.prefix_median, spec.prefix_sigma, families,
                                   spec.prefix_min, spec.prefix_max)
    else:
        family = np.full(n, -1, dtype=np.int32)
        family_prefix = np.zeros(0, dtype=np.int64)
    suffix = _lognormal(rng, spec.suffix_median, spec.suffix_sigma, n, 1, spec.suffix_max)
    output = _lognormal(rng, spec.output_median, spec.output_sigma, n, 1, spec.output_max)
    priority = (rng.random(n) < spec.priority_share).astype(np.int64)
    return Workload(spec, arrival, family, family_prefix, suffix, output, priority)
