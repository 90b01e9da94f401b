"""What the output fields (serve/options.py) change in a request and its answer: the sampling
each engine request carries (`OutputOptions`), the echoed prompt, the log-probabilities of a
choice, and `best_of`'s ranking."""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Optional, Sequence

from ..sampling import OutputOptions, SamplingParams, TokenLogprob
from . import logprob_format

if TYPE_CHECKING:  # pragma: no cover
    from .generation import Generation
    from .protocol import GenerationRequest


def sampling_of(gen: "GenerationRequest", prompt_length: int) -> Optional[SamplingParams]:
    """The request's sampling with what its host must report or enforce (None: greedy with
    nothing to report, the host's fast path)."""
    o = gen.outputs
    if o.logprobs is None and o.best_of is None and o.grammar is None:
        return gen.sampling
    base = gen.sampling if gen.sampling is not None else SamplingParams(temperature=0.0, seed=0)
    logprobs = o.logprobs if o.logprobs is not None else 0  # best_of ranks on them
    output = OutputOptions(
        logprobs=logprobs if o.reports else None,
        prompt_logprobs=o.logprobs if o.echo and o.logprobs is not None else None,
        grammar=o.grammar, prompt_length=prompt_length)
    return dataclasses.replace(base, output=output)


def echo_text(prompt: Any, tokens: Sequence[int], pieces: Sequence[bytes]) -> str:
    """The text `echo` puts before a completion: the prompt as sent (a string), or the text of
    its tokens (a token-id prompt)."""
    if isinstance(prompt, str):
        return prompt
    return logprob_format.prompt_offsets(tokens, pieces)[1]


def best_of(outs: Sequence["Generation"], runs: int, n: int) -> list["Generation"]:
    """Of every prompt's `runs` completions, the `n` with the highest cumulative
    log-probability (ties: the lower index), renumbered prompt by prompt, best first."""
    chosen: list["Generation"] = []
    for g in range(0, len(outs), runs):
        group = sorted(outs[g:g + runs], key=lambda o: (-o.cumulative_logprob, o.index))
        for rank, out in enumerate(group[:n]):
            out.index = (g // runs) * n + rank
            chosen.append(out)
    return chosen


def logprobs_of(out: "Generation", pieces: Sequence[bytes], *, prompt: bool = True,
                since: int = 0) -> Optional[dict[str, Any]]:
    """The choice's `logprobs` field: its tokens from `since` on, and with `prompt` an echoed
    prompt's first (None when the request asked for none)."""
    gen = out.request
    if gen.outputs.logprobs is None:
        return None
    if gen.kind == "chat":
        return logprob_format.chat(out.logprobs[since:], pieces)
    entries: list[Optional[TokenLogprob]] = []
    tokens: list[int] = []
    offsets: list[int] = []
    base = 0
    if out.echo is not None:
        base = len(out.echo)
        if prompt:
            entries, tokens, offsets = _prompt_part(out, pieces)
    entries += out.logprobs[since:]
    tokens += out.tokens[since:since + len(out.logprobs[since:])]
    offsets += [base + o for o in out.offsets[since:since + len(out.logprobs[since:])]]
    return logprob_format.legacy(entries, tokens, offsets, pieces)


def prompt_logprobs_of(out: "Generation", pieces: Sequence[bytes]) -> Optional[dict[str, Any]]:
    """The echoed prompt's part of `logprobs` (the first chunk of a streamed echo)."""
    if out.request.outputs.logprobs is None or out.echo is None:
        return None
    return logprob_format.legacy(*_prompt_part(out, pieces), pieces)


def _prompt_part(out: "Generation", pieces: Sequence[bytes],
                 ) -> tuple[list[Optional[TokenLogprob]], list[int], list[int]]:
    prompt = list(out.prompt)
    entries: list[Optional[TokenLogprob]] = [None, *(out.prompt_logprobs or ())]
    entries = (entries + [None] * len(prompt))[:len(prompt)]
    offsets, text = logprob_format.prompt_offsets(prompt, pieces)
    echo = out.echo
    if echo is not None and text != echo and text.endswith(echo):
        # The prompt as sent, without what the tokenizer put before it (SentencePiece's
        # leading space): the offsets are into the echoed text.
        shift = len(text) - len(echo)
        offsets = [o - shift if o > shift else 0 for o in offsets]
    return entries, prompt, offsets
