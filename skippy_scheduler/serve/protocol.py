"""OpenAI request bodies to generation requests, with a 400 that names the field for anything
this server cannot honour.

Every field of the completions and chat completions APIs is either used, accepted in its
neutral form only (`suffix: ""`, `tools: []`, ...: anything else names the field
as unsupported), or ignored because it does not change the output (`user`, which must still be
a string). Fields nobody defined are ignored with a logged warning (vLLM's behaviour), or refused
under `--strict-request-fields`. The body arrives here already
checked as text (no lone surrogate anywhere) and bounded in depth (`body.decode_json`); a chat
message's content must not hold NUL (see `_no_nul`).

Extensions (as vLLM has them): `top_k`, `min_p`, `repetition_penalty`, `ignore_eos`,
`return_token_ids` (token ids in every choice and chunk), `priority` (higher runs first, the
opposite of vLLM's sense, see README "Priority"; it also preempts lower priorities unless the
server runs with --no-priority-preemption), `stop_token_ids`, `include_stop_str_in_output`,
`min_tokens`, and this server's extension object `skippy` (`ttft_ms`, `itl_ms`: the request's
deadlines).

Fields of other servers' APIs (the block "fields other servers define" below): vLLM's and
llama-server's names are aliases, neutral-only or ignored; a field nobody defined is ignored
with a logged warning, as vLLM does, unless the server is strict (`strict_request_fields`),
which refuses it as before.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field, replace
from typing import Any, Optional

from .._validate import I32_MAX, MAX_MS, as_float
from ..sampling import SamplingParams
from .errors import RequestError
from .options import OutputRequest, parse_outputs

log = logging.getLogger("skippy_scheduler.serve")

_U64 = (1 << 64) - 1
MAX_STOP_STRINGS = 16
MAX_PROMPTS = 64  # prompts in one completions request
MAX_N = 16  # choices per prompt

# Accepted only with these values (None means "absent" too).
_NEUTRAL_COMMON: dict[str, tuple[Any, ...]] = {}
_NEUTRAL_COMPLETION = dict(_NEUTRAL_COMMON, suffix=(None, ""))
_NEUTRAL_CHAT = dict(_NEUTRAL_COMMON, tools=(None, []), tool_choice=(None, "none"),
                     functions=(None, []), function_call=(None, "none"),
                     parallel_tool_calls=(None, True, False), audio=(None,),
                     modalities=(None, ["text"]), prediction=(None,),
                     web_search_options=(None,), reasoning_effort=(None,),
                     store=(None, False), metadata=(None, {}), service_tier=(None, "auto",
                                                                           "default"))
# A message's fields accepted in their neutral form only: what an answer's message carries
# (`refusal: null`, `tool_calls: []`, ...), so that a client can send it back in the next turn.
_NEUTRAL_MESSAGE: dict[str, tuple[Any, ...]] = {
    "refusal": (None,), "tool_calls": (None, []), "function_call": (None,), "audio": (None,),
    "annotations": (None, [])}
_MESSAGE_FIELDS = {"role", "content", "name"} | set(_NEUTRAL_MESSAGE)
_IGNORED = {"user"}
_SHARED = {"model", "n", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
           "presence_penalty", "frequency_penalty", "repetition_penalty", "repeat_last_n",
           "logit_bias", "stop",
           "stream", "stream_options", "ignore_eos", "return_token_ids", "priority", "skippy"}
# serve/options.py parses these
_OUTPUT_COMPLETION = {"logprobs", "echo", "best_of", "response_format"}
_OUTPUT_CHAT = {"logprobs", "top_logprobs", "response_format"}
_COMPLETION_FIELDS = _SHARED | {"prompt"} | set(_NEUTRAL_COMPLETION) | _IGNORED | _OUTPUT_COMPLETION
_CHAT_FIELDS = _SHARED | {"messages", "max_completion_tokens"} | set(
    _NEUTRAL_CHAT) | _IGNORED | _OUTPUT_CHAT
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


@dataclass
class GenerationRequest:
    """What the server generates for one request; `prompt` is still text or ids here."""

    kind: str  # "completion" or "chat"
    model: Optional[str]
    prompt: Any = None  # completions: str or list[int] (the first of `prompts`)
    prompts: list[Any] = field(default_factory=list)  # completions: one choice each
    messages: list[tuple[str, str]] = field(default_factory=list)  # chat: (role, text)
    max_tokens: Optional[int] = None  # None: the API's default
    max_tokens_field: str = "max_tokens"  # the field that gave it (a 400 names it)
    rest_of_lane: bool = False  # llama-server's n_predict -1: no bound but the lane's cells
    sampling: Optional[SamplingParams] = None  # None: greedy
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # stream_options.continuous_usage_stats (with include_usage)
    return_token_ids: bool = False
    priority: int = 0
    n: int = 1  # choices per prompt (serve/choices.py: choice j samples with seed + j)
    stop_token_ids: frozenset[int] = frozenset()  # generation ends after any of these
    include_stop_str_in_output: bool = False  # the matched stop string ends the text
    outputs: OutputRequest = field(default_factory=OutputRequest)  # serve/options.py
    min_tokens: int = 0  # no end token, stop token or stop string ends it before these many
    ttft_ms: Optional[float] = None  # "skippy": {"ttft_ms": ..}: first-token deadline
    itl_ms: Optional[float] = None  # "skippy": {"itl_ms": ..}: its inter-token target


# -- fields other servers define ---------------------------------------------------------------
# Routers forward bodies with fields of their own (vllm-router adds `no_stop_trim`,
# `skip_special_tokens`, `return_hidden_states`, `echo: false`, `ignore_eos`), and clients
# written for vLLM or llama-server send theirs. Each known one is an alias of a field this
# server honours, accepted in its neutral value only (anything else is a 400 naming it: this
# server cannot honour it), or ignored because it cannot change the output here.
_ALIASES = {"n_predict": "max_tokens", "repeat_penalty": "repetition_penalty",
            "penalty_last_n": "repeat_last_n"}
_NEUTRAL_FOREIGN: dict[str, tuple[Any, ...]] = {
    "echo": (None, False), "best_of": (None, 1),
    "no_stop_trim": (None, False), "return_hidden_states": (None, False),
    "skip_special_tokens": (None, True),  # control tokens have no text here
    "spaces_between_special_tokens": (None, True), "add_special_tokens": (None, True),
    "use_beam_search": (None, False), "length_penalty": (None, 1, 1.0),
    "prompt_logprobs": (None,), "return_tokens_as_token_ids": (
        None, False), "allowed_token_ids": (None,), "bad_words": (None, []),
    "truncate_prompt_tokens": (None,), "logits_processors": (None,),
    "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,),
    "guided_grammar": (None,), "guided_decoding_backend": (None,),
    "structured_outputs": (None,), "grammar": (None, ""), "json_schema": (None,),
    "typical_p": (None, 1, 1.0), "mirostat": (None, 0), "n_probs": (None, 0),
    "dynatemp_range": (None, 0, 0.0), "prompt_embeds": (None,),
    # llama-server's samplers this server does not run, in their off values.
    "dry_multiplier": (None, 0, 0.0), "xtc_probability": (None, 0, 0.0),
    "top_n_sigma": (None, -1, -1.0), "dynatemp_exponent": (None, 1, 1.0),
    # These change the rendered chat prompt: only the template's defaults are run.
    "add_generation_prompt": (None, True), "continue_final_message": (None, False),
    "chat_template_kwargs": (None, {}), "documents": (None, []),
}
# Cache and transfer hints, ids, slots, timings: not acted on here. A value other than the
# listed defaults is ignored with a logged warning naming the field (None: any value passes
# silently, as a request id does).
_IGNORED_FOREIGN: dict[str, Optional[tuple[Any, ...]]] = {
    "request_id": None, "cache_prompt": (True,), "cache_salt": (), "vllm_xargs": (),
    "kv_transfer_params": (), "id_slot": (-1,), "n_keep": (0,), "t_max_predict_ms": (0,),
    "timings_per_token": (False,), "return_tokens": (False,),
    # The settings of llama-server samplers that are off (refused above when they are on).
    "dry_base": None, "dry_allowed_length": None, "dry_penalty_last_n": None,
    "dry_sequence_breakers": None, "xtc_threshold": None}
_FOREIGN = set(_ALIASES) | set(_NEUTRAL_FOREIGN) | set(_IGNORED_FOREIGN) | {
    "stop_token_ids", "include_stop_str_in_output", "min_tokens"}


def _rest_of_lane(body: dict[str, Any]) -> bool:
    """llama-server's `n_predict: -1` without a `max_tokens`: no bound but the lane's."""
    return body.get("n_predict") == -1 and body.get("max_tokens") is None


def _foreign(body: dict[str, Any], allowed: set[str], strict: bool) -> dict[str, Any]:
    """`body` with other servers' fields resolved: aliases renamed, neutral ones checked,
    ignored ones dropped, unknown ones dropped with a warning (refused when `strict`)."""
    out = {}
    unknown = []
    ignored = []
    for name, value in body.items():
        if name in allowed:
            out[name] = value
        elif name not in _FOREIGN:
            if strict:
                raise RequestError(f"Unrecognized request argument supplied: {name}",
                                   param=name)
            unknown.append(name)
        elif name in _IGNORED_FOREIGN and _noticed(name, value):
            ignored.append(name)
    for alias, name in _ALIASES.items():
        if body.get(alias) is None:
            continue
        if alias == "n_predict" and _rest_of_lane(body):
            continue  # llama-server's "until the context ends": no max_tokens (_parse_head)
        if body.get(name) is not None and body[name] != body[alias]:
            raise RequestError(f"'{alias}' and '{name}' disagree", param=alias)
        out[name] = body[alias]
    _check_fields(body, set(body), {k: v for k, v in _NEUTRAL_FOREIGN.items()
                                    if k not in allowed})
    if unknown:
        log.warning("ignoring unrecognized request fields: %s", ", ".join(sorted(unknown)))
    if ignored:
        log.warning("ignoring request fields this server does not act on: %s",
                    ", ".join(sorted(ignored)))
    return out


def _noticed(name: str, value: Any) -> bool:
    """Whether an ignored field's value is worth a warning (it is not the silent default)."""
    silent = _IGNORED_FOREIGN[name]
    return silent is not None and value is not None and not any(
        value == v and type(value) is type(v) for v in silent)


