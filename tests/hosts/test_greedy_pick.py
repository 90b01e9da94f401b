"""The host's greedy pick for sequences that never end on an end token (`ignore_eos`) or hold
them off below a position (`min_end_position`): the argmax over the row with those tokens at
-inf, taken from the decode's own argmax where that is not one of them."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("llama_cpp")

from skippy_scheduler.hosts.llama.samplers import Samplers  # noqa: E402
from skippy_scheduler.sampling import SamplingParams  # noqa: E402

N_VOCAB = 40
EOG_IDS = np.array([3, 7], dtype=np.int32)


def _samplers() -> Samplers:
    eog = np.zeros(N_VOCAB, dtype=np.bool_)
    eog[EOG_IDS] = True
    return Samplers(N_VOCAB, eog, EOG_IDS)


def _expected(row: np.ndarray, params: SamplingParams, position: int) -> int:
    masked = row.copy()
    if params.ignore_eos:
        masked[EOG_IDS] = -np.inf
    if position < params.min_end_position:
        masked[EOG_IDS] = -np.inf
        masked[list(params.min_end_tokens)] = -np.inf
    return int(masked.argmax())


def test_the_pick_is_the_argmax_with_the_end_tokens_masked():
    rng = np.random.default_rng(7)
    rows = rng.standard_normal((64, N_VOCAB)).astype(np.float32)
    rows[0:16, 3] = 10.0  # an end token first
    rows[16:24, 7] = 10.0
    rows[24:28, 3] = rows[24:28, 12] = 10.0  # tied: the end token comes first
    rows[28:32, 2] = rows[28:32, 7] = 10.0  # tied: the other token comes first
    rows[32:36, 20] = 10.0  # neither: nothing to change
    rows[36:40, 9] = 10.0  # a stop token held off below the position (min_end_tokens)
    cases = [SamplingParams(temperature=0.0, ignore_eos=True),
             SamplingParams(temperature=0.0, min_end_position=5, min_end_tokens=(9,)),
             SamplingParams(temperature=0.0, ignore_eos=True, min_end_position=5,
                            min_end_tokens=(9,))]
    for params in cases:
        for position in (2, 10):  # below and past min_end_position (position = pos + 1)
            samplers = _samplers()
            n = len(rows)
            for lane in range(n):
                assert samplers.start(lane, samplers.resolve(params)) is not None
            logits = rows.copy()
            tokens = logits.argmax(axis=1).astype(np.int32)
            lanes = np.arange(n, dtype=np.int32)
            positions = np.full(n, position - 1, dtype=np.int32)
            samplers.pick(None, tokens, logits, None, lanes, lanes, lanes, positions)
            want = [_expected(rows[j], params, position) for j in range(n)]
            assert tokens.tolist() == want, (params, position)
            samplers.close()
