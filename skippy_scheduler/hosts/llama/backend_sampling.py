"""Sampling on the device: llama.cpp's backend samplers, one chain per lane (`--backend-sampling`).

llama.cpp (EXPERIMENTAL API) can run a sequence's sampler chain inside the decode's own graph
(`llama_set_sampler(ctx, seq_id, chain)`): the chain's stages become graph nodes after the
output layer, on the device that holds it, and the decode hands back the sampled token
(`llama_get_sampled_token_ith`). A decode whose every output row belongs to a sequence with such
a chain copies no raw logits to the host, and the host does no argmax or softmax over them.

`DeviceChains` is the host's table of those chains, one per lane. A sequence's chain is on the
device when its sampling has only stages llama.cpp runs there: logit bias (and `ignore_eos`,
which is a bias of -inf on the end tokens), the penalties, temperature, top-k, top-p, min-p,
greedy or a seeded draw. Everything else keeps the host chain (samplers.py): log-probabilities
(the raw logits must cross), a grammar (llama.cpp has no backend grammar), `min_end_position`
(a position-dependent hold on the end tokens). A lane's chain is attached for its sequence and
stays attached when the sequence ends: attaching or detaching one makes llama.cpp reserve its
graphs again at the next decode, so the next sequence on the lane with the same settings (all
but the seed) reuses the chain, reset, and only a change of settings swaps it.

Tokens. Greedy: the device's argmax is the host's (first maximum), so greedy tokens are the host
path's. Seeded draws: before each decode the chain's `dist` stage is reseeded with the host
chain's seed for that position (`step_seed(seed, position)`, copied in with
`llama_sampler_copy`), so a sequence draws the same uniform at the same position alone, batched
or after a preemption, and so its tokens do not depend on its batch. They are not always the
host chain's tokens: the backend draws over the candidates in the order its filters leave them
(`ggml_top_k` returns the k best unsorted) with a float32 softmax and cumulative sum, the host
over its own order in double precision; with temperature alone both walk the vocabulary in order
and pick the same token unless the uniform falls within rounding of a boundary.

Per-row calls. The device's token of every row is read, and the draws of a step's rows are
reseeded, in one C loop each with the GIL released once (`_llama_calls`), not with ctypes calls
per row: each ctypes call gives the GIL up and must win it back from the event loop, which is
busy writing the last step's tokens just when the next step's are read. The per-row Python left
runs only for the lanes that need it: a penalty window to extend, a stage the device could not
run.

Not on the device: choices of one prompt forked from one decode (forks.py) need each follower
sampled from its leader's logits, so a sequence with a device chain never forks (it decodes its
own prompt).
"""
from __future__ import annotations

from typing import Any

import numpy as np

import llama_cpp as _ll

from ... import _llama_calls

from ..kit import IntArray, function_address, pointer_address
from ...sampling import SamplingParams, step_seed

MODES = ("on", "off", "auto")


def backend_sampling_mode(value: bool | str | None, name: str = "backend_sampling") -> str:
    """True/False/None or on/off/auto as a mode name; ValueError (naming the setting `name`)
    otherwise."""
    if value is None:
        return "auto"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, str) and value.strip().lower() in MODES:
        return value.strip().lower()
    raise ValueError(f"{name} must be one of {', '.join(MODES)}, got {value!r}")


def resolve_backend_sampling(value: bool | str | None, on_gpu: bool,
                             over_rpc: bool = False) -> bool:
    """Whether sequences sample on the device: `auto` means on when layers run on a GPU, but
    not on an RPC server's (`over_rpc`): there a step's sampling outputs cross the network
    besides its logits, and a load ran at about 0.7x the host sampling's output rate
    (docs/gpu.md, "Devices over RPC")."""
    mode = backend_sampling_mode(value)
    return (on_gpu and not over_rpc) if mode == "auto" else mode == "on"


def device_capable(params: SamplingParams | None) -> bool:
    """Whether llama.cpp's backend samplers cover `params` (None: plain greedy)."""
    return params is None or (params.output is None and not params.min_end_position)