def _stop_token_ids(body: dict[str, Any], n_vocab: int) -> frozenset[int]:
    value = body.get("stop_token_ids")
    if value is None:
        return frozenset()
    if not isinstance(value, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < n_vocab for t in value):
        raise RequestError(f"'stop_token_ids' must be an array of token ids in [0, {n_vocab})",
                           param="stop_token_ids")
    return frozenset(value)


# -- field checks: each raises RequestError(param=name) -------------------------------------


MIN_TARGET_MS = 1e-3  # a request's first-token and inter-token budgets: 1 µs to MAX_MS


def _deadlines(body: dict[str, Any]) -> tuple[Optional[float], Optional[float]]:
    """The extension object `"skippy": {"ttft_ms": T, "itl_ms": I}` (both optional, positive
    finite numbers of milliseconds): the request's first-token deadline from its arrival and its
    inter-token target (docs/behaviour.md §2.13)."""
    ext = body.get("skippy")
    if ext is None:
        return None, None
    if not isinstance(ext, dict):
        raise RequestError(f"'skippy' must be an object, got {_json_type(ext)}", param="skippy")
    unknown = sorted(set(ext) - {"ttft_ms", "itl_ms"})
    if unknown:
        raise RequestError(f"'skippy.{unknown[0]}' is not a known field (ttft_ms, itl_ms)",
                           param=f"skippy.{unknown[0]}")
    out = []
    for name in ("ttft_ms", "itl_ms"):
        value = ext.get(name)
        # 1 µs to the command line's ceiling: the engine checks the seconds in µs once more,
        # past the inter-token target's planning share, and a value at the edges of a float
        # (1e308, 5e-324) failed there after the request was taken.
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not MIN_TARGET_MS <= value <= MAX_MS):
            raise RequestError(f"'skippy.{name}' must be a number of milliseconds from "
                               f"{MIN_TARGET_MS:g} to {MAX_MS:g}, got {value!r}",
                               param=f"skippy.{name}")
        out.append(None if value is None else float(value))
    return out[0], out[1]


