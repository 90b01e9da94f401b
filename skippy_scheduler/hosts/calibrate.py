"""Fit the linear iteration cost model to a real runtime by running plans on the engine.

The cost model prices an iteration as
    overhead + prefill_token × (Prefill/Recompute tokens) + [decode rows > 0] × (decode_batch +
    decode_sequence × decode rows)
(docs/behaviour.md §5.3). `calibrate_host` drives a handful of plan shapes through a real
`Scheduler` on the `Engine` (prefill-only of several lengths, decode-only of several widths, and
a prefill mixed into a decode batch), reads each iteration's prefill tokens, decode rows and
charged duration from the engine's recorder, and fits the four coefficients by non-negative
least squares over the fastest timed iteration of each shape (`cost_model.fit_coefficients`,
the routine that keeps the slack rule's model fitted online). So a calibration times exactly
what the engine charges for a plan: the host's `execute` (staging the batch, one
`llama_decode`, greedy sampling), nothing of the scheduler's own work. The model is a
`StepCost` of the lab's four terms (its per-row and position terms 0), and its str() is the
lab's --cost-model form.

Why the fastest: on a shared machine every disturbance (another process on the core, a cache
it evicts, a thread descheduled) only adds time, so the fastest of a shape's iterations is the
cost of the plan itself, and the one that repeats from run to run. On a loaded 2-core machine
the coefficients fitted over the fastest varied between runs by 1-3%, over the medians by 4-7%.
A shape's iterations are timed in two passes through all the shapes, so that a burst of
load that slows every iteration of one run does not decide that shape's cost.

Each shape gets its own scheduler, configured so that every iteration after a short setup has
that shape:

* prefill-only, p tokens: one sequence at a time (`max_active_sequences=1`) with a p-token
  prompt and one token to generate, so each iteration is that prompt's single prefill row;
* decode-only, d rows: d sequences with short prompts; after the iteration that prefills them
  every iteration decodes all d;
* mixed, p tokens and d rows: the same d decoders plus one p-token sequence at a time, submitted
  after the decoders' first decode-only iteration, which is what opens the scheduler's mixed
  gate (§2.2, §2.6). Should the scheduler turn mixed planning off, the shape is skipped and the
  calibration says why.

Sampled end-of-generation tokens are replaced by an ordinary token before the scheduler sees
them, after the iteration was timed, so that a decoder never stops early and a decode width
stays what it was set to.
"""
from __future__ import annotations

import math
import re
import statistics
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol, Union, runtime_checkable

import numpy as np

from ..cost_model import LAB_NAMES, StepCost, decode_row_count, fit_coefficients, step_terms
from ..engine.clock import make_clock
from ..engine.contract import attach
from ..engine.core import Engine, Request
from ..engine.warmup import FIRST_TOKEN  # the random prompts of both
from ..types import SchedulerConfig

if TYPE_CHECKING:  # pragma: no cover
    from .llama import LlamaHost

COST_MODEL_RE = re.compile(
    r"^iteration_overhead_us=[0-9.]+,prefill_token_us=[0-9.]+,"
    r"decode_batch_us=[0-9.]+,decode_sequence_us=[0-9.]+$"
)

_LAB = {name: lab for lab, name in LAB_NAMES.items()}  # the lab's name of each of its terms

CLOCKS = ("cpu", "wall")
DEFAULT_CLOCK = "cpu"
# A new batch shape runs slower for its first few iterations: after the prefill shapes, the
# tiny model's single-row decode took 280, 150, 125, 110, 100 µs in its first five.
DEFAULT_WARMUP = 3
DEFAULT_REPEATS = 15
# A shape's iterations run back to back in a few ms, so a burst of load can slow all of them;
# a second pass through the shapes, later, gives every shape another chance at its real cost.
DEFAULT_PASSES = 2
DEFAULT_CONTEXT_TOKENS = 32  # prompt tokens of each decoder
# Largest plausible rms of the fit's relative errors. One thread on the CPU clock fits the tiny
# model to 2-4% on an idle and on a fully loaded 2-core machine alike; elapsed time under that
# load, or two threads, often gives 16-26% (far more when a thread is descheduled at a barrier)
# with coefficients that move by half from run to run.
MAX_RELATIVE_RESIDUAL = 0.15
# Iterations of a shape's run that may miss the shape before the shape is given up.
_MAX_MISSES = 3