def _settings(params: SamplingParams | None, eog: tuple[int, ...]) -> tuple[Any, ...]:
    """What a chain is built from: everything but the seed (a reused chain is reseeded)."""
    if params is None:
        return ("greedy",)
    p = params
    bias = dict(p.logit_bias)
    if p.ignore_eos:
        for t in eog:
            bias[t] = -float("inf")
    penalties = ((p.penalty_last_n, p.repetition_penalty, p.frequency_penalty,
                  p.presence_penalty) if p.penalized else None)
    if p.greedy:
        return (tuple(sorted(bias.items())), penalties, "greedy")
    return (tuple(sorted(bias.items())), penalties, p.temperature, p.top_k, p.top_p, p.min_p)


class DeviceChain:
    """One lane's backend chain and the penalty window it has been fed (`history`, the
    sequence's tokens before position `fed`, kept only with a penalty)."""

    __slots__ = ("settings", "params", "chain", "history", "fed", "_penalty", "_dist",
                 "draw_address")

    def __init__(self, settings: tuple[Any, ...], n_vocab: int) -> None:
        self.settings = settings
        self.params: SamplingParams | None = None
        self.history: list[int] | None = None
        self.fed = 0
        self.draw_address = 0  # the address of its `dist` stage (0 without one)
        self._penalty: Any = None
        self._dist: Any = None
        cparams = _ll.llama_sampler_chain_default_params()
        cparams.no_perf = True
        chain = _ll.llama_sampler_chain_init(cparams)
        if not chain:
            raise RuntimeError("llama.cpp could not create a sampler chain")
        self.chain: Any = chain
        stages = []
        if settings == ("greedy",):
            stages.append(_ll.llama_sampler_init_greedy())
        else:
            bias, penalties, *rest = settings
            if bias:
                arr = (_ll.llama_logit_bias * len(bias))()
                for i, (t, b) in enumerate(bias):
                    arr[i].token = t
                    arr[i].bias = b
                stages.append(_ll.llama_sampler_init_logit_bias(n_vocab, len(bias), arr))
            if penalties is not None:
                self._penalty = _ll.llama_sampler_init_penalties(n_vocab, *penalties)
                stages.append(self._penalty)
            if rest == ["greedy"]:
                stages.append(_ll.llama_sampler_init_greedy())
            else:
                temperature, top_k, top_p, min_p = rest
                if temperature != 1.0:
                    stages.append(_ll.llama_sampler_init_temp(temperature))
                if top_k > 0:
                    stages.append(_ll.llama_sampler_init_top_k(top_k))
                if top_p < 1.0:
                    stages.append(_ll.llama_sampler_init_top_p(top_p, 1))
                if min_p > 0.0:
                    stages.append(_ll.llama_sampler_init_min_p(min_p, 1))
                self._dist = _ll.llama_sampler_init_dist(1)  # reseeded before every draw
                stages.append(self._dist)
        for stage in stages:
            _ll.llama_sampler_chain_add(chain, stage)  # the chain owns its stages
        self.draw_address = pointer_address(self._dist) if self._dist is not None else 0

    def begin(self, params: SamplingParams | None) -> None:
        """A sequence starts on the chain: no state from the one before."""
        self.params = params
        _ll.llama_sampler_reset(self.chain)
        self.history = [] if self._penalty is not None else None
        self.fed = 0

    def free(self) -> None:
        if self.chain:
            _ll.llama_sampler_free(self.chain)
            self.chain = None

    def feed(self, tokens: IntArray, start: int) -> None:
        """The tokens at positions start, start + 1, ...: those not yet seen go into the
        penalty window (as the host chain's `feed`)."""
        history = self.history
        end = start + len(tokens)
        if history is None or end <= self.fed:
            return
        new = tokens[self.fed - start:] if self.fed > start else tokens
        history.extend(new.tolist())
        assert self.params is not None  # a penalty needs params
        for t in new[-self.params.penalty_last_n:].tolist():
            _ll.llama_sampler_accept(self._penalty, t)
        self.fed = end

    def rewind(self, start: int) -> None:
        """Forget positions >= start: the window is refilled from what is kept."""
        if self.history is None or start >= self.fed:
            self.fed = min(self.fed, start)
            return
        kept = self.history[:start]
        _ll.llama_sampler_reset(self._penalty)
        self.history, self.fed = [], 0
        self.feed(np.asarray(kept, dtype=np.int32), 0)

    @property
    def seed(self) -> int:
        """The seed of the sequence's draws."""
        assert self.params is not None and self.params.seed is not None
        return self.params.seed

    def reseed(self, position: int) -> None:
        """The draw for the token at `position` uses the host chain's seed for it (one lane's
        reseed through ctypes: `DeviceChains.prepare` makes a step's in C when it can)."""
        if self._dist is None:
            return
        fresh = _ll.llama_sampler_init_dist(step_seed(self.seed, position))
        _ll.llama_sampler_copy(fresh, self._dist)
        _ll.llama_sampler_free(fresh)

    def took(self, token: int, position: int, accepted: bool = False) -> None:
        """The device sampled `token` at `position`: the penalty window takes it (`accepted`:
        the chain has taken it already)."""
        if self.history is not None:
            if not accepted:
                _ll.llama_sampler_accept(self._penalty, token)
            self.history.append(token)
            self.fed = position + 1


