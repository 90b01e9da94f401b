"""How a sequence picks its next token: `SamplingParams`, carried by `Sequence.sampling`.

The scheduler never reads sampling: it carries the object to the host with every row of the
sequence (`IterationWork.sampling`; a native `skippy_sampling_config *` also travels in the
native row, docs/hosts.md). `Sequence.sampling` is one of

* `None`: greedy argmax, the host's exact fast path;
* a `SamplingParams`;
* a cffi `skippy_sampling_config *` (the runtime ABI's struct), which a host reads with
  `SamplingParams.from_native`.

Anything else is a TypeError at `Sequence(...)` and at submit.

Determinism. A seeded sequence must give the same tokens whether it ran alone, batched with
others, or was preempted and recomputed. Everything a sampler remembers is therefore a
function of the sequence itself: the random draw for the token at position p uses a seed mixed
from (`seed`, p) (`step_seed`), and the penalty history is the last `penalty_last_n` tokens
before p (prompt and generated tokens alike, as llama.cpp counts them), which a host rebuilds
from the tokens it is fed again on recompute. `seed=None` draws a seed when the params are
made, so an unseeded sequence also keeps one stream across preemption (read it back from
`params.seed`).

What a host reports beyond the token, and what constrains it (`OutputOptions`, carried in
`SamplingParams.output`): the sampled token's log-probability and the most likely alternatives,
the prompt tokens' log-probabilities, and a grammar every generated token must follow. A host
hands the reports back as a `SampleDetail` per sampled token (`TokenEvent.detail`).
Log-probabilities are those of the model's raw logits (a log-softmax over the whole vocabulary,
before logit bias, penalties, temperature and the filters), which is vLLM's default
(`logprobs_mode` "raw_logprobs"): they say what the model thinks, whatever the sampling did.
"""
from __future__ import annotations

import math
import os
import random
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional, Union

from ._abi import ffi as _ffi
from ._validate import I32_MAX, U64_MAX, as_float, as_int

# Seeds of unseeded requests: a generator seeded from the OS once per process (again in a
# forked child), not a system call per request.
_SEEDS = random.Random(os.urandom(16))
os.register_at_fork(after_in_child=lambda: _SEEDS.seed(os.urandom(16)))

_NATIVE_TYPE = _ffi.typeof("skippy_sampling_config *")
_FLAG_ENABLED = 1
_FLAG_IGNORE_EOS = 2
_MAX_NATIVE_BIAS = 256


def is_native_config(value: object) -> bool:
    """True for a cffi `skippy_sampling_config *`."""
    return isinstance(value, _ffi.CData) and _ffi.typeof(value) is _NATIVE_TYPE


def check_sampling(value: object) -> Any:
    """`value` if it is a valid `Sequence.sampling` (None, SamplingParams, native config)."""
    if value is None or isinstance(value, SamplingParams) or is_native_config(value):
        return value
    raise TypeError("sampling must be None, a SamplingParams or a cffi "
                    f"'skippy_sampling_config *', got {type(value).__name__}")


def _float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    number = as_float(value)
    if not math.isfinite(number):
        raise ValueError(f"{name} must be finite, got {value}")
    return number


def _int(name: str, value: object, lo: int, hi: int) -> int:
    number = as_int(name, value)
    if not lo <= number <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {number}")
    return number


def _bias_pairs(value: object) -> tuple[tuple[int, float], ...]:
    if isinstance(value, Mapping):
        items: Iterable[Any] = value.items()
    elif isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise TypeError(f"logit_bias must be a mapping of token id to bias, "
                        f"got {type(value).__name__}")
    else:
        items = value
    merged: dict[int, float] = {}
    for item in items:
        try:
            token, bias = item
        except (TypeError, ValueError):
            raise TypeError("logit_bias entries must be (token id, bias) pairs") from None
        token = _int("logit_bias token", token, 0, I32_MAX)
        merged[token] = _float(f"logit_bias[{token}]", bias)
    return tuple(sorted(merged.items()))