@dataclass(frozen=True)
class ShapeTiming:
    """The timed iterations of one plan shape (warm-up excluded), in run order."""

    prefill_tokens: int
    decode_rows: int
    durations_us: tuple[float, ...]

    @property
    def fastest_us(self) -> float:
        """What the fit uses (see the module docstring)."""
        return min(self.durations_us)

    @property
    def median_us(self) -> float:
        return statistics.median(self.durations_us)


@dataclass
class Calibration:
    model: StepCost
    samples: list[tuple[int, int, float]]  # (prefill tokens, decode rows, fastest µs)
    residual_us: float  # root-mean-square error of the fit over the shapes
    clock: str = DEFAULT_CLOCK
    timings: list[ShapeTiming] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # shapes the scheduler would not run, why

    @property
    def relative_residual(self) -> float:
        """Root-mean-square of each shape's fit error relative to its measured time."""
        return relative_residual(self.model, self.samples)

    def problems(self) -> list[str]:
        """Why the fitted model should not be trusted (empty when it is plausible)."""
        return check_fit(self.model, self.samples)

    def to_json(self) -> dict[str, Any]:
        return {
            "cost_model": str(self.model),
            "clock": self.clock,
            "rms_residual_us": self.residual_us,
            "relative_residual": self.relative_residual,
            "problems": self.problems(),
            "skipped_shapes": list(self.skipped),
            "shapes": [
                {"prefill_tokens": t.prefill_tokens, "decode_rows": t.decode_rows,
                 "fastest_us": t.fastest_us, "median_us": t.median_us,
                 "durations_us": list(t.durations_us)}
                for t in self.timings
            ] if self.timings else [
                {"prefill_tokens": p, "decode_rows": d, "fastest_us": us}
                for p, d, us in self.samples
            ],
        }


def relative_residual(model: StepCost, samples: list[tuple[int, int, float]]) -> float:
    """Root-mean-square of (model − measured) / measured over the samples."""
    if not samples:
        raise ValueError("no samples")
    errors = [(model.duration_us(p, d) - us) / us if us > 0 else math.inf
              for p, d, us in samples]
    return math.sqrt(sum(e * e for e in errors) / len(errors))


def check_fit(model: StepCost, samples: list[tuple[int, int, float]]) -> list[str]:
    """Plausibility of a fitted model, as sentences (empty when it is plausible).

    The fit must explain the timings (relative residual at most `MAX_RELATIVE_RESIDUAL`), and
    the timings must grow with prefill tokens across the prefill-only shapes and with decode
    rows across the decode-only shapes by more than the fit's typical error at the largest of
    them: a coefficient that is zero, or whose effect is lost in the noise, prices nothing.
    """
    problems: list[str] = []
    rel = relative_residual(model, samples)
    if not rel <= MAX_RELATIVE_RESIDUAL:
        rms_us = math.sqrt(sum((model.duration_us(p, d) - us) ** 2 for p, d, us in samples)
                           / len(samples))
        problems.append(
            f"the fit explains the timings poorly: its rms residual is {rms_us:.1f} us, "
            f"{rel:.0%} of the measured times (rms of each shape's relative error; more than "
            f"{MAX_RELATIVE_RESIDUAL:.0%} is not plausible), so the timings vary more than the "
            "plans they time")
    for what, coef, name, family in (
        ("prefill tokens", model.per_prefill_token_us, _LAB["per_prefill_token_us"],
         [(p, us) for p, d, us in samples if p and not d]),
        ("decode rows", model.per_decode_row_us, _LAB["per_decode_row_us"],
         [(d, us) for p, d, us in samples if d and not p]),
    ):
        sizes = sorted({n for n, _ in family})
        if len(sizes) < 2:
            continue
        growth = coef * (sizes[-1] - sizes[0])
        noise = rel * max(us for _, us in family)
        if not growth > noise:
            problems.append(
                f"timings do not grow with {what}: from {sizes[0]} to {sizes[-1]} the model adds "
                f"{growth:.1f} us ({name}={coef:g}), no more than its typical error there "
                f"({noise:.1f} us)")
    return problems


