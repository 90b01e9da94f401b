"""Dynamo's token-id requests into this server's engine, and its events back out.

Nothing here imports Dynamo: `worker.py` wraps `EngineAdapter` in Dynamo's `LLMEngine`.

Dynamo's frontend tokenizes the prompt (with the folder `hf_export` writes) and hands the
backend a request dict (its `PreprocessedRequest`): `token_ids`, `sampling_options`,
`stop_conditions`, `output_options`, `routing`, ... The backend yields chunks
``{"token_ids": [...], "index": 0}``, the last with ``finish_reason`` and
``completion_usage``. Stop strings are Dynamo's: its postprocessor detokenizes and matches
them, then stops the request (the engine request is cancelled through `abort` or by closing
the stream).

`map_request` turns the dict into the engine's request, or refuses it (`Unsupported`, with the
reason) when it asks for something this server has no counterpart for: several choices (`n`,
`best_of`), beam search, a length penalty, guided decoding, log-probabilities, a thinking
budget. BOS: Dynamo's `/v1/completions` tokenizes without it, so the prompt gets the model's
BOS in front when the model adds one (llama.cpp's `add_bos`) and the prompt does not already
start with it: a prompt is the same tokens (the same cached prefix) whether it came through
Dynamo or straight to `skippy-scheduler serve`.
"""
from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Mapping, Optional

from .._validate import as_float
from ..engine import FinishEvent, Request as EngineRequest, TokenEvent
from ..sampling import SamplingParams
from ..types import RejectReason

_U64 = (1 << 64) - 1

# Keys of Dynamo's SamplingOptions and StopConditions this server honours (the rest, when set
# to something other than their neutral value, are refused).
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
                 "frequency_penalty", "repetition_penalty")
# Options whose neutral values are accepted (a client library may send them).
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "n": (None, 1), "best_of": (None, 1), "use_beam_search": (None, False),
    "length_penalty": (None, 1, 1.0), "guided_decoding": (None,),
    "include_stop_str_in_output": (None, False, True),  # Dynamo's postprocessor's business
    "max_thinking_tokens": (None,), "logprobs": (None,), "prompt_logprobs": (None,),
}
_REASONS = {
    "n": "several choices per request (n > 1): send n requests",
    "best_of": "best_of > 1",
    "use_beam_search": "beam search",
    "length_penalty": "a length penalty (beam search only)",
    "guided_decoding": "guided decoding (JSON schema, regex, choice, grammar) through Dynamo",
    "max_thinking_tokens": "a thinking budget (max_thinking_tokens)",
    "logprobs": "log-probabilities through Dynamo",
    "prompt_logprobs": "prompt log-probabilities through Dynamo",
}


class Unsupported(ValueError):
    """A request this worker refuses: its message says what has no counterpart here."""


@dataclass(frozen=True)
class Vocabulary:
    """What the mapping needs to know about the model."""

    n_vocab: int
    n_ctx_seq: int  # tokens one request may hold (prompt + generated)
    bos: Optional[int]  # the BOS token put in front of prompts (None: the model adds none)


@dataclass(frozen=True)
class Mapped:
    """A Dynamo request as the engine takes it (less its id)."""

    prompt: list[int]
    max_tokens: int
    sampling: Optional[SamplingParams]
    stop_ids: frozenset[int]  # ids that end the generation (hidden and the client's)
    min_tokens: int
    priority: int = 0
    bos_added: bool = False


def _check_neutral(where: Mapping[str, Any], key: str) -> None:
    value = where.get(key)
    if value not in _NEUTRAL[key]:
        raise Unsupported(f"this backend (skippy-scheduler) does not support "
                          f"{_REASONS[key]}; got {key}={value!r}")


def _number(options: Mapping[str, Any], key: str, lo: float, hi: float) -> Optional[float]:
    value = options.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not math.isfinite(as_float(value)) or not lo <= value <= hi:
        raise Unsupported(f"{key} must be a number in [{lo:g}, {hi:g}], got {value!r}")
    return float(value)


def _integer(options: Mapping[str, Any], key: str, lo: int, hi: int) -> Optional[int]:
    value = options.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise Unsupported(f"{key} must be an integer in [{lo}, {hi}], got {value!r}")
    return value


