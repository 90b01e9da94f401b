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
budget, a constraint on the tokens it may sample (`allowed_token_ids`, `bad_words_token_ids`,
`logit_bias`, any other sampling option set that is not mapped here, and vLLM's passthrough
`extra_args.sampling_options`), and a malformed field (a section that is not a dict, a token
id outside the vocabulary, a priority outside i32).

BOS: Dynamo's `/v1/completions` tokenizes without it, so the prompt gets the model's BOS in
front when the model adds one (llama.cpp's `add_bos`) and the prompt does not already start
with it: a prompt is the same tokens (the same cached prefix) whether it came through Dynamo
or straight to `skippy-scheduler serve`. Token ids come as a list, or packed as one
little-endian int32 buffer (Dynamo's `DYN_TOKEN_IDS_AS_BYTES`), which is unpacked as Dynamo's
own `token_ids_to_list` does.

Priority: Dynamo's `routing.priority` is an i32, higher meaning more urgent (its vLLM handler
negates it for vLLM, which runs lower values first); the engine's is unsigned, higher first.
`engine_priority` maps one onto the other by adding 2^31, which keeps the order (0, Dynamo's
default, becomes 2^31; -1 runs after it, 1 before).
"""
from __future__ import annotations

import asyncio
import itertools
import math
import sys
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Mapping, Optional

from .._validate import as_float
from ..engine import FinishEvent, Request as EngineRequest, TokenEvent
from ..sampling import SamplingParams
from ..types import RejectReason

_U64 = (1 << 64) - 1
_I32 = 1 << 31

# Keys of Dynamo's SamplingOptions and StopConditions this server honours (the rest, when set
# to something other than their neutral value, are refused).
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
                 "frequency_penalty", "repetition_penalty")
# Sampling options that constrain what may be sampled, which nothing here enforces: refused when
# set to anything but an empty value (the names Dynamo and vLLM give them).
_CONSTRAINTS = {
    "allowed_token_ids": "allowed_token_ids (sampling only from the ids given)",
    "bad_words_token_ids": "bad_words_token_ids (token sequences never to be sampled)",
    "bad_words": "bad_words (words never to be sampled)",
    "logit_bias": "logit_bias",
    "logits_processors": "logits processors",
}


def _unset(value: Any) -> bool:
    """Whether an option's value leaves it off: None, False or an empty list, object or
    string (anything else asks for something; ignoring it would answer another request)."""
    return value is None or value is False or (
        isinstance(value, (list, tuple, dict, str)) and not value)


# Options whose neutral values are accepted (a client library may send them).
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "n": (None, 1), "best_of": (None, 1), "use_beam_search": (None, False),
    "length_penalty": (None, 1, 1.0), "guided_decoding": (None,),
    "include_stop_str_in_output": (None, False, True),  # Dynamo's postprocessor's business
    # How the frontend turns tokens into text (its own detokenizer): nothing to enforce here.
    "detokenize": (None, False, True), "skip_special_tokens": (None, False, True),
    "spaces_between_special_tokens": (None, False, True),
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
    priority: int = _I32  # the engine's (engine_priority): Dynamo's 0
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
    for key, value in options.items():
        if key in SAMPLING_KEYS or key in _NEUTRAL or _unset(value):
            continue
        what = _CONSTRAINTS.get(key, f"the sampling option {key}")
        raise Unsupported(f"this backend (skippy-scheduler) does not support {what}; "
                          f"got {key}={value!r}")
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


def token_ids(value: Any) -> list[int]:
    """Dynamo's `token_ids` as a list: a list or tuple of ints, or one buffer of little-endian
    int32s (`DYN_TOKEN_IDS_AS_BYTES`, as Dynamo's `token_ids_to_list` unpacks it); anything
    else is Unsupported. The ids are not checked against the vocabulary here."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        import array

        raw = memoryview(value).cast("B")
        if raw.nbytes % 4:
            raise Unsupported(f"packed token_ids hold {raw.nbytes} bytes, not a multiple of 4 "
                              f"(little-endian int32 ids)")
        ids = array.array("i" if array.array("i").itemsize == 4 else "l")
        ids.frombytes(raw)
        if sys.byteorder != "little":
            ids.byteswap()
        return ids.tolist()
    if isinstance(value, (list, tuple)):
        return list(value)
    raise Unsupported(f"token_ids must be a list of token ids or their packed int32 bytes, "
                      f"got {type(value).__name__}")


def _section(request: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = request.get(key)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise Unsupported(f"{key} must be an object, got {type(value).__name__}")
    return value


def _in_vocabulary(t: Any, n_vocab: int) -> bool:
    return not isinstance(t, bool) and isinstance(t, int) and 0 <= t < n_vocab


def engine_priority(priority: Any) -> int:
    """Dynamo's `routing.priority` (an i32, higher first; None: 0) as the engine's (unsigned,
    higher first): shifted up by 2^31, which keeps the order. Unsupported for anything else."""
    if priority is None:
        priority = 0
    if isinstance(priority, bool) or not isinstance(priority, int) or \
            not -_I32 <= priority < _I32:
        raise Unsupported(f"routing.priority must be an integer in [{-_I32}, {_I32 - 1}] "
                          f"(Dynamo's i32), got {priority!r}")
    return priority + _I32


def map_request(request: Mapping[str, Any], vocab: Vocabulary, *,
                add_bos: bool = True) -> Mapped:
    """Dynamo's request dict as the engine's request (Unsupported: refused, with the reason)."""
    if not isinstance(request, Mapping):
        raise Unsupported(f"the request must be an object, got {type(request).__name__}")
    raw = request.get("token_ids")
    tokens = token_ids(raw) if raw is not None else []
    if not tokens:
        raise Unsupported("the request has no prompt tokens (token_ids)")
    for t in tokens:
        if not _in_vocabulary(t, vocab.n_vocab):
            raise Unsupported(f"token id {t!r} is not in the vocabulary [0, {vocab.n_vocab})")
    prompt = list(tokens)
    bos_added = False
    if add_bos and vocab.bos is not None and prompt[0] != vocab.bos:
        prompt.insert(0, vocab.bos)
        bos_added = True
    stop = _section(request, "stop_conditions")
    output = _section(request, "output_options")
    options = _section(request, "sampling_options")
    routing = _section(request, "routing")
    extra = _section(request, "extra_args")
    passthrough = extra.get("sampling_options")
    if not _unset(passthrough):  # vLLM's handler applies these over sampling_options
        raise Unsupported(f"this backend (skippy-scheduler) does not apply vLLM's sampling "
                          f"options passthrough (extra_args.sampling_options); got "
                          f"{passthrough!r}")
    for key in ("logprobs", "prompt_logprobs"):
        _check_neutral(output, key)
    _check_neutral(stop, "max_thinking_tokens")
    ignore_eos = bool(stop.get("ignore_eos") or False)
    sampling = sampling_of(options, vocab.n_vocab, ignore_eos=ignore_eos)
    priority = engine_priority(routing.get("priority"))
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
        if not isinstance(ids, (list, tuple)) or any(isinstance(t, bool) or
                                                     not isinstance(t, int) for t in ids):
            raise Unsupported(f"{key} must be token ids, got {ids!r}")
        for t in ids:
            if not _in_vocabulary(t, vocab.n_vocab):
                raise Unsupported(f"{key}: token id {t!r} is not in the vocabulary "
                                  f"[0, {vocab.n_vocab})")
        stop_ids |= frozenset(ids)
    if min_tokens:
        held = tuple(sorted(stop_ids))
        position = len(prompt) + min_tokens
        sampling = (SamplingParams(temperature=0.0, min_end_position=position,
                                   min_end_tokens=held, ignore_eos=ignore_eos)
                    if sampling is None else
                    _replace(sampling, min_end_position=position, min_end_tokens=held))
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
    chunks for one request; `cancel` ends one from anywhere.

    Each stream runs under an engine id of its own (``dyn-<Dynamo's id>.<n>``): Dynamo's id is
    the client's `x-dynamo-request-id` when it sends one, so a retry may come while the first
    request still runs, and each keeps its own tokens. `cancel` (Dynamo's abort) ends every
    stream open under the id."""

    def __init__(self, runner: Any, vocab: Vocabulary, *, add_bos: bool = True) -> None:
        self.runner = runner
        self.vocab = vocab
        self.add_bos = add_bos
        self._open: dict[str, list[str]] = {}  # Dynamo's request id -> the engine's, in order
        self._serial = itertools.count()
        self.requests = 0  # requests handed to the engine

    def cancel(self, request_id: str) -> None:
        for rid in tuple(self._open.get(request_id, ())):
            self.runner.cancel(rid)

    def _forget(self, request_id: str, rid: str) -> None:
        rids = self._open.get(request_id)
        if rids is not None and rid in rids:
            rids.remove(rid)
            if not rids:
                del self._open[request_id]

    async def stream(self, request: Mapping[str, Any], request_id: str,
                     stopped: Optional[Callable[[], bool]] = None,
                     ) -> AsyncIterator[dict[str, Any]]:
        """Dynamo's chunks for `request` (Unsupported before anything runs; EngineRefused,
        EngineFailed)."""
        mapped = map_request(request, self.vocab, add_bos=self.add_bos)
        loop = asyncio.get_running_loop()
        rid = f"dyn-{request_id}.{next(self._serial)}"
        from ..serve.runner import EngineUnavailable

        try:
            sub = self.runner.open(EngineRequest(rid, mapped.prompt, mapped.max_tokens,
                                                 sampling=mapped.sampling,
                                                 priority=mapped.priority), loop)
        except EngineUnavailable as exc:
            raise EngineRefused(str(exc), busy=True) from None
        self._open.setdefault(request_id, []).append(rid)
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
            self._forget(request_id, rid)
            if not finished or not sub.finished:
                self.runner.cancel(rid)
            self.runner.close(sub)
