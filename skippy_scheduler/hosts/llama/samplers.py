"""Per-sequence sampling on llama.cpp: one sampler chain per lane that is not plain greedy.

Greedy sequences (None) take one vectorised argmax over the plan's logits; any other sequence
gets its own llama.cpp sampler chain, built when the sequence takes a lane and freed with it. A
chain's state is a function of the sequence's tokens (the penalty window is refilled from the
rows it is fed, so a recompute after preemption rebuilds it) and of the predicted position
(each draw is seeded from the sequence's seed and that position), so a seeded sequence samples
the same tokens alone, batched or preempted.

A grammar (`OutputOptions.grammar`, llama.cpp's grammar sampler) is a stage of the chain after
the logit bias and the penalties, before temperature and the filters, so every filter keeps only
tokens the grammar allows. The grammar sees generated tokens only: a prompt token fed to the
chain goes to the penalty stage alone, a replayed generated token (after preemption) to both.
Log-probabilities (`logprobs.py`) are read from the raw logits, whatever the chain does.
"""
from __future__ import annotations

import ctypes
import math
import re
import threading
from collections import OrderedDict
from dataclasses import replace
from typing import Any

import numpy as np
import numpy.typing as npt

import llama_cpp as _ll

from ..kit import IntArray
from ...sampling import SampleDetail, SamplingParams, is_native_config, step_seed
from .backend_sampling import DeviceChain, DeviceChains
from .logprobs import PromptLogprobs, log_softmax, token_logprob



