"""Log-probabilities from a decode's logits: the sampled tokens', and the prompt's.

Every figure is a log-softmax of the model's raw logits over the whole vocabulary (before logit
bias, penalties, temperature and filters: vLLM's default, docs: sampling.py), computed in
float64 from the float32 logits llama.cpp returns.

Prompt log-probabilities need the logits of every prompt entry: the host flags those entries of
the rows of a sequence that asks for them (`wanted_entries`), and `PromptLogprobs` turns the
logits at position p into the log-probability of the token at p + 1. The last entry of a prompt
chunk predicts the first token of the next chunk, which a later plan brings: its distribution
waits in `pending` until then.
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np
import numpy.typing as npt

from ...sampling import OutputOptions, TokenLogprob

FloatArray = npt.NDArray[np.float64]


def log_softmax(logits: npt.NDArray[Any]) -> FloatArray:
    """The log-softmax of one row of logits, in float64."""
    row = np.asarray(logits, dtype=np.float64)
    top = row.max()
    out: FloatArray = row - (top + np.log(np.exp(row - top).sum()))
    return out


def token_logprob(logprobs: FloatArray, token: int, k: int) -> TokenLogprob:
    """`token`'s entry of a log-softmax row, with the `k` most likely tokens (best first;
    ties by token id)."""
    top: tuple[tuple[int, float], ...] = ()
    if k > 0:
        k = min(k, len(logprobs))
        best = np.argpartition(-logprobs, k - 1)[:k]
        best = best[np.lexsort((best, -logprobs[best]))]
        top = tuple((int(t), float(logprobs[t])) for t in best.tolist())
    return TokenLogprob(int(token), float(logprobs[token]), top)


class PromptLogprobs:
    """The prompt log-probabilities of one sequence as its prefill rows run."""

    __slots__ = ("options", "collected", "pending", "done")

    def __init__(self, options: OutputOptions) -> None:
        self.options = options
        self.collected: list[TokenLogprob] = []
        self.pending: Optional[tuple[int, FloatArray]] = None  # (position, log-softmax)
        self.done = False

    @property
    def end(self) -> int:
        return self.options.prompt_length

    def wants(self, start: int, stop: int) -> bool:
        """Whether a row over positions [start, stop) needs its entries' logits."""
        if self.done or stop <= start:
            return False
        waiting = self.pending is not None and self.pending[0] + 1 == start
        return start < self.end - 1 or (waiting and start < self.end)

    def restart(self, start: int) -> None:
        """The sequence's row starts at `start` (a new lane, a replay): what was collected past
        it is dropped; from a restored prefix (start > 1) nothing earlier can be reported."""
        if self.done:
            return
        self.collected = self.collected[:max(start - 1, 0)]
        if self.pending is not None and self.pending[0] >= start:
            self.pending = None  # computed from positions the replay rewrites

    def take(self, start: int, tokens: npt.NDArray[Any], logits: npt.NDArray[Any]) -> None:
        """A row's tokens at positions start.. and the logits of each of its entries."""
        k = self.options.prompt_logprobs or 0
        end = self.end
        if self.pending is not None and self.pending[0] + 1 == start and start < end:
            self._add(self.pending[1], int(tokens[0]), k, start)
        self.pending = None
        n = len(tokens)
        for i in range(n):
            p = start + i
            if p + 1 >= end:
                break
            row = log_softmax(logits[i])
            if i + 1 < n:
                self._add(row, int(tokens[i + 1]), k, p + 1)
            else:
                self.pending = (p, row)

    def _add(self, row: FloatArray, token: int, k: int, position: int) -> None:
        if len(self.collected) == position - 1:  # in order, once (a replay adds nothing)
            self.collected.append(token_logprob(row, token, k))

    def finish(self) -> tuple[TokenLogprob, ...]:
        """What was collected (with the first sample; reported once)."""
        self.done = True
        self.pending = None
        out = tuple(self.collected)
        self.collected = []
        return out