def sampling_of(options: Mapping[str, Any], n_vocab: int, *, ignore_eos: bool,
                ) -> Optional[SamplingParams]:
    """Dynamo's sampling_options as this server's sampling (None: greedy, the fast path).
    Unset fields take the OpenAI defaults (temperature 1), as `serve` does."""
    for key in ("n", "best_of", "use_beam_search", "length_penalty", "guided_decoding"):
        _check_neutral(options, key)
    temperature = _number(options, "temperature", 0.0, 2.0)
    top_p = _number(options, "top_p", 0.0, 1.0)
    if top_p is not None and top_p <= 0:
        raise Unsupported(f"top_p must be in (0, 1], got {top_p}")
    top_k = _integer(options, "top_k", -1, n_vocab)
    min_p = _number(options, "min_p", 0.0, 1.0)
    seed = _integer(options, "seed", -(1 << 63), _U64)
    presence = _number(options, "presence_penalty", -2.0, 2.0)
    frequency = _number(options, "frequency_penalty", -2.0, 2.0)
    repetition = _number(options, "repetition_penalty", 0.0, 10.0)
    if repetition is not None and repetition <= 0:
        raise Unsupported(f"repetition_penalty must be > 0, got {repetition}")
    params = SamplingParams(
        temperature=1.0 if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p, top_k=0 if top_k is None else top_k,
        min_p=0.0 if min_p is None else min_p, seed=None if seed is None else seed & _U64,
        presence_penalty=presence or 0.0, frequency_penalty=frequency or 0.0,
        repetition_penalty=1.0 if repetition is None else repetition, ignore_eos=ignore_eos)
    return None if params.plain_greedy and not ignore_eos else params


def map_request(request: Mapping[str, Any], vocab: Vocabulary, *,
                add_bos: bool = True) -> Mapped:
    """Dynamo's request dict as the engine's request (Unsupported: refused, with the reason)."""
    tokens = request.get("token_ids")
    if not isinstance(tokens, list) or not tokens:
        raise Unsupported("the request has no prompt tokens (token_ids)")
    for t in tokens:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab.n_vocab:
            raise Unsupported(f"token id {t!r} is not in the vocabulary [0, {vocab.n_vocab})")
    prompt = list(tokens)
    bos_added = False
    if add_bos and vocab.bos is not None and prompt[0] != vocab.bos:
        prompt.insert(0, vocab.bos)
        bos_added = True
    stop = request.get("stop_conditions") or {}
    output = request.get("output_options") or {}
    for key in ("logprobs", "prompt_logprobs"):
        _check_neutral(output, key)
    _check_neutral(stop, "max_thinking_tokens")
    ignore_eos = bool(stop.get("ignore_eos") or False)
    sampling = sampling_of(request.get("sampling_options") or {}, vocab.n_vocab,
                           ignore_eos=ignore_eos)
    limit = vocab.n_ctx_seq
    if len(prompt) >= limit:
        raise Unsupported(f"the prompt has {len(prompt)} tokens; a request here holds at most "
                          f"{limit} (prompt and completion), which leaves no room to generate")
    max_tokens = _integer(stop, "max_tokens", 1, 1 << 31)
    if max_tokens is None:
        max_tokens = limit - len(prompt)
    elif len(prompt) + max_tokens > limit:
        raise Unsupported(f"the prompt ({len(prompt)} tokens) and max_tokens ({max_tokens}) "
                          f"exceed the {limit} tokens a request may hold here")
    min_tokens = _integer(stop, "min_tokens", 0, max_tokens) or 0
    # The model's end ids Dynamo adds (hidden) and the client's own (as Dynamo's backends
    # merge them): any of them ends the generation here, min_tokens holding them off.
    stop_ids: frozenset[int] = frozenset()
    for key in ("stop_token_ids_hidden", "stop_token_ids", "stop_token_ids_visible"):
        ids = stop.get(key) or []
        if not isinstance(ids, list) or any(isinstance(t, bool) or not isinstance(t, int)
                                            for t in ids):
            raise Unsupported(f"{key} must be token ids, got {ids!r}")
        stop_ids |= frozenset(ids)
    if min_tokens:
        held = tuple(sorted(stop_ids))
        position = len(prompt) + min_tokens
        sampling = (SamplingParams(temperature=0.0, min_end_position=position,
                                   min_end_tokens=held, ignore_eos=ignore_eos)
                    if sampling is None else
                    _replace(sampling, min_end_position=position, min_end_tokens=held))
    routing = request.get("routing") or {}
    priority = routing.get("priority") if isinstance(routing, dict) else None
    if isinstance(priority, bool) or not isinstance(priority, int):
        priority = 0
    return Mapped(prompt=prompt, max_tokens=max_tokens, sampling=sampling, stop_ids=stop_ids,
                  min_tokens=min_tokens, priority=priority, bos_added=bos_added)