class SamplerChain:
    """The llama.cpp sampler chain of one sequence and what it has been fed.

    `history` holds every token of the sequence before position `fed` (only when a penalty is
    active: the penalty window is the chain's one piece of token-dependent state besides the
    grammar's, which `generated` replays). Random draws are made by a `dist` sampler appended
    for one sample and removed again, seeded by `step_seed(seed, position)`, so no RNG state is
    carried from one token to the next. `chain` is None for a greedy sequence with nothing
    that changes its logits (it is sampled by argmax; it may still report log-probabilities).
    """

    __slots__ = ("params", "chain", "fixed", "history", "fed", "held", "generated", "prompt",
                 "_n_vocab", "_eog_ids", "_vocab", "_penalty_stage", "_grammar_stage")

    def __init__(self, params: SamplingParams, n_vocab: int, eog_ids: IntArray,
                 vocab: Any = None) -> None:
        self.params = params
        output = params.output
        self.held = held_tokens(params, eog_ids)
        self.history: list[int] | None = [] if params.penalized else None
        self.fed = 0
        grammar = output.grammar if output is not None else None
        self.generated: list[int] | None = [] if grammar is not None else None
        self.prompt = (PromptLogprobs(output) if output is not None
                       and output.prompt_logprobs is not None else None)
        self.chain: Any = None
        self.fixed = 0
        self._n_vocab = n_vocab
        self._eog_ids = eog_ids
        self._vocab = vocab
        self._penalty_stage = -1
        self._grammar_stage = -1
        if not (params.greedy and not params.penalized and not params.logit_bias
                and grammar is None):
            self._build()

    @property
    def prompt_length(self) -> int:
        output = self.params.output
        return output.prompt_length if output is not None else 0

    def _build(self) -> None:
        p = self.params
        cparams = _ll.llama_sampler_chain_default_params()
        cparams.no_perf = True
        chain = _ll.llama_sampler_chain_init(cparams)
        if not chain:
            raise RuntimeError("llama.cpp could not create a sampler chain")
        self.chain = chain
        n_vocab = self._n_vocab
        stages = []
        bias = dict(p.logit_bias)
        if p.ignore_eos:
            for t in self._eog_ids.tolist():
                bias[t] = -float("inf")
        if bias:
            arr = (_ll.llama_logit_bias * len(bias))()
            for i, (t, b) in enumerate(sorted(bias.items())):
                arr[i].token = t
                arr[i].bias = b
            stages.append(_ll.llama_sampler_init_logit_bias(n_vocab, len(bias), arr))
        if p.penalized:
            self._penalty_stage = len(stages)
            stages.append(_ll.llama_sampler_init_penalties(
                n_vocab, p.penalty_last_n, p.repetition_penalty, p.frequency_penalty,
                p.presence_penalty))
        grammar = p.output.grammar if p.output is not None else None
        if grammar is not None:
            try:
                stage = init_grammar(self._vocab, grammar)
            except ValueError:
                for made in stages:
                    _ll.llama_sampler_free(made)
                self.free()
                raise
            self._grammar_stage = len(stages)
            stages.append(stage)
        if p.greedy:
            stages.append(_ll.llama_sampler_init_greedy())
        else:
            if p.temperature != 1.0:
                stages.append(_ll.llama_sampler_init_temp(p.temperature))
            if p.top_k > 0:
                stages.append(_ll.llama_sampler_init_top_k(p.top_k))
            if p.top_p < 1.0:
                stages.append(_ll.llama_sampler_init_top_p(p.top_p, 1))
            if p.min_p > 0.0:
                stages.append(_ll.llama_sampler_init_min_p(p.min_p, 1))
        for stage in stages:
            _ll.llama_sampler_chain_add(chain, stage)
        self.fixed = len(stages)

    def free(self) -> None:
        if self.chain:
            _ll.llama_sampler_free(self.chain)
            self.chain = None

    def feed(self, tokens: IntArray, start: int) -> None:
        """The row's tokens at positions start, start + 1, ...: the ones not yet seen go into
        the penalty window, and the generated ones among them to the grammar (a decode row's
        input is the token the chain sampled itself)."""
        end = start + len(tokens)
        if self.generated is not None:
            seen = self.prompt_length + len(self.generated)
            if end > seen:
                stage = _ll.llama_sampler_chain_get(self.chain, self._grammar_stage)
                for t in tokens[max(seen - start, 0):].tolist():
                    _ll.llama_sampler_accept(stage, t)
                    self.generated.append(t)
        if self.history is None or end <= self.fed:
            return
        new = tokens[self.fed - start:] if self.fed > start else tokens
        self.history.extend(new.tolist())
        # Only the last penalty_last_n tokens can still be in the window.
        stage = _ll.llama_sampler_chain_get(self.chain, self._penalty_stage)
        for t in new[-self.params.penalty_last_n:].tolist():
            _ll.llama_sampler_accept(stage, t)
        self.fed = end

    def rewind(self, start: int) -> None:
        """Forget positions >= start (the sequence replays from there)."""
        if self.prompt is not None:
            self.prompt.restart(start)
        generated = self.generated
        if generated is not None and self.prompt_length + len(generated) > start:
            kept_generated = generated[:max(start - self.prompt_length, 0)]
        elif self.history is None or start >= self.fed:
            self.fed = min(self.fed, start)
            return
        else:
            kept_generated = (generated or [])[:max(start - self.prompt_length, 0)]
        kept = self.history[:start] if self.history is not None else None
        self.free()
        self._build()
        if self.history is not None:
            self.history, self.fed = [], 0
        if generated is not None:
            self.generated = []
        if kept is not None:
            self.feed(np.asarray(kept, dtype=np.int32), 0)
        if kept_generated:
            assert self.generated is not None
            self.feed(np.asarray(kept_generated, dtype=np.int32), self.prompt_length)

    def sample(self, ctx: Any, batch_row: int, position: int) -> int:
        """Sample the token at `position` from the logits of `batch_row` of the last decode."""
        chain = self.chain
        if not self.params.greedy:
            seed = self.params.seed
            assert seed is not None  # SamplingParams draws one when made without
            _ll.llama_sampler_chain_add(chain, _ll.llama_sampler_init_dist(
                step_seed(seed, position)))
        token = int(_ll.llama_sampler_sample(chain, ctx, batch_row))  # also accepts it
        if not self.params.greedy:
            _ll.llama_sampler_free(_ll.llama_sampler_chain_remove(chain, self.fixed))
        if self.history is not None:
            self.history.append(token)
            self.fed = position + 1
        if self.generated is not None:
            self.generated.append(token)
        return token


# llama.cpp parses a grammar's groups by recursion on the calling thread's stack: tens of
# thousands of groups inside one another (a JSON schema's maxLength of 30 000 is one group per
# character) overflowed it and killed the process. Its own limit on repetitions (2 000 copies
# of a rule) refuses anything near this depth that a JSON schema's counts produce.
MAX_GRAMMAR_DEPTH = 4096
# It follows rule references by recursion too: a chain of 200 000 rules (r0 ::= r1, ...) did the
# same; a JSON schema's grammar has tens of rules.
MAX_GRAMMAR_RULES = 10_000
# A string, a character class or a comment (each skipped whole), or a bracket.
_GBNF_GROUPS = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|#[^\r\n]*|[()]')