class DeviceChains:
    """The lanes' backend chains (verbs: takes, start, stop, detach, feed, rewind, rows,
    prepare, read, close). A lane is *on the device* from `start` to `stop`; its chain stays
    attached to the context after `stop` until another sequence on the lane needs different
    settings (or the host path), so steady traffic attaches nothing."""

    def __init__(self, ctx: Any, n_vocab: int, eog_ids: IntArray) -> None:
        self._ctx = ctx
        self._n_vocab = n_vocab
        self._eog = tuple(int(t) for t in eog_ids.tolist())
        self._attached: dict[int, DeviceChain] = {}  # lane -> chain attached to the context
        self._active: dict[int, DeviceChain] = {}    # lane -> chain of its running sequence
        # Active lanes whose chain keeps a penalty window (fed each token) or draws (reseeded
        # before each decode): the only lanes the per-row Python visits.
        self._windowed: set[int] = set()
        self._drawing: set[int] = set()
        # llama.cpp's functions that the C loops call (0 where one cannot be found: then the
        # per-row ctypes calls instead, the same tokens).
        self._ctx_address = pointer_address(ctx)
        self._read_fn = function_address("llama_get_sampled_token_ith")
        self._reseed_fns = tuple(function_address(name) for name in (
            "llama_sampler_init_dist", "llama_sampler_copy", "llama_sampler_free"))
        self.attaches = 0  # chains attached to the context so far (each costs a graph reserve)
        self.refused = False  # llama.cpp refused a chain (a tensor split): the host path only

    def __len__(self) -> int:
        return len(self._active)

    def __contains__(self, lane: object) -> bool:
        return lane in self._active

    def takes(self, params: SamplingParams | None) -> bool:
        return not self.refused and device_capable(params)

    def start(self, lane: int, params: SamplingParams | None) -> DeviceChain | None:
        """The lane's sequence samples on the device with `params` (`takes(params)`); None
        when llama.cpp refuses the chain (from then on every sequence keeps the host path)."""
        settings = _settings(params, self._eog)
        chain = self._attached.get(lane)
        if chain is None or chain.settings != settings:
            self.detach(lane)
            chain = DeviceChain(settings, self._n_vocab)
            if not _ll.llama_set_sampler(self._ctx, lane, chain.chain):
                # A tensor split (llama.cpp logs why): its chains stay on the host.
                chain.free()
                self.refused = True
                return None
            self._attached[lane] = chain
            self.attaches += 1
        chain.begin(params)
        self._active[lane] = chain
        if chain.history is not None:
            self._windowed.add(lane)
        else:
            self._windowed.discard(lane)
        if chain.draw_address:  # a seeded draw, reseeded before every decode
            self._drawing.add(lane)
        else:
            self._drawing.discard(lane)
        return chain

    def attached(self, lane: int) -> bool:
        """Whether a chain is attached to the lane (an output row on it is sampled there)."""
        return lane in self._attached

    def stop(self, lane: int) -> None:
        """The lane's sequence is gone; its chain stays attached for the next one."""
        self._active.pop(lane, None)
        self._windowed.discard(lane)
        self._drawing.discard(lane)

    def detach(self, lane: int) -> None:
        """Take the lane's chain off the context (a host-sampled sequence takes the lane)."""
        self.stop(lane)
        chain = self._attached.pop(lane, None)
        if chain is not None:
            _ll.llama_set_sampler(self._ctx, lane, None)
            chain.free()

    def close(self) -> None:
        for lane in list(self._attached):
            self.detach(lane)

    def feed(self, row_lanes: IntArray, offsets: IntArray, tokens: IntArray,
             positions: IntArray) -> None:
        """The rows' tokens into the penalty windows of the device lanes keeping one, before
        the decode that samples with them (the host chains take theirs after it)."""
        windowed = self._windowed
        if not windowed:
            return
        active = self._active
        for r, lane in enumerate(row_lanes.tolist()):
            if lane in windowed:
                chain = active[lane]
                a, b = int(offsets[r]), int(offsets[r + 1])
                chain.feed(tokens[a:b], int(positions[a]))

    def rewind(self, lane: int, start: int) -> None:
        chain = self._active.get(lane)
        if chain is not None:
            chain.rewind(start)

    def rows(self, row_lanes: IntArray, sample_rows: IntArray) -> list[int]:
        """The sampling rows (by j) whose lane samples on the device."""
        active = self._active
        if not active:
            return []
        lanes = row_lanes.tolist()
        return [j for j, r in enumerate(sample_rows.tolist()) if lanes[r] in active]

    def prepare(self, row_lanes: IntArray, sample_rows: IntArray, device_rows: list[int],
                out_rows: IntArray, positions: IntArray) -> None:
        """Before the decode: the draws of the device rows reseeded for the positions they
        sample (`positions[out_rows[j]] + 1`)."""
        drawing = self._drawing
        if not drawing:
            return
        active = self._active
        draws: list[int] = []
        seeds: list[int] = []
        at: list[int] = []
        fns = self._reseed_fns
        in_c = all(fns)
        lanes = row_lanes[sample_rows[device_rows]].tolist()
        for j, lane in zip(device_rows, lanes):
            if lane in drawing:
                chain = active[lane]
                position = int(positions[int(out_rows[j])]) + 1
                if not in_c:
                    chain.reseed(position)
                    continue
                draws.append(chain.draw_address)
                seeds.append(chain.seed & _M64)
                at.append(position)
        if draws:
            _llama_calls.reseed_draws(fns[0], fns[1], fns[2], np.array(draws, dtype=np.uint64),
                                      np.array(seeds, dtype=np.uint64),
                                      np.array(at, dtype=np.int64))

    def read(self, tokens: IntArray, row_lanes: IntArray, sample_rows: IntArray,
             device_rows: list[int], out_rows: IntArray, positions: IntArray, *,
             synchronized: bool = False) -> None:
        """After the decode: the device's token for every device row (into `tokens[j]`),
        taken into its chain's penalty window. `synchronized`: the decode waited for its
        outputs (`LlamaBatch.decode(synchronize=True)`), so each read is a lookup, made
        without giving the GIL up; otherwise the first read waits for the device, with the
        GIL released."""
        if not device_rows:
            return
        rows = np.ascontiguousarray(out_rows if len(device_rows) == len(sample_rows)
                                    else out_rows[device_rows], dtype=np.int64)
        got = np.empty(len(rows), dtype=np.int32)
        ctx = self._ctx
        if self._read_fn:
            missing = _llama_calls.sampled_tokens(self._read_fn, self._ctx_address, rows, got,
                                                  release=not synchronized)
        else:
            for i, batch_row in enumerate(rows.tolist()):
                got[i] = _ll.llama_get_sampled_token_ith(ctx, batch_row)
            missing = int((got < 0).sum())
        tokens[device_rows] = got
        windowed = self._windowed
        if not missing and not windowed:
            return
        active = self._active
        lanes = row_lanes[sample_rows[device_rows]].tolist()
        for i, (j, lane) in enumerate(zip(device_rows, lanes)):
            token = int(got[i])
            if token >= 0 and lane not in windowed:
                continue
            batch_row = int(rows[i])
            chain = active[lane]
            accepted = False
            if token < 0:
                # A stage the device could not run (its ops missing there): llama.cpp ran the
                # chain up to it and left the rest to the host, which finishes it here from
                # what the device produced (and accepts the token into the whole chain).
                token = int(_ll.llama_sampler_sample(chain.chain, ctx, batch_row))
                tokens[j] = token
                accepted = True
            chain.took(token, int(positions[batch_row]) + 1, accepted)


_M64 = (1 << 64) - 1
