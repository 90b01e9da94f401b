"""`Sequence.sampling` is typed, and `SamplingParams` checks its values."""
from __future__ import annotations

import pytest

from skippy_scheduler import Scheduler, SchedulerConfig, Sequence, TwinScheduler
from skippy_scheduler._abi import ffi
from skippy_scheduler.sampling import OutputOptions, SamplingParams, step_seed


def test_sampling_accepts_none_params_and_the_native_config():
    params = SamplingParams(temperature=0.5, seed=3)
    native = ffi.new("skippy_sampling_config *")
    for value in (None, params, native):
        assert Sequence("a", [1], 2, sampling=value).sampling is value


@pytest.mark.parametrize("value", [{"temperature": 0}, "greedy", 0.7, ffi.new("int *")])
def test_any_other_sampling_is_a_type_error(value):
    with pytest.raises(TypeError, match="sampling must be None, a SamplingParams"):
        Sequence("a", [1], 2, sampling=value)


@pytest.mark.parametrize("cls", [Scheduler, TwinScheduler])
def test_submit_checks_a_sampling_set_after_construction(cls):
    seq = Sequence("a", [1], 2)
    seq.sampling = {"temperature": 0}
    with pytest.raises(TypeError, match="sampling must be"):
        cls(SchedulerConfig()).submit(seq)


@pytest.mark.parametrize("field,value,error", [
    ("temperature", -0.1, ValueError), ("temperature", "1", TypeError),
    ("temperature", float("nan"), ValueError), ("top_p", 0.0, ValueError),
    ("top_p", 1.5, ValueError), ("top_k", -2, ValueError), ("top_k", 1.5, TypeError),
    ("min_p", 2.0, ValueError), ("seed", -1, ValueError), ("seed", 1 << 64, ValueError),
    ("repetition_penalty", 0.0, ValueError), ("penalty_last_n", -1, ValueError),
    ("logit_bias", {-1: 1.0}, ValueError), ("logit_bias", {1: float("inf")}, ValueError),
    ("logit_bias", "x", TypeError), ("ignore_eos", 1, TypeError),
])
def test_params_are_checked(field, value, error):
    with pytest.raises(error, match=field.split("_")[0]):
        SamplingParams(**{field: value})


def test_params_defaults_and_flags():
    p = SamplingParams()
    assert p.temperature == 1.0 and isinstance(p.seed, int) and not p.greedy
    assert SamplingParams().seed != SamplingParams().seed  # None draws a seed
    g = SamplingParams(temperature=0, logit_bias={5: 1, 2: -1})
    assert g.greedy and not g.plain_greedy and g.logit_bias == ((2, -1.0), (5, 1.0))
    assert SamplingParams(temperature=0).plain_greedy
    assert SamplingParams(repetition_penalty=1.2).penalized
    assert not SamplingParams(repetition_penalty=1.2, penalty_last_n=0).penalized


def test_native_round_trip_and_refusals():
    p = SamplingParams(temperature=0.7, top_p=0.9, top_k=12, min_p=0.1, seed=77,
                       presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.1,
                       penalty_last_n=32, logit_bias={3: 2.0}, ignore_eos=True)
    back = SamplingParams.from_native(p.to_native())
    for name, value in p.__dict__.items():
        got = getattr(back, name)
        assert got == (pytest.approx(value) if isinstance(value, float) else value), name
    assert SamplingParams.from_native(ffi.new("skippy_sampling_config *")) is None  # greedy
    c = p.to_native()
    c.mirostat_mode = 2
    with pytest.raises(ValueError, match="mirostat_mode"):
        SamplingParams.from_native(c)


def test_step_seeds_differ_by_position_and_avoid_the_clock_seed():
    seeds = {step_seed(42, p) for p in range(1000)}
    assert len(seeds) == 1000 and 0xFFFFFFFF not in seeds
    assert step_seed(42, 7) == step_seed(42, 7) != step_seed(43, 7)


@pytest.mark.parametrize("held", [{"ignore_eos": True}, {"min_end_position": 5}])
def test_a_grammar_that_could_not_end_is_refused(held):
    """A complete grammar allows only an end token; held off, llama.cpp's grammar sampler
    would abort the process."""
    output = OutputOptions(grammar='root ::= "x"', prompt_length=4)
    with pytest.raises(ValueError, match="must be able to end"):
        SamplingParams(temperature=0.0, output=output, **held)
    SamplingParams(temperature=0.0, output=output, min_end_position=4)  # the prompt only
    SamplingParams(temperature=0.0, ignore_eos=True, output=OutputOptions(logprobs=1))