def grammar_depth(grammar: str) -> int:
    """The most groups `(...)` of a GBNF grammar open inside one another."""
    depth = deepest = 0
    for m in _GBNF_GROUPS.finditer(grammar):
        c = m.group()
        if c == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif c == ")":
            depth -= 1
    return deepest


def init_grammar(vocab: Any, grammar: str) -> Any:
    """llama.cpp's grammar sampler for `grammar` (root rule `root`), or ValueError: a grammar
    nested past `MAX_GRAMMAR_DEPTH`, or with more than `MAX_GRAMMAR_RULES` rules, is refused
    before llama.cpp reads it."""
    depth = grammar_depth(grammar)
    if depth > MAX_GRAMMAR_DEPTH:
        raise ValueError(f"the grammar nests {depth} groups inside one another, more than "
                         f"{MAX_GRAMMAR_DEPTH}")
    rules = grammar.count("::=")
    if rules > MAX_GRAMMAR_RULES:
        raise ValueError(f"the grammar has {rules} rules, more than {MAX_GRAMMAR_RULES}")
    stage = _ll.llama_sampler_init_grammar(vocab, grammar.encode("utf-8"), b"root")
    if not stage:
        raise ValueError("llama.cpp could not parse the grammar")
    return stage


def grammar_refuses(stage: Any, tokens: Any) -> int:
    """Feed `tokens` to the grammar sampler `stage`, each once the grammar is seen to allow it
    there (llama.cpp's accept aborts the process on a token its grammar refuses); the index of
    the first it refuses, or -1."""
    data = _ll.llama_token_data(0, 0.0, 0.0)
    candidates = _ll.llama_token_data_array(ctypes.pointer(data), 1, -1, False)
    for i, t in enumerate(tokens):
        data.id = int(t)  # type: ignore[assignment, unused-ignore]  # (ctypes converts it)
        data.logit = 0.0
        _ll.llama_sampler_apply(stage, ctypes.byref(candidates))
        if math.isinf(data.logit):
            return i
        _ll.llama_sampler_accept(stage, int(t))
    return -1


# Grammars a `Samplers` has parsed already (its check_grammar), kept to this many.
_PARSED_KEPT = 64


def held_tokens(params: SamplingParams, eog_ids: IntArray) -> IntArray | None:
    """The tokens `min_end_position` holds off (end-of-generation and `min_end_tokens`), or
    None when nothing is held."""
    if not params.min_end_position:
        return None
    extra = np.asarray(params.min_end_tokens, dtype=np.int32)
    return np.union1d(eog_ids, extra).astype(np.int32)


def hold_ends(row: npt.NDArray[np.float32], chain: SamplerChain, position: int) -> bool:
    """vLLM's `min_tokens`: below the sequence's `min_end_position` its end tokens (and stop
    token ids) cannot be sampled. Their logits in `row`, a view of the decode's own output
    that the chain samples from, become -inf; True when they did."""
    held = chain.held
    if held is None or position >= chain.params.min_end_position:
        return False
    row[held] = -np.inf
    return True