@dataclass(frozen=True)
class OutputOptions:
    """What a sequence asks its host to report or enforce besides sampling (module docstring).

    logprobs: report every sampled token's log-probability and this many most likely tokens
        (0: the sampled token's own only); None: report nothing.
    prompt_logprobs: report the log-probability of every prompt token after the first, with
        this many alternatives each (delivered with the first sampled token); None: not.
    grammar: a GBNF grammar (root rule `root`) every generated token must follow (llama.cpp's
        grammar sampler); None: unconstrained.
    prompt_length: how many of the sequence's tokens are prompt (the grammar reads the tokens
        from there on, the prompt logprobs end there).
    """

    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    grammar: Optional[str] = None
    prompt_length: int = 0

    def __post_init__(self) -> None:
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _int(name, value, 0, I32_MAX)
        if self.grammar is not None and not isinstance(self.grammar, str):
            raise TypeError(f"grammar must be a str, got {type(self.grammar).__name__}")
        _int("prompt_length", self.prompt_length, 0, I32_MAX)

    @property
    def top(self) -> int:
        """The alternatives a sampled token's report lists (0 when none is reported)."""
        return self.logprobs or 0


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log-probability at its position, and the most likely tokens there (token
    id, log-probability), best first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class SampleDetail:
    """What a host reports with one sampled token (`OutputOptions`): its log-probability, and
    with the sequence's first sampled token the prompt's (positions 1 .. prompt_length - 1)."""

    logprob: Optional[TokenLogprob] = None
    prompt: Optional[tuple[TokenLogprob, ...]] = None