def default_shapes(n_seq_max: int, n_batch: int) -> list[tuple[int, int]]:
    """(prefill tokens, decode rows) shapes that separate the four coefficients: prefill-only of
    several lengths, decode-only of several widths, and a 64-token prefill mixed into the two
    narrowest decode batches."""
    widths = [d for d in (1, 2, 4, 8) if d <= n_seq_max]
    shapes: list[tuple[int, int]] = [(p, 0) for p in (16, 64, 128, 256) if p <= n_batch]
    shapes += [(0, d) for d in widths]
    shapes += [(64, d) for d in widths[:2] if 64 + d <= n_batch and d + 1 <= n_seq_max]
    return shapes


def decoder_positions(repeats: int, warmup: int = DEFAULT_WARMUP, passes: int = DEFAULT_PASSES,
                      context_tokens: int = DEFAULT_CONTEXT_TOKENS) -> int:
    """The KV position a decode shape's sequences reach: their context plus one pass's
    iterations (setup, warm-up, timed, allowed misses)."""
    per_pass = -(-repeats // passes)
    return context_tokens + 2 + warmup + per_pass + _MAX_MISSES


def positions_needed(shapes: list[tuple[int, int]], repeats: int, warmup: int = DEFAULT_WARMUP,
                     passes: int = DEFAULT_PASSES,
                     context_tokens: int = DEFAULT_CONTEXT_TOKENS) -> int:
    """KV positions per sequence that a calibration of `shapes` needs (what a host's context
    per sequence must hold): the longest prefill, or how far the decoders get."""
    prefill = max((p for p, _ in shapes), default=0)
    decoding = any(d for _, d in shapes)
    return max(prefill, decoder_positions(repeats, warmup, passes, context_tokens)
               if decoding else 0)


@runtime_checkable
class BoundedContextHost(Protocol):
    """A host whose sequences hold at most `n_ctx_seq` KV positions each (a `LlamaHost`): the
    calibration refuses shapes that would not fit before it runs any."""

    n_ctx_seq: int


ClockChoice = Union[str, Callable[[], Any]]


def fresh_clock(clock: ClockChoice) -> Any:
    """A fresh engine clock: "cpu" (`CpuClock`), "wall" (`WallClock`), or what a factory makes
    (such as `lambda: VirtualClock(cost)`, which prices every plan by a known model)."""
    if isinstance(clock, str) and clock in CLOCKS:
        return make_clock(clock, CLOCKS)
    if callable(clock):
        return clock()
    raise ValueError(f"clock must be one of {', '.join(CLOCKS)} or a clock factory, "
                     f"got {clock!r}")


class _ShapeRun:
    """Engine hooks that feed one shape's sequences and note the iterations that have it."""

    def __init__(self, prefill: int, decode: int, wanted: int, tokens: Callable[[int], list[int]],
                 filler: int) -> None:
        self.prefill = prefill
        self.decode = decode
        self.wanted = wanted
        self.tokens = tokens
        self.filler = filler
        self.engine: Optional[Engine] = None
        self.timed: list[int] = []  # engine iteration indices that had the shape
        # Decoders are ready once they have run a decode-only iteration of full width: from then
        # on every iteration must have the shape (a mixed plan also needs that observation).
        self.ready = decode == 0
        self.in_flight: Optional[str] = None  # the prefill sequence submitted and not yet run
        self.submitted = 0
        self.misses: list[tuple[int, int]] = []
        self.gave_up = False

    def before_step(self, engine: Engine) -> None:
        if len(self.timed) >= self.wanted or self.gave_up:
            for rid in engine.open_ids():
                engine.cancel(rid)
            return
        if self.prefill and self.ready and self.in_flight is None:
            rid = f"calib-prefill-{self.submitted}"
            self.submitted += 1
            engine.submit(Request(rid, self.tokens(self.prefill), 1))
            self.in_flight = rid

    def on_plan(self, plan: Any, start_us: float, duration_us: float) -> None:
        assert self.engine is not None
        decode = decode_row_count(plan.phases)
        shape = (int(plan.token_count) - decode, decode)
        if shape == (self.prefill, self.decode):
            self.timed.append(self.engine.iterations)
        elif self.ready:
            self.misses.append(shape)
            self.gave_up = len(self.misses) >= _MAX_MISSES
        if shape == (0, self.decode) and decode:
            self.ready = True
        if self.in_flight is not None and self.in_flight in plan.sequence_ids:
            self.in_flight = None  # its one row samples its one token: it finishes now
        out = plan.outputs
        predicted = out.predicted_tokens[:out.count]
        predicted[predicted < 0] = self.filler


def _time_shape(host: Any, prefill: int, decode: int, *, repeats: int, warmup: int,
                clock: ClockChoice, context_tokens: int, tokens: Callable[[int], list[int]],
                filler: int, scheduler_type: Any) -> tuple[Optional[list[float]], str]:
    """Durations of `repeats` iterations of the shape after `warmup` (None and why, when the
    scheduler would not plan it)."""
    wanted = warmup + repeats
    config = SchedulerConfig(
        max_active_sequences=decode + (1 if prefill else 0),
        max_tokens_per_iteration=host.n_batch,
        prefill_chunk_tokens=host.n_batch,
        mixed_prefill_decode=bool(prefill and decode),
    )
    scheduler = scheduler_type(config)
    run = _ShapeRun(prefill, decode, wanted, tokens, filler)
    # Decoders are cancelled once enough iterations are timed; their budget only bounds a run
    # that goes wrong (one prefill, one decode-only iteration, the timed ones, the misses).
    decode_budget = 2 + wanted + _MAX_MISSES
    engine = Engine(scheduler, host, clock=fresh_clock(clock), on_plan=run.on_plan,
                    before_step=run.before_step, max_iterations=4 * decode_budget + 16)
    run.engine = engine
    for i in range(decode):
        engine.submit(Request(f"calib-decode-{i}", tokens(context_tokens), decode_budget))
    report = engine.run()
    name = f"prefill_tokens={prefill} decode_rows={decode}"
    if len(run.timed) < wanted:
        seen = ", ".join(f"({p}, {d})" for p, d in run.misses) or "none"
        why = f"{name}: the scheduler planned other shapes (prefill tokens, decode rows): {seen}"
        if prefill and decode and not scheduler.mixed_prefill_viable:
            why += (" after it turned mixed planning off, because the prefill slowed a decode "
                    "step by more than its mixed gate allows (docs/behaviour.md §2.6)")
        return None, why
    its = report.iteration_arrays()
    idx = np.asarray(run.timed[warmup:], dtype=np.int64)
    decode_rows = its["decode_rows"][idx]
    prefill_tokens = its["tokens"][idx] - decode_rows
    # The recorder is the source of truth; the hooks only chose which iterations to read.
    if (prefill_tokens != prefill).any() or (decode_rows != decode).any():
        raise RuntimeError(f"{name}: the recorded iterations do not have the planned shape")
    return its["duration_us"][idx].tolist(), ""


def calibrate_host(
    host: Any, *, repeats: int = DEFAULT_REPEATS, warmup: int = DEFAULT_WARMUP,
    passes: int = DEFAULT_PASSES, clock: ClockChoice = DEFAULT_CLOCK,
    shapes: Optional[list[tuple[int, int]]] = None,
    context_tokens: int = DEFAULT_CONTEXT_TOKENS, seed: int = 0,
    scheduler_type: Any = None,
    on_timed: Optional[Callable[[ShapeTiming, int, int], None]] = None,
) -> Calibration:
    """Run each shape on the engine with `host` (idle: no active sequences) and fit the model.

    host: an engine host with `n_vocab`, `n_seq_max` and `n_batch` (a `LlamaHost`).
    repeats: timed iterations per shape (the fastest is fitted), spread over `passes` passes
        through the shapes, so that one stretch of interference cannot spoil a whole shape;
    warmup: iterations of each shape run first in each pass and not timed (a new batch shape
        is slow for its first few).
    clock: "cpu" charges each iteration the process's CPU time, which other processes on a busy
        machine do not inflate (with one compute thread it is the compute time; with several it
        counts all of them, spinning included); "wall" charges elapsed time, what a client sees;
        or a factory of engine clocks (one per run).
    shapes: (prefill tokens, decode rows) pairs; by default `default_shapes`.
    scheduler_type: the scheduler class (the native `Scheduler` by default).
    on_timed: called as soon as a pass has timed a shape, with `(timing, done, of)`: the
        shape's timings so far, the passes that have timed it and the passes that time it
        (`done == of`: its timings are final, the `ShapeTiming` of the result).
    """
    for name, value, lo in (("repeats", repeats, 1), ("warmup", warmup, 0),
                            ("passes", passes, 1), ("context_tokens", context_tokens, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < lo:
            raise ValueError(f"{name} must be an int >= {lo}, got {value!r}")
    fresh_clock(clock)
    state = attach(host).host_state
    if state is not None and state().active:
        raise ValueError("calibrate on an idle host: it has active sequences")
    if scheduler_type is None:
        from .. import Scheduler as scheduler_type
    n_seq_max, n_batch, n_vocab = host.n_seq_max, host.n_batch, host.n_vocab
    shapes = list(dict.fromkeys(default_shapes(n_seq_max, n_batch) if shapes is None
                                else [(int(p), int(d)) for p, d in shapes]))
    if not shapes:
        raise ValueError("no shapes to time")
    for p, d in shapes:
        if p < 0 or d < 0 or not (p or d):
            raise ValueError(f"shape ({p}, {d}) must have prefill tokens or decode rows")
        if p + d > n_batch or d + (1 if p else 0) > n_seq_max or d * context_tokens > n_batch:
            raise ValueError(f"shape ({p}, {d}) does not fit the host (n_batch={n_batch}, "
                             f"n_seq_max={n_seq_max}, context_tokens={context_tokens})")
    if isinstance(host, BoundedContextHost):
        ctx_seq = host.n_ctx_seq
        longest = decoder_positions(repeats, warmup, passes, context_tokens)
        if any(d for _, d in shapes) and longest > ctx_seq:
            raise ValueError(f"decoders would reach position {longest} but the host holds "
                             f"{ctx_seq} per sequence: fewer repeats, or a host with a "
                             f"longer context per sequence")
        if max(p for p, _ in shapes) > ctx_seq:
            raise ValueError(f"a {max(p for p, _ in shapes)}-token prefill does not fit the "
                             f"{ctx_seq} positions the host holds per sequence")
    rng = np.random.default_rng(seed)

    def tokens(n: int) -> list[int]:
        drawn: list[int] = rng.integers(FIRST_TOKEN, n_vocab, size=n).tolist()
        return drawn

    durations: dict[tuple[int, int], list[float]] = {shape: [] for shape in shapes}
    skipped: dict[tuple[int, int], str] = {}
    counts = [repeats // passes + (i < repeats % passes) for i in range(passes)]
    timing_passes = sum(1 for count in counts if count)  # the first ones: counts never grow
    for done, count in enumerate(counts, 1):
        for p, d in shapes:
            if not count or (p, d) in skipped:
                continue
            got, why = _time_shape(host, p, d, repeats=count, warmup=warmup, clock=clock,
                                   context_tokens=context_tokens, tokens=tokens,
                                   filler=FIRST_TOKEN, scheduler_type=scheduler_type)
            if got is None:
                skipped[(p, d)] = why
            else:
                durations[(p, d)] += got
                if on_timed is not None:
                    on_timed(ShapeTiming(p, d, tuple(durations[(p, d)])), done,
                             timing_passes)
    timings = [ShapeTiming(p, d, tuple(durations[(p, d)])) for p, d in shapes
               if (p, d) not in skipped]
    if not timings:
        raise RuntimeError("no shape could be timed: " + "; ".join(skipped.values()))
    samples = [(t.prefill_tokens, t.decode_rows, t.fastest_us) for t in timings]
    model, residual = fit_cost_model(samples)
    label = clock if isinstance(clock, str) else "custom"
    return Calibration(model, samples, residual, label, timings, list(skipped.values()))


def fit_cost_model(samples: list[tuple[int, int, float]]) -> tuple[StepCost, float]:
    """Non-negative least squares of the lab's four terms over (prefill, decode rows, µs), each
    shape's error relative to its time (`cost_model.fit_coefficients`, which says why), the
    coefficients rounded to the thousandth of a µs; returns the model and its root-mean-square
    residual in µs."""
    if not samples:
        raise ValueError("no samples to fit")
    x = step_terms([p for p, _, _ in samples], [d for _, d, _ in samples])[:, :len(LAB_NAMES)]
    y = np.array([us for _, _, us in samples], dtype=float)
    coef = np.round(fit_coefficients(x, y), 3)
    residual = float(np.sqrt(np.mean((x @ coef - y) ** 2)))
    return StepCost(*(float(c) for c in coef)), residual