class Samplers:
    """The chains of the lanes whose sequences are not plain greedy (verbs: start, drop,
    rewind, feed, pick, report)."""

    def __init__(self, n_vocab: int, eog: npt.NDArray[np.bool_], eog_ids: IntArray,
                 vocab: Any = None, device: DeviceChains | None = None,
                 max_window: int | None = None) -> None:
        """`max_window`: the most positions a sequence can have (the context's cells): a
        longer penalty window is cut to it, which changes nothing but the memory llama.cpp's
        penalty sampler allocates for its window."""
        self.n_vocab = n_vocab
        self.max_window = max_window
        self._eog = eog
        self._eog_ids = eog_ids
        self._vocab = vocab
        self._by_lane: dict[int, SamplerChain] = {}
        self._reporting: dict[int, SamplerChain] = {}  # the lanes whose chain reports anything
        self._parsed: OrderedDict[str, None] = OrderedDict()  # grammars check_grammar parsed
        self._parsed_lock = threading.Lock()  # (a server's threads and the engine's use it)
        # The lanes that sample on the device (backend_sampling.py); None: the host path only.
        self.device = device

    def __len__(self) -> int:
        return len(self._by_lane) + (len(self.device) if self.device is not None else 0)

    def resolve(self, sampling: object) -> SamplingParams | None:
        """The params a `Sequence.sampling` stands for on this model; None for plain greedy."""
        if sampling is None:
            return None
        if is_native_config(sampling):
            resolved = SamplingParams.from_native(sampling)
            if resolved is None:
                return None
            sampling = resolved
        elif not isinstance(sampling, SamplingParams):
            raise TypeError("sampling must be None, a SamplingParams or a cffi "
                            f"'skippy_sampling_config *', got {type(sampling).__name__}")
        assert isinstance(sampling, SamplingParams)
        self.check_vocabulary(sampling)
        output = sampling.output
        if output is not None and output.grammar is not None:
            self.check_grammar(output.grammar)  # before the plan changes any state
        if sampling.plain_greedy and not sampling.ignore_eos and not sampling.min_end_position:
            return None
        if self.max_window is not None and sampling.penalty_last_n > self.max_window:
            sampling = replace(sampling, penalty_last_n=self.max_window)
        return sampling

    def check_vocabulary(self, sampling: SamplingParams) -> None:
        """ValueError when `sampling` names a token outside this model's vocabulary (in
        `logit_bias` or `min_end_tokens`)."""
        for token, _ in sampling.logit_bias:
            if token >= self.n_vocab:
                raise ValueError(f"logit_bias names token {token}, outside [0, {self.n_vocab}) "
                                 "for this model")
        if any(t >= self.n_vocab for t in sampling.min_end_tokens):
            raise ValueError(f"min_end_tokens names a token outside [0, {self.n_vocab}) for "
                             "this model")

    def check_grammar(self, grammar: str) -> None:
        """ValueError unless llama.cpp's grammar sampler parses `grammar` (root rule `root`).
        The last grammars parsed are remembered: a server checks a request's grammar before it
        queues it, and the host's prepare_sequence checks it again without parsing it twice."""
        parsed = self._parsed
        with self._parsed_lock:
            if grammar in parsed:
                parsed.move_to_end(grammar)
                return
        _ll.llama_sampler_free(init_grammar(self._vocab, grammar))
        with self._parsed_lock:
            parsed[grammar] = None
            if len(parsed) > _PARSED_KEPT:
                parsed.popitem(last=False)

    def check_generated(self, grammar: str, tokens: Any, start: int = 0) -> None:
        """ValueError when `grammar` refuses one of `tokens`, the tokens its chain will feed it
        from position `start` on (the end of the prompt from `prompt_length`, and a resumed
        sequence's tokens generated elsewhere)."""
        stage = init_grammar(self._vocab, grammar)
        try:
            at = grammar_refuses(stage, tokens)
        finally:
            _ll.llama_sampler_free(stage)
        if at >= 0:
            raise ValueError(f"the token at position {start + at} ({int(tokens[at])}) is not "
                             "what the grammar allows there, and the grammar reads from "
                             f"position {start} (prompt_length)")

    def start(self, lane: int, params: SamplingParams | None,
              ) -> SamplerChain | DeviceChain | None:
        """A lane's sequence begins: its chain (None for plain greedy on the host), on the
        device when there is a device table that takes its params."""
        self.drop(lane)
        device = self.device
        if device is not None:
            if device.takes(params):
                on_device = device.start(lane, params)
                if on_device is not None:
                    return on_device
            device.detach(lane)  # the host path: the lane's chain comes off the context
        if params is None:
            return None
        chain = SamplerChain(params, self.n_vocab, self._eog_ids, self._vocab)
        self._by_lane[lane] = chain
        if params.output is not None:
            self._reporting[lane] = chain
        return chain

    def drop(self, lane: int) -> None:
        chain = self._by_lane.pop(lane, None)
        self._reporting.pop(lane, None)
        if chain is not None:
            chain.free()
        if self.device is not None:
            self.device.stop(lane)

    def rewind(self, lane: int, start: int) -> None:
        chain = self._by_lane.get(lane)
        if chain is not None:
            chain.rewind(start)
        elif self.device is not None:
            self.device.rewind(lane, start)

    def on_device(self, lane: int) -> bool:
        """Whether the lane's sequence samples on the device."""
        return self.device is not None and lane in self.device

    def close(self) -> None:
        for chain in self._by_lane.values():
            chain.free()
        self._by_lane.clear()
        self._reporting.clear()
        if self.device is not None:
            self.device.close()

    def feed(self, row_lanes: IntArray, offsets: IntArray, tokens: IntArray,
             positions: IntArray) -> None:
        """The decoded rows' tokens into the penalty windows and grammars of the host chains
        that keep one (a device chain is fed before the decode, which samples with it)."""
        by_lane = self._by_lane
        if not by_lane:
            return
        for r, lane in enumerate(row_lanes.tolist()):
            chain = by_lane.get(lane)
            if chain is not None and (chain.history is not None or chain.generated is not None):
                a, b = int(offsets[r]), int(offsets[r + 1])
                chain.feed(tokens[a:b], int(positions[a]))

    def pick(self, ctx: Any, tokens: IntArray, rows: npt.NDArray[np.float32],
             at: IntArray | None, row_lanes: IntArray, sample_rows: IntArray,
             out_rows: IntArray, positions: IntArray) -> None:
        """Overwrite the argmax in `tokens` of every sampling row whose lane has a chain.
        Sampling row j's logits are `rows[at[j]]` (`rows[j]` when `at` is None), a view of the
        decode's own output, which the chain samples from (batch entry `out_rows[j]`)."""
        by_lane = self._by_lane
        if not by_lane:
            return
        lanes = row_lanes.tolist()
        for j, r in enumerate(sample_rows.tolist()):
            chain = by_lane.get(lanes[r])
            if chain is None:
                continue
            batch_row = int(out_rows[j])
            position = int(positions[batch_row]) + 1
            logits = rows[int(at[j]) if at is not None else j]
            held = hold_ends(logits, chain, position)
            if chain.chain is None:  # greedy that does not end on its own (yet)
                # `tokens[j]` is the row's argmax, the first of its highest logits: unless it
                # is an end token, it is also the argmax with the end tokens at -inf, and the
                # row need not be copied (a row's copy and masking, 20 µs of a step's host
                # work at a 32 000-token vocabulary, on the path between two decodes).
                ends = chain.params.ignore_eos and (held or self._eog[tokens[j]])
                if ends:
                    row = logits.copy()
                    row[self._eog_ids] = -np.inf
                    tokens[j] = int(row.argmax())
                elif held:
                    tokens[j] = int(logits.argmax())
            else:
                tokens[j] = chain.sample(ctx, batch_row, position)

    # -- reports ------------------------------------------------------------------------------

    def prompt_state(self, lane: int) -> PromptLogprobs | None:
        """The prompt log-probabilities the lane's sequence still collects (None: none)."""
        chain = self._reporting.get(lane)
        if chain is None or chain.prompt is None or chain.prompt.done:
            return None
        return chain.prompt

    @property
    def reporting(self) -> bool:
        return bool(self._reporting)

    def raw_logprobs(self, rows: npt.NDArray[np.float32], at: IntArray | None,
                     row_lanes: IntArray, sample_rows: IntArray) -> dict[int, Any]:
        """The log-softmax of the raw logits of every sampling row (by j) whose sequence
        reports its tokens' log-probabilities: taken before `pick` (whose holds change the
        logits, docs/hosts.md)."""
        out: dict[int, Any] = {}
        reporting = self._reporting
        if not reporting:
            return out
        lanes = row_lanes.tolist()
        for j, r in enumerate(sample_rows.tolist()):
            chain = reporting.get(lanes[r])
            if chain is not None and chain.params.output is not None and (
                    chain.params.output.logprobs is not None):
                out[j] = log_softmax(rows[int(at[j]) if at is not None else j])
        return out

    def report(self, tokens: IntArray, raw: dict[int, Any], row_lanes: IntArray,
               sample_rows: IntArray) -> dict[int, SampleDetail] | None:
        """The detail of every sampling row whose sequence asked for one, by row (`raw`: what
        `raw_logprobs` gave before the tokens were picked)."""
        reporting = self._reporting
        if not reporting:
            return None
        out: dict[int, SampleDetail] = {}
        lanes = row_lanes.tolist()
        for j, r in enumerate(sample_rows.tolist()):
            chain = reporting.get(lanes[r])
            if chain is None:
                continue
            output = chain.params.output
            assert output is not None
            sampled = None
            if j in raw:
                sampled = token_logprob(raw[j], int(tokens[j]), output.top)
            prompt = None
            if chain.prompt is not None and not chain.prompt.done:
                prompt = chain.prompt.finish()
            if sampled is not None or prompt is not None:
                out[r] = SampleDetail(sampled, prompt)
        return out or None