@dataclass(frozen=True)
class SamplingParams:
    """Per-sequence sampling, applied by the host in this order: logit bias, penalties,
    temperature, top-k, top-p, min-p, then the draw (or argmax when `temperature` is 0).

    temperature: 0 = greedy; otherwise logits are divided by it before the filters below.
    top_p: nucleus mass in (0, 1]; 1 = off.    top_k: keep the k best; 0 or -1 = off.
    min_p: drop tokens below min_p × the best token's probability; 0 = off.
    seed: the random stream (any int in [0, 2**64)); None draws one now.
    presence_penalty, frequency_penalty: subtracted once per distinct token / per occurrence
        among the last `penalty_last_n` tokens; repetition_penalty: divides positive and
        multiplies negative logits of those tokens (1 = off). The window covers prompt and
        generated tokens; penalty_last_n 0 turns all three off.
    logit_bias: {token id: bias} added to the logits (a list of pairs works too).
    ignore_eos: never sample an end-of-generation token.
    output: reports and a grammar (`OutputOptions`); None: the token alone.
    min_end_position: no end-of-generation token, nor any of `min_end_tokens`, is sampled for a
        position below this one (vLLM's `min_tokens`: the server sets it to the prompt's length
        plus min_tokens); 0 = off.    min_end_tokens: token ids held off with the end tokens
        (a request's stop token ids).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    penalty_last_n: int = 64
    logit_bias: Any = field(default=())
    ignore_eos: bool = False
    output: Optional[OutputOptions] = None
    min_end_position: int = 0
    min_end_tokens: Any = field(default=())

    def __post_init__(self) -> None:
        put = object.__setattr__
        temperature = _float("temperature", self.temperature)
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        put(self, "temperature", temperature)
        top_p = _float("top_p", self.top_p)
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        put(self, "top_p", top_p)
        put(self, "top_k", _int("top_k", self.top_k, -1, I32_MAX))
        min_p = _float("min_p", self.min_p)
        if not 0 <= min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {min_p}")
        put(self, "min_p", min_p)
        seed = _SEEDS.getrandbits(64) if self.seed is None else _int("seed", self.seed, 0,
                                                                       U64_MAX)
        put(self, "seed", seed)
        put(self, "presence_penalty", _float("presence_penalty", self.presence_penalty))
        put(self, "frequency_penalty", _float("frequency_penalty", self.frequency_penalty))
        repetition = _float("repetition_penalty", self.repetition_penalty)
        if repetition <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {repetition}")
        put(self, "repetition_penalty", repetition)
        put(self, "penalty_last_n", _int("penalty_last_n", self.penalty_last_n, 0, I32_MAX))
        put(self, "logit_bias", _bias_pairs(self.logit_bias))
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"ignore_eos must be a bool, got {type(self.ignore_eos).__name__}")
        if self.output is not None and not isinstance(self.output, OutputOptions):
            raise TypeError(f"output must be an OutputOptions, got {type(self.output).__name__}")
        put(self, "min_end_position", _int("min_end_position", self.min_end_position, 0,
                                           I32_MAX))
        put(self, "min_end_tokens", tuple(sorted({_int("min_end_tokens", t, 0, I32_MAX)
                                                  for t in self.min_end_tokens})))
        output = self.output
        if output is not None and output.grammar is not None and (
                self.ignore_eos or self.min_end_position > output.prompt_length):
            # A complete grammar allows only an end token: held off, nothing could be sampled
            # (llama.cpp's grammar sampler then aborts the process).
            raise ValueError("a grammar cannot be combined with ignore_eos or with a "
                             "min_end_position past the prompt: a complete grammar must be "
                             "able to end")

    # -- what a host needs to know ------------------------------------------------------------

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether any penalty is active (the sampler then keeps a token history)."""
        return self.penalty_last_n > 0 and (
            self.presence_penalty != 0 or self.frequency_penalty != 0
            or self.repetition_penalty != 1)

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing that changes the logits: the argmax fast path applies
        (with `ignore_eos`, over the non-end tokens); nothing to report or constrain."""
        return (self.greedy and not self.penalized and not self.logit_bias
                and self.output is None)

    # -- the runtime ABI's struct -------------------------------------------------------------

    @classmethod
    def from_native(cls, config: Any) -> Optional["SamplingParams"]:
        """The params a `skippy_sampling_config *` describes; None when it asks for greedy
        argmax (version 0 or the enabled flag clear, and no ignore_eos). ValueError names a
        sampler this host does not run (typical, DRY, XTC, mirostat, top-n-sigma, dynamic
        temperature, a custom sampler order)."""
        if not is_native_config(config):
            raise TypeError(f"expected a cffi 'skippy_sampling_config *', "
                            f"got {type(config).__name__}")
        c = config
        ignore_eos = bool(c.ignore_eos) or bool(c.flags & _FLAG_IGNORE_EOS)
        if c.version == 0 or not c.flags & _FLAG_ENABLED:
            return cls(temperature=0.0, ignore_eos=True) if ignore_eos else None
        unsupported = [
            ("typical_p", c.typical_p not in (0.0, 1.0)),
            ("top_nsigma", c.top_nsigma > 0),
            ("dynatemp_range", c.dynatemp_range != 0),
            ("dry_multiplier", c.dry_multiplier != 0),
            ("xtc_probability", c.xtc_probability != 0),
            ("mirostat_mode", c.mirostat_mode != 0),
            ("sampler_count", c.sampler_count != 0),
        ]
        for name, used in unsupported:
            if used:
                raise ValueError(f"skippy_sampling_config.{name} asks for a sampler this host "
                                 "does not run")
        count = int(c.logit_bias_count)
        if count > _MAX_NATIVE_BIAS:
            raise ValueError(f"skippy_sampling_config.logit_bias_count must be <= "
                             f"{_MAX_NATIVE_BIAS}, got {count}")
        # NOTE: zero is the struct's "unset" for top_p (a zeroed config must not mean "keep
        # only the best token") and for the seed (the runtime ABI's "runtime default").
        return cls(
            temperature=c.temperature, top_p=c.top_p if 0 < c.top_p < 1 else 1.0,
            top_k=max(int(c.top_k), -1), min_p=c.min_p, seed=c.seed or None,
            presence_penalty=c.presence_penalty, frequency_penalty=c.frequency_penalty,
            repetition_penalty=c.repeat_penalty if c.repeat_penalty > 0 else 1.0,
            penalty_last_n=max(int(c.penalty_last_n), 0),
            logit_bias=[(c.logit_bias[i].token, c.logit_bias[i].bias) for i in range(count)],
            ignore_eos=ignore_eos)

    def to_native(self) -> Any:
        """A new cffi `skippy_sampling_config *` with these params (keep it alive while a
        sequence carries it). The seed is stored in its 32-bit field, so a config round trip
        keeps the low 32 bits of a larger seed."""
        if self.min_end_position:
            raise ValueError("the native config has no min_end_position (min_tokens)")
        if len(self.logit_bias) > _MAX_NATIVE_BIAS:
            raise ValueError(f"the native config holds {_MAX_NATIVE_BIAS} logit biases, "
                             f"these params have {len(self.logit_bias)}")
        c: Any = _ffi.new("skippy_sampling_config *")  # (cffi field access is untyped)
        c.version = 1
        c.flags = _FLAG_ENABLED | (_FLAG_IGNORE_EOS if self.ignore_eos else 0)
        c.seed = ((self.seed or 0) & 0xFFFFFFFF) or 1  # 0 would mean "runtime default"
        c.top_k = self.top_k
        c.penalty_last_n = self.penalty_last_n
        c.temperature = self.temperature
        c.top_p = self.top_p
        c.min_p = self.min_p
        c.presence_penalty = self.presence_penalty
        c.frequency_penalty = self.frequency_penalty
        c.repeat_penalty = self.repetition_penalty
        c.ignore_eos = int(self.ignore_eos)
        c.logit_bias_count = len(self.logit_bias)
        for i, (token, bias) in enumerate(self.logit_bias):
            c.logit_bias[i].token = token
            c.logit_bias[i].bias = bias
        return c


SamplingArg = Union[None, SamplingParams, Any]

_M64 = (1 << 64) - 1


def step_seed(seed: int, position: int) -> int:
    """The 32-bit seed of the draw for the token at `position` (splitmix64 of both).

    Never 0xFFFFFFFF, which llama.cpp reads as "seed from the clock"."""
    x = (seed + (position + 1) * 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    x ^= x >> 31
    s = x >> 32
    return s if s != 0xFFFFFFFF else 0xFFFFFFFE
