"""Rows outside plans: `run_rows` and `generate_alone` (the reference runs of equality tests,
calibration), which `LlamaHost` hands to its `DirectRows`."""
from __future__ import annotations

from typing import Callable, Iterable, Sequence as _Seq

import numpy as np
import numpy.typing as npt

from .backend import check_int
from .lanes import Lanes, Start
from .rows import RowRunner
from .samplers import Samplers



class DirectRows:
    """Explicit rows through the host's `RowRunner`: a sequence without a lane starts at
    position 0 on a free lane. The host checks that it is open before it calls in."""

    def __init__(self, rows: RowRunner, lanes: Lanes, samplers: Samplers,
                 eog: npt.NDArray[np.bool_], *, n_batch: int, n_vocab: int) -> None:
        self._rows = rows
        self._lanes = lanes
        self._samplers = samplers
        self._eog = eog
        self._n_batch = n_batch
        self._n_vocab = n_vocab

    def run_rows(self, rows: Iterable[tuple[str, _Seq[int], int, bool]],
                 sampling: dict[str, object] | None = None) -> dict[str, int]:
        """Decode explicit rows (sequence id, tokens, start position, sample_last) in one call.

        Returns the raw sampled token of every sampling row by sequence id (end-of-generation
        tokens as they are). A sequence without a lane starts at its row (at position 0: there
        is no restore here); `sampling` gives the `Sequence.sampling` of those (default greedy).
        Used by `generate_alone` and calibration; plans go through `execute`.
        """
        rows = list(rows)
        if not rows:
            return {}
        ids = [r[0] for r in rows]
        arrays = [np.asarray(r[1], dtype=np.int32) for r in rows]
        if any(a.ndim != 1 or len(a) == 0 for a in arrays):
            raise ValueError("every row needs at least one token")
        offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        offsets[1:] = np.cumsum([len(a) for a in arrays])
        n = int(offsets[-1])
        if n > self._n_batch:
            raise ValueError(f"{n} tokens exceed the batch size {self._n_batch}")
        starts = [int(r[2]) for r in rows]
        samplers = self._samplers
        lanes = self._lanes
        given = sampling or {}
        starting = {i: Start(samplers.resolve(given.get(i)), None) for i in ids
                    if not lanes.holds(i)}
        positions = np.concatenate(
            [np.arange(s, s + len(a), dtype=np.int32) for s, a in zip(starts, arrays)])
        sample_rows = np.array([i for i, r in enumerate(rows) if r[3]], dtype=np.int64)
        tokens, _ = self._rows.run(ids, starts, starting, offsets, np.concatenate(arrays),
                                   positions, sample_rows)
        return {ids[i]: int(t) for i, t in zip(sample_rows.tolist(), tokens.tolist())}

    def generate_alone(self, prompt: _Seq[int], max_tokens: int, sampling: object,
                       release: Callable[[str], object]) -> list[int]:
        """Tokens of `prompt` run as the only sequence: the reference for equality tests
        (greedy, or with `sampling` as a `Sequence.sampling`).

        Stops after `max_tokens` tokens or at the first end-of-generation token (included).
        Uses a free lane and lets it go afterwards through `release` (the host's: the lane
        goes back as any sequence's does).
        """
        max_tokens = check_int("max_tokens", max_tokens, 1)
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError("prompt must contain at least one token")
        if any(t < 0 or t >= self._n_vocab for t in prompt):
            raise ValueError(f"prompt tokens must be in [0, {self._n_vocab})")
        if not self._lanes.free:
            raise RuntimeError("no free llama sequence id for an alone run")
        key = object().__repr__()  # a key no scheduler sequence can have
        eog = self._eog
        try:
            pos = 0
            token = -1
            while pos < len(prompt):
                chunk = prompt[pos : pos + self._n_batch]
                last = pos + len(chunk) == len(prompt)
                token = self.run_rows([(key, chunk, pos, last)],
                                      {key: sampling} if pos == 0 else None).get(key, -1)
                pos += len(chunk)
            generated = [token]
            while len(generated) < max_tokens and not eog[token]:
                token = self.run_rows([(key, [token], pos, True)])[key]
                pos += 1
                generated.append(token)
            return generated
        finally:
            release(key)