def _replace(params: SamplingParams, **changes: Any) -> SamplingParams:
    import dataclasses

    return dataclasses.replace(params, **changes)


# -- streaming ------------------------------------------------------------------------------


class EngineRefused(RuntimeError):
    """The scheduler refused the request (`busy`: its queue is full, retry later)."""

    def __init__(self, message: str, busy: bool) -> None:
        super().__init__(message)
        self.busy = busy


class EngineFailed(RuntimeError):
    """The engine failed underneath a request (a host failure, a shutdown)."""


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


class EngineAdapter:
    """Runs Dynamo's requests on an `EngineRunner` (serve/runner.py): `stream` yields Dynamo's
    chunks for one request; `cancel` ends one from anywhere."""

    def __init__(self, runner: Any, vocab: Vocabulary, *, add_bos: bool = True) -> None:
        self.runner = runner
        self.vocab = vocab
        self.add_bos = add_bos
        self._open: dict[str, str] = {}  # Dynamo's request id -> the engine's
        self.requests = 0  # requests handed to the engine

    def cancel(self, request_id: str) -> None:
        rid = self._open.get(request_id)
        if rid is not None:
            self.runner.cancel(rid)

    async def stream(self, request: Mapping[str, Any], request_id: str,
                     stopped: Optional[Callable[[], bool]] = None,
                     ) -> AsyncIterator[dict[str, Any]]:
        """Dynamo's chunks for `request` (Unsupported before anything runs; EngineRefused,
        EngineFailed)."""
        mapped = map_request(request, self.vocab, add_bos=self.add_bos)
        loop = asyncio.get_running_loop()
        rid = f"dyn-{request_id}"
        from ..serve.runner import EngineUnavailable

        try:
            sub = self.runner.open(EngineRequest(rid, mapped.prompt, mapped.max_tokens,
                                                 sampling=mapped.sampling,
                                                 priority=mapped.priority), loop)
        except EngineUnavailable as exc:
            raise EngineRefused(str(exc), busy=True) from None
        self._open[request_id] = rid
        self.requests += 1
        prompt = len(mapped.prompt)
        produced = 0
        finished = False
        try:
            rejection = await sub.verdict
            if rejection is not None:
                finished = True
                busy = rejection.rejection is RejectReason.QUEUE_FULL
                raise EngineRefused(rejection.error or ("the engine's waiting queue is full"
                                                        if busy else "the request was refused"),
                                    busy=busy)
            while not finished:
                if stopped is not None and stopped():
                    yield {"token_ids": [], "index": 0, "finish_reason": "cancelled",
                           "completion_usage": _usage(prompt, produced)}
                    return
                events = await sub.next_batch()
                ids: list[int] = []
                reason: Optional[str] = None
                for event in events:
                    if type(event) is TokenEvent:
                        if event.token < 0:
                            continue
                        ids.append(event.token)
                        produced += 1
                        if event.token in mapped.stop_ids and produced >= mapped.min_tokens:
                            reason = "stop"
                            break
                    elif isinstance(event, FinishEvent):
                        finished = True
                        if sub.error is None and event.reason == "cancelled":
                            yield {"token_ids": ids, "index": 0, "finish_reason": "cancelled",
                                   "completion_usage": _usage(prompt, produced)}
                            return
                        if sub.error is not None or event.reason == "failed":
                            raise EngineFailed(sub.error or event.error
                                               or f"the request {event.reason}")
                        reason = event.reason  # "stop" (an end token) or "length"
                        break
                if reason is not None:
                    finished = True
                    yield {"token_ids": ids, "index": 0, "finish_reason": reason,
                           "completion_usage": _usage(prompt, produced)}
                    return
                if ids:
                    yield {"token_ids": ids, "index": 0}
        finally:
            self._open.pop(request_id, None)
            if not finished or not sub.finished:
                self.runner.cancel(rid)
            self.runner.close(sub)