def _present(body: dict[str, Any], name: str) -> bool:
    return body.get(name) is not None


def _number(body: dict[str, Any], name: str, lo: float, hi: float, *,
            lo_open: bool = False) -> Optional[float]:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestError(f"'{name}' must be a number, got {_json_type(value)}", param=name)
    value = as_float(value)
    below = value <= lo if lo_open else value < lo
    if not math.isfinite(value) or below or value > hi:
        left = "(" if lo_open else "["
        raise RequestError(f"'{name}' must be in {left}{_fmt(lo)}, {_fmt(hi)}], got {value}",
                           param=name)
    return value


def _integer(body: dict[str, Any], name: str, lo: int, hi: int) -> Optional[int]:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"'{name}' must be an integer, got {_json_type(value)}", param=name)
    if not lo <= value <= hi:
        raise RequestError(f"'{name}' must be in [{lo}, {hi}], got {value}", param=name)
    return value


def _boolean(body: dict[str, Any], name: str, where: str = "") -> bool:
    """`body[name]` as a bool (absent or null: False); `where` prefixes the name in errors."""
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise RequestError(f"'{where}{name}' must be a boolean, got {_json_type(value)}",
                           param=where + name)
    return value


def _fmt(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else repr(x)


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def _check_fields(body: dict[str, Any], allowed: set[str], neutral: dict[str, tuple[Any, ...]],
                  where: str = "") -> None:
    """Refuse a field not `allowed`, or a `neutral` one in another value; `where` prefixes the
    names (`messages[0].` for a message's fields)."""
    for name in body:
        if name not in allowed:
            if where:
                raise RequestError(f"'{where}{name}' is not supported by this server",
                                   param=where + name)
            raise RequestError(f"Unrecognized request argument supplied: {name}", param=name)
    for name, values in neutral.items():
        value = body.get(name)
        if value is not None and not any(value == v and type(value) is type(v)
                                         for v in values if v is not None):
            raise RequestError(f"'{where}{name}' is not supported by this server "
                               f"(only {_neutral_text(values)})", param=where + name)


def _neutral_text(values: tuple[Any, ...]) -> str:
    shown = [v for v in values if v is not None]
    return " or ".join(repr(v) for v in shown) if shown else "null"


def _stop(body: dict[str, Any]) -> list[str]:
    value = body.get("stop")
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise RequestError("'stop' must be a string or an array of strings", param="stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise RequestError(f"'stop' may hold at most {MAX_STOP_STRINGS} strings", param="stop")
    if any(not s for s in stops):
        raise RequestError("'stop' strings must not be empty", param="stop")
    return list(dict.fromkeys(stops))


def _logit_bias(body: dict[str, Any], n_vocab: int) -> dict[int, float]:
    value = body.get("logit_bias")
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise RequestError("'logit_bias' must be an object mapping token ids to biases",
                           param="logit_bias")
    out = {}
    for key, bias in value.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            token = -1
        if token < 0 or token >= n_vocab or str(token) != str(key).strip():
            raise RequestError(f"'logit_bias' key {key!r} is not a token id in [0, {n_vocab})",
                               param="logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not (
                -100 <= bias <= 100):
            raise RequestError(f"'logit_bias' value for token {token} must be a number in "
                               "[-100, 100]", param="logit_bias")
        out[token] = float(bias)
    return out


def _sampling(body: dict[str, Any], n_vocab: int) -> Optional[SamplingParams]:
    temperature = _number(body, "temperature", 0, 2)
    top_p = _number(body, "top_p", 0, 1, lo_open=True)
    top_k = _integer(body, "top_k", -1, n_vocab)
    min_p = _number(body, "min_p", 0, 1)
    seed = _integer(body, "seed", -(1 << 63), _U64)
    if seed == -1:
        seed = None  # llama-server's "a random seed"
    window = _integer(body, "repeat_last_n", -1, I32_MAX)
    presence = _number(body, "presence_penalty", -2, 2)
    frequency = _number(body, "frequency_penalty", -2, 2)
    repetition = _number(body, "repetition_penalty", 0, 10, lo_open=True)
    bias = _logit_bias(body, n_vocab)
    ignore_eos = _boolean(body, "ignore_eos")
    params = SamplingParams(
        temperature=1.0 if temperature is None else temperature,  # the API's default
        top_p=1.0 if top_p is None else top_p,
        top_k=0 if top_k is None else top_k,
        min_p=0.0 if min_p is None else min_p,
        seed=None if seed is None else seed & _U64,
        presence_penalty=presence or 0.0, frequency_penalty=frequency or 0.0,
        repetition_penalty=1.0 if repetition is None else repetition,
        # llama-server's repeat_last_n: -1 is the whole context, 0 turns the penalties off.
        penalty_last_n=64 if window is None else I32_MAX if window == -1 else window,
        logit_bias=bias, ignore_eos=ignore_eos)
    return None if params.plain_greedy and not ignore_eos else params


def _common(body: Any, kind: str, n_vocab: int) -> GenerationRequest:
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {_json_type(body)}")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError("'model' must be a string", param="model")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise RequestError("'user' must be a string", param="user")
    stream = _boolean(body, "stream")
    include_usage = continuous_usage = False
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise RequestError("'stream_options' is only allowed when 'stream' is true",
                               param="stream_options")
        if not isinstance(options, dict) or set(options) - {"include_usage",
                                                             "continuous_usage_stats",
                                                             "include_obfuscation"}:
            raise RequestError("'stream_options' must be an object with 'include_usage', "
                               "'continuous_usage_stats' or 'include_obfuscation'",
                               param="stream_options")
        include_usage = _boolean(options, "include_usage", "stream_options.")
        _boolean(options, "include_obfuscation", "stream_options.")  # no padding either way
        # Usage on every chunk, as vLLM gives it: only together with include_usage.
        continuous_usage = (_boolean(options, "continuous_usage_stats", "stream_options.")
                            and include_usage)
    ttft_ms, itl_ms = _deadlines(body)
    return GenerationRequest(
        kind=kind, model=model, sampling=_sampling(body, n_vocab), stop=_stop(body),
        ttft_ms=ttft_ms, itl_ms=itl_ms,
        stream=stream, include_usage=include_usage, continuous_usage=continuous_usage,
        return_token_ids=_boolean(body, "return_token_ids"),
        priority=_integer(body, "priority", 0, (1 << 63) - 1) or 0,
        n=_integer(body, "n", 1, MAX_N) or 1)


def _parse_head(body: Any, kind: str, known: Any, neutral: Any, n_vocab: int,
                strict: bool) -> tuple[Any, GenerationRequest]:
    """What both endpoints read first: the fields checked against the endpoint's (`known`,
    `neutral`), the common fields, the honoured foreign ones; (the body as checked, request)."""
    raw: Any = body
    if isinstance(body, dict):
        body = _foreign(body, known, strict)
        _check_fields(body, known, neutral)
    req = _common(body, kind, n_vocab)
    req.rest_of_lane = isinstance(raw, dict) and _rest_of_lane(raw)
    _honour_foreign(req, raw, n_vocab)
    return body, req


def parse_completion(body: Any, n_vocab: int, strict: bool = False) -> GenerationRequest:
    """A `/v1/completions` body (already JSON-decoded)."""
    body, req = _parse_head(body, "completion", _COMPLETION_FIELDS, _NEUTRAL_COMPLETION,
                            n_vocab, strict)
    # 0 scores the prompt with echo and generates nothing (`Generation.scoring`).
    req.max_tokens = _integer(body, "max_tokens", 0, (1 << 32) - 1)
    if "prompt" not in body or body["prompt"] is None:
        raise RequestError("'prompt' is required", param="prompt")
    req.prompts = _prompts(body["prompt"], n_vocab)
    if len(req.prompts) * req.n > MAX_PROMPTS:
        raise RequestError(f"'n' times the prompts may be at most {MAX_PROMPTS} choices, got "
                           f"{len(req.prompts) * req.n}", param="n")
    req.prompt = req.prompts[0]
    req.outputs = parse_outputs(body, "completion", req.n, req.stream)
    _check_grammar_can_end(req)
    if req.max_tokens == 0 and not req.outputs.echo:
        raise RequestError("'max_tokens' 0 generates nothing: it scores the prompt, and "
                           "only with 'echo': true", param="max_tokens")
    if req.max_tokens == 0 and req.min_tokens:
        raise RequestError(f"'min_tokens' must be at most max_tokens=0, got {req.min_tokens}",
                           param="min_tokens")
    runs = len(req.prompts) * (req.outputs.best_of or req.n)
    if runs > MAX_PROMPTS:
        raise RequestError(f"'best_of' times the prompts may be at most {MAX_PROMPTS} "
                           f"completions, got {runs}", param="best_of")
    return req


def _prompts(value: Any, n_vocab: int) -> list[Any]:
    """One prompt, or several (an array of strings or of token-id arrays): one choice each."""
    if isinstance(value, list) and value and all(isinstance(v, (str, list)) for v in value):
        if len(value) > MAX_PROMPTS:
            raise RequestError(f"'prompt' may hold at most {MAX_PROMPTS} prompts, got "
                               f"{len(value)}", param="prompt")
        return [_prompt(v, n_vocab, f"prompt[{k}]") for k, v in enumerate(value)]
    return [_prompt(value, n_vocab)]


def _honour_foreign(req: GenerationRequest, raw: dict[str, Any], n_vocab: int) -> None:
    req.stop_token_ids = _stop_token_ids(raw, n_vocab)
    req.include_stop_str_in_output = _boolean(raw, "include_stop_str_in_output")
    req.min_tokens = _integer(raw, "min_tokens", 0, (1 << 32) - 1) or 0


# -- min_tokens (vLLM's definition) -----------------------------------------------------------
# The first `min_tokens` generated tokens can be neither an end-of-generation token nor one of
# `stop_token_ids` (the host's sampler holds them off: `SamplingParams.min_end_position`), and
# no stop string that ends within their text stops the generation (the app's StopMatcher is
# fed their text as held). `max_tokens` below it is a 400.


def _check_grammar_can_end(req: GenerationRequest) -> None:
    """A grammar that is complete allows only an end token: with the end held off by
    min_tokens, nothing could be sampled (llama.cpp's grammar sampler aborts the process)."""
    if req.outputs.grammar is not None and req.min_tokens:
        raise RequestError("'response_format' cannot be combined with 'min_tokens' (a complete "
                           "JSON value must be able to end)", param="min_tokens")


def with_min_tokens(gen: GenerationRequest, sampling: Optional[SamplingParams],
                    prompt_tokens: int, max_tokens: int) -> Optional[SamplingParams]:
    """The sampling of one choice whose prompt has `prompt_tokens` tokens and whose budget is
    `max_tokens`, with the request's min_tokens held (unchanged when it is 0)."""
    if not gen.min_tokens:
        return sampling
    if gen.min_tokens > max_tokens:
        raise RequestError(f"'min_tokens' must be at most max_tokens={max_tokens}, got "
                           f"{gen.min_tokens}", param="min_tokens")
    position, held = prompt_tokens + gen.min_tokens, tuple(gen.stop_token_ids)
    if sampling is None:
        return SamplingParams(temperature=0.0, min_end_position=position, min_end_tokens=held)
    return replace(sampling, min_end_position=position, min_end_tokens=held)


def _prompt(value: Any, n_vocab: int, name: str = "prompt") -> Any:
    """One prompt; `name` is how the messages name it (`prompt[k]`, the k-th of several)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise RequestError("'prompt' must be a string, an array of token ids, or an array "
                           "of those (one choice each)", param="prompt")
    if not value:
        # "" is accepted: it tokenizes to the model's BOS token, as in llama-server; a token
        # list is used as given, so an empty one would leave nothing to run.
        raise RequestError(f"'{name}' as token ids must hold at least one id (an empty "
                           f"string is accepted: it is the BOS token alone)", param="prompt")
    for i, t in enumerate(value):
        if isinstance(t, bool) or not isinstance(t, int):
            raise RequestError(f"'{name}[{i}]' must be a token id, got {_json_type(t)}",
                               param="prompt")
        if not 0 <= t < n_vocab:
            raise RequestError(f"'{name}[{i}]' = {t} is not a token id in [0, {n_vocab})",
                               param="prompt")
    return list(value)


def parse_chat(body: Any, n_vocab: int, strict: bool = False) -> GenerationRequest:
    """A `/v1/chat/completions` body (already JSON-decoded)."""
    body, req = _parse_head(body, "chat", _CHAT_FIELDS, _NEUTRAL_CHAT, n_vocab, strict)
    a = _integer(body, "max_tokens", 1, (1 << 32) - 1)
    b = _integer(body, "max_completion_tokens", 1, (1 << 32) - 1)
    # Both given: max_completion_tokens, which replaces the deprecated max_tokens (as vLLM).
    req.max_tokens = b if b is not None else a
    if b is not None:
        req.max_tokens_field = "max_completion_tokens"
    req.messages = _messages(body.get("messages"))
    req.outputs = parse_outputs(body, "chat", req.n, req.stream)
    _check_grammar_can_end(req)
    return req


def _messages(value: Any) -> list[tuple[str, str]]:
    if value is None:
        raise RequestError("'messages' is required", param="messages")
    if not isinstance(value, list) or not value:
        raise RequestError("'messages' must be a non-empty array", param="messages")
    out = []
    for i, msg in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise RequestError(f"'{where}' must be an object", param=where)
        _check_fields(msg, _MESSAGE_FIELDS, _NEUTRAL_MESSAGE, f"{where}.")
        role = msg.get("role")
        if role not in _ROLES:
            raise RequestError(f"'{where}.role' must be one of {sorted(_ROLES)}, got {role!r}",
                               param=f"{where}.role")
        if "name" in msg and msg["name"] is not None and not isinstance(msg["name"], str):
            raise RequestError(f"'{where}.name' must be a string", param=f"{where}.name")
        out.append((_ROLES[role], _content(msg.get("content"), role, f"{where}.content")))
    return out


def _content(value: Any, role: str, where: str) -> str:
    if value is None:
        if role == "assistant":
            return ""
        raise RequestError(f"'{where}' is required", param=where)
    if isinstance(value, str):
        return _no_nul(value, where)
    if isinstance(value, list):
        parts = []
        for j, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(
                    part.get("text"), str):
                raise RequestError(f"'{where}[{j}]' must be a text part "
                                   "({'type': 'text', 'text': ...}); other parts are not "
                                   "supported", param=f"{where}[{j}]")
            parts.append(_no_nul(part["text"], f"{where}[{j}].text"))
        return "\n".join(parts)  # (as vLLM joins them)
    raise RequestError(f"'{where}' must be a string or an array of text parts", param=where)


def _no_nul(text: str, where: str) -> str:
    # NOTE: llama.cpp's chat template reads message contents as C strings, so a NUL would
    # silently end the message there; refusing it is the only answer that loses nothing. (A
    # completions prompt may hold NUL: the tokenizer takes a length.)
    if "\x00" in text:
        raise RequestError(f"'{where}' holds a NUL character (U+0000), which a chat message "
                           "cannot carry to the model's chat template", param=where)
    return text
