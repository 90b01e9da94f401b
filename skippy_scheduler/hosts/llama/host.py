"""`LlamaHost`: one llama.cpp model and context that executes the scheduler's plans.

Each plan becomes exactly one `llama_decode` call: the plan's flat token/position arena is
copied into a batch whose buffers are numpy arrays owned by the host, every row's entries carry
the lane of that row's sequence, and logits are requested only for the last entry of sampling
rows (and the prompt rows of a sequence that asks for prompt log-probabilities). Predictions go
back into the plan's output block as (work index, token) pairs, the same hand-off as the native
ABI (docs/hosts.md). The host implements the engine's contract (engine/contract.py): `execute`,
`release`, `execute_async`, `release_all`, `prefix_store`, `host_state`, `sample_details` (the
log-probabilities a sequence's `SamplingParams.output` asked for, samplers.py), and the checks
that refuse what it could never run before anything is queued: `prepare_sequence` (a token
outside the vocabulary, more positions than a lane holds) and `check_config` (a scheduler with
more sequences at once than lanes, or plans larger than the batch).

The plan says where a sequence starts: at a new row (`plan.new_rows`) the host gives the
sequence a lane, its sampler chain (`work[row].sampling`) and, when the row starts past 0, the
restored prefix (`work[row].restore_holder`, `plan.restored_tokens[row]`). Every other row
continues a lane. Everything is checked before any state changes.

The parts own their state: `Lanes` (which sequence holds which llama sequence id, positions),
`Samplers` (per-lane sampler chains, grammars, log-probabilities), `PrefixHolders` (resident
prefixes and the store), `Forks` (choices of one prompt decoded once), `Tokenizer` (the
vocabulary), `Decoder` (the batch). Two objects run rows over them, each given the parts it
uses when the host builds it: `RowRunner` (rows.py: checks, lane set-up, staging, decode,
sampling, undo; it counts the entries decoded) and `DirectRows` (direct.py: `run_rows` and
`generate_alone`, through the `RowRunner`). The host reads plans, keeps the details reported
with them, and owns the context's lifecycle.

Sampling on the device (`backend_sampling`: on, off, or auto, which is on when layers run on a
GPU): the lanes whose sampling llama.cpp's backend samplers cover get a chain in the decode's
graph and their tokens come back from the decode; the others keep the host chains
(backend_sampling.py).

Defaults favour exactness: f32 weights (the tiny model), f32 KV cache and flash attention off are
the settings under which a sequence's greedy tokens do not depend on what it was batched with.
llama.cpp may give the context less than asked (it caps the batch at the context size): the
host sizes everything from what the context got (`n_batch`, `n_ctx`, `n_ctx_seq`).
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import Future
from typing import Any, Callable, Iterable, Mapping, NamedTuple, Sequence as _Seq

import numpy as np
import numpy.typing as npt

import llama_cpp as _ll

from ...engine.contract import HostState, Plan
from ...inflight import HostWorker
from ...prefix_store import PrefixStore
from ...sampling import SampleDetail, SamplingParams
from ...types import MemoryComponent, ReleaseReason, SchedulerConfig, Sequence
from ..kit import PlanRows, check_tokens, read_plan
from ..offload import Placement
from .backend_sampling import DeviceChains, backend_sampling_mode, resolve_backend_sampling
from .backend import (FLASH_ATTN_NAMES, KV_TYPES, check_int, create_context, flash_attn_type,
                      init_backend, load_model, failure_reason, log_mark,
                      LlamaLoadError)
from .decode import Decoder
from .direct import DirectRows
from .forks import Forks
from .holders import DEFAULT_REPLACE_SHARE, PrefixHolders, Watcher, check_replace_share
from .lanes import KvCells, Lanes, Start
from .rows import RowRunner, Staged
from .samplers import Samplers
from .tokenizer import Tokenizer



# Gaps of up to this many lanes get filler rows (rows.py `RowRunner._gap_fill`): a filler costs
# about a decode row, a break in the run of lanes a pass over the weights (docs/hosts.md "Batch
# order").
DEFAULT_GAP_FILL = 2

_KEPT_DETAILS = 8  # plans whose sample details wait to be taken (more are in flight at most)
_AHEAD_WAIT_S = 0.005  # the longest wait for the next plan to stage ahead (`_stage_next`)
# Why a plan that ran after another was not run from a staging made while that one ran:
# the plan before it was waited for (it sampled nothing, or staging ahead is not possible for
# it), the next plan was not queued within the wait (an idle server's next plan counts here
# too), it starts sequences (`new_rows`: lanes, sampler chains and restored prefixes are set up
# when it runs), it could not be staged without changing state (a replay, a fork to follow, a
# prompt whose log-probabilities are collected, rows that do not continue their lanes), or a
# staging was made but did not hold: the lanes changed before it ran, or another plan ran in
# its place (`restaged`).
NOT_STAGED_REASONS = ("plan_before_waited", "not_queued", "new_rows", "not_stageable",
                      "restaged")


class _Ahead(NamedTuple):
    """The next plan, staged ahead (`LlamaHost._stage_next`)."""

    plan: Plan  # its object: a plan is a new object every step
    rows: PlanRows
    step: Staged
    lane_changes: int  # the lane table's change count when it was staged
    past_calls: bool  # calls (releases, keeps) were queued before it, to run in between


class LlamaHost:
    """One llama.cpp model + context that executes scheduler plans (see module docstring)."""

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        *,
        n_ctx: int = 4096,
        n_seq_max: int = 8,
        n_threads: int = 2,
        n_batch: int = 512,
        n_ubatch: int | None = None,
        kv_type: str = "f32",
        flash_attn: bool | str = False,
        kv_unified: bool | None = None,
        prefix_cache_tokens: int = 0,
        prefix_holders: int = 16,
        prefix_replace_share: float | None = DEFAULT_REPLACE_SHARE,
        gap_fill_max: int = DEFAULT_GAP_FILL,
        solo_fill: bool | None = None,
        placement: Placement | None = None,
        backend_sampling: bool | str | None = "auto",
        stage_ahead: bool | str | None = None,
    ) -> None:
        sampling_mode = backend_sampling_mode(backend_sampling)  # refused before the load
        ahead_mode = backend_sampling_mode(stage_ahead, "stage_ahead")  # on/off/auto, a bool
        n_seq_max = check_int("n_seq_max", n_seq_max, 1, 256)
        prefix_cache_tokens = check_int("prefix_cache_tokens", prefix_cache_tokens, 0)
        holders = 0
        if prefix_cache_tokens:
            holders = check_int("prefix_holders", prefix_holders, 1, 256 - n_seq_max)
        replace_share = check_replace_share(prefix_replace_share)  # (holders.py)
        gap_fill_max = check_int("gap_fill_max", gap_fill_max, 0, 256)
        if solo_fill is not None and not isinstance(solo_fill, bool):
            raise TypeError(f"solo_fill must be True, False or None, got {solo_fill!r}")
        # With reuse and kv_unified left unset, every lane and holder has a KV stream of its own
        # (n_ctx is split evenly over them) and prefixes move by whole-stream copies; with
        # kv_unified=True they share cells of one cache (holders.py).
        if kv_unified is not None and not isinstance(kv_unified, bool):
            raise TypeError(f"kv_unified must be True, False or None, got {kv_unified!r}")
        unified = bool(kv_unified)
        # A filler beside a one-token step gives it the bits of any batch on llama.cpp's CPU
        # kernels (an RPC server's included); a GPU's kernels differ by batch size anyway, so
        # None leaves it off where layers are on a GPU (docs/hosts.md, "When the tokens are
        # the same"). In a unified cache a sequence's bits depend on where its cells sit among
        # the others' anyway, and the filler's cell may be one the shared cells do not have
        # (the decode of a request accepted would fail): off there, and refused when asked for.
        if solo_fill is None:
            solo_fill = not unified and not (placement is not None and placement.on_gpu
                                             and not placement.over_rpc)
        elif solo_fill and unified:
            raise ValueError("solo_fill=True needs a KV stream per sequence: with "
                             "kv_unified=True a sequence's bits depend on the shared cells "
                             "around it anyway, and the filler's cell may be one the cache "
                             "does not have")
        n_ctx = check_int("n_ctx", n_ctx, 1)
        n_threads = check_int("n_threads", n_threads, 1)
        n_batch = check_int("n_batch", n_batch, 1)
        n_ubatch = n_batch if n_ubatch is None else check_int("n_ubatch", n_ubatch, 1, n_batch)
        if kv_type not in KV_TYPES:
            raise ValueError(f"kv_type must be one of {sorted(KV_TYPES)}, got {kv_type!r}")
        flash = flash_attn_type(flash_attn)
        path = os.fspath(model_path)
        if os.path.isdir(path):
            raise IsADirectoryError(f"{path} is a directory, not a GGUF model file")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no model file at {path}")
        self.model_path = path
        self._model: Any = None
        self._ctx: Any = None
        self._cells: KvCells | None = None
        # A plan's handle is said done when the next plan's decode starts (inflight.py): the
        # engine thread then completes it and plans the next while the device runs, not while
        # this host stages the next decode or, beside a device, queues it (`Decoder.on_launch`,
        # below).
        self._worker = HostWorker(self.execute, "llama-decode", hold_until_launch=True)
        # Held while a plan runs or a lane is released (whichever thread does it): `close`
        # takes it before it frees the context, so a close from another thread waits for a
        # decode in progress instead of freeing the memory under it.
        self._busy = threading.RLock()
        self._samplers: Samplers | None = None
        init_backend()

        self._model = load_model(path, placement)
        self.placement = placement
        ids = n_seq_max + holders
        mark = log_mark()
        ctx = create_context(self._model, n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_ubatch,
                             sequence_ids=ids, n_threads=n_threads, kv_type=kv_type,
                             flash_attn=flash, unified=unified)
        if not ctx:
            self.close()
            where = f" ({placement.line()})" if placement is not None and placement.on_gpu \
                else ""
            raise LlamaLoadError(f"llama.cpp could not create a context of {n_ctx} tokens"
                                 f"{where}: {failure_reason(mark)}")
        self._ctx = ctx
        self._cells = cells = KvCells(ctx)
        self.tokenizer = tok = Tokenizer(self._model)
        self.n_vocab = tok.n_vocab
        self.n_seq_max = n_seq_max
        # What the context got, not what was asked: llama.cpp caps the batch at the context
        # size it was given (before rounding that up to 256 per lane) and the micro-batch at the
        # batch, and a plan above its batch aborts the process in llama_decode. Plans are sized
        # from `n_batch` (the server's and `run`'s max_tokens_per_iteration).
        self.n_batch = int(_ll.llama_n_batch(ctx))
        n_ubatch = int(_ll.llama_n_ubatch(ctx))
        got_ids = int(_ll.llama_n_seq_max(ctx))
        if got_ids != ids or self.n_batch < 1:
            self.close()
            raise ValueError(f"llama.cpp gave the context {got_ids} sequence ids and a batch "
                             f"of {self.n_batch} tokens; the host needs {ids} sequence ids and "
                             "a batch of at least one token")
        self.n_ctx = int(_ll.llama_n_ctx(ctx))
        self.n_ctx_seq = int(_ll.llama_n_ctx_seq(ctx))
        self.settings = {
            "n_ctx": self.n_ctx, "n_ctx_seq": self.n_ctx_seq, "n_seq_max": n_seq_max,
            "n_batch": self.n_batch, "n_ubatch": n_ubatch, "n_threads": n_threads,
            "kv_type": kv_type, "flash_attn": {1: True, 0: False}.get(flash, FLASH_ATTN_NAMES[flash]), "kv_unified": unified,
            "n_gpu_layers": placement.n_gpu_layers if placement is not None else 0,
            "devices": list(placement.gpus) if placement is not None and placement.on_gpu
            else [],
            "prefix_cache_tokens": prefix_cache_tokens, "prefix_holders": holders,
            "prefix_replace_share": replace_share, "gap_fill_max": gap_fill_max,
            "solo_fill": solo_fill,
        }
        on_device = resolve_backend_sampling(
            sampling_mode, placement is not None and placement.on_gpu,
            placement is not None and placement.over_rpc)
        self.settings["backend_sampling"] = on_device
        # Stage the next plan while the device runs this one: where the decode runs on a
        # device (a GPU, an RPC server) and returns before its outputs are ready; on the CPU
        # llama_decode returns with the step done, and there is nothing to overlap.
        self._stage_ahead = (placement is not None and placement.on_gpu
                             if ahead_mode == "auto" else ahead_mode == "on")
        self.settings["stage_ahead"] = self._stage_ahead
        self._ahead: _Ahead | None = None  # the next plan, staged ahead
        self._ahead_miss: str | None = None  # else why not (`NOT_STAGED_REASONS`)
        self.staged_ahead = 0  # plans run from their staging while the plan before ran
        self.staged_ahead_past_calls = 0  # of them, with calls queued before them
        self.staged_again = 0  # plans staged ahead, then again when they ran (lanes changed)
        # Plans that ran after one on the device without being staged ahead, by why
        # (`NOT_STAGED_REASONS`): where the device waits for the host's staging.
        self.not_staged_ahead = dict.fromkeys(NOT_STAGED_REASONS, 0)
        self._lanes = lanes = Lanes(n_seq_max, cells)
        self._samplers = samplers = Samplers(
            tok.n_vocab, tok.eog, tok.eog_ids, _ll.llama_model_get_vocab(self._model),
            DeviceChains(ctx, tok.n_vocab, tok.eog_ids) if on_device else None,
            max_window=n_ctx)
        self._decoder = Decoder(ctx, self.n_batch, tok.n_vocab,
                                queues=placement is not None and placement.on_gpu)
        self._decoder.on_launch = self._worker.launching
        self._forks = Forks(cells, unified)
        self._details: dict[int, tuple[Plan, dict[int, SampleDetail]]] = {}
        self.prefix_holders = holders
        self.holders: PrefixHolders | None = None
        if prefix_cache_tokens:
            self.holders = PrefixHolders(prefix_cache_tokens, holders, n_seq_max, n_seq_max,
                                         self.n_ctx, cells, unified, replace_share)
        # Rows stage in lane order with a KV stream per sequence; with one shared stream there
        # are no runs of lanes to keep or close (rows.py).
        self._rows = rows = RowRunner(ctx, self._decoder, lanes, samplers, self._forks,
                                      self.holders, n_batch=self.n_batch,
                                      n_ctx_seq=self.n_ctx_seq, stage_by_lane=not unified,
                                      gap_fill_max=gap_fill_max, solo_fill=solo_fill)
        self._direct = DirectRows(rows, lanes, samplers, tok.eog, n_batch=self.n_batch,
                                  n_vocab=tok.n_vocab)

    # ------------------------------------------------------------------ the contract's extras
    @property
    def decode_ns(self) -> int:
        """Nanoseconds spent decoding so far: `llama_decode` and the wait for its outputs
        (`DecodeTimingHost`)."""
        return self._decoder.decode_ns

    @property
    def prefix_store(self) -> PrefixStore | None:
        """The store of resident prefixes (None: reuse off); the engine attaches it."""
        return self.holders.store if self.holders is not None else None

    @property
    def memory_components(self) -> list[MemoryComponent]:
        """One KV memory component per device that holds KV cells (`kv-CUDA0`, `kv-CPU`),
        sized from the bytes the placement put there (hosts/offload.py), so admission reserves
        in the device's memory. The holders' streams are resident; what is left is the lanes'
        cells, which a request's lane bounds already, so the components never refuse what a
        lane would take. Empty when the host was built without a placement."""
        p = self.placement
        if p is None or not p.kv or not p.kv_cells:
            return []
        streams = self.n_seq_max + self.prefix_holders
        out = []
        for device, size in p.kv.items():
            per_token = size // p.kv_cells
            held = 0 if self.settings["kv_unified"] else \
                self.prefix_holders * (p.kv_cells // streams)
            out.append(MemoryComponent(f"kv-{device}", capacity_bytes=per_token * p.kv_cells,
                                       resident_bytes=held * per_token,
                                       bytes_per_token=per_token, bytes_per_sequence=0))
        return out

    @property
    def kept_prefixes(self) -> int:
        return self.holders.kept if self.holders is not None else 0

    @property
    def sequence_id_settings(self) -> dict[str, int]:
        """The scheduler config fields that match this host's sequence ids: the lanes below,
        the holders in the reserved range above them (docs/behaviour.md §0.4d)."""
        return {"sequence_id_limit": self.n_seq_max + self.prefix_holders,
                "reserved_sequence_ids": self.prefix_holders}

    def check_config(self, config: SchedulerConfig) -> None:
        """ValueError when a scheduler of `config` would make plans this host cannot run: more
        sequences at once than it has lanes (`max_active_sequences` above `n_seq_max`), or a
        plan of more tokens than its batch holds (`max_tokens_per_iteration`, bounded by
        `max_active_sequences` rows of at most `prefill_chunk_tokens` each, above `n_batch`,
        the batch the context got). The engine calls it when it is built
        (`ConfigCheckingHost`); without it such a plan fails at its execution."""
        c = config.normalized()
        active = c.max_active_sequences
        if active > self.n_seq_max:
            raise ValueError(
                f"the scheduler runs up to {active} sequences at once (max_active_sequences) "
                f"but this host has {self.n_seq_max} lanes (n_seq_max): configure "
                f"max_active_sequences <= {self.n_seq_max}")
        most = min(c.max_tokens_per_iteration, active * c.prefill_chunk_tokens)
        if most > self.n_batch:
            raise ValueError(
                f"the scheduler's plans hold up to {most} tokens (max_tokens_per_iteration "
                f"{c.max_tokens_per_iteration}; {active} rows of at most "
                f"{c.prefill_chunk_tokens} prefill_chunk_tokens) but this host's batch holds "
                f"{self.n_batch} (n_batch, what the context got): configure "
                f"max_tokens_per_iteration <= {self.n_batch}")

    def prepare_sequence(self, sequence: Sequence) -> Sequence:
        """`sequence` as it is, once it is known to run here; ValueError before anything is
        queued for a token outside the vocabulary (in its prompt, its tokens generated
        elsewhere, its sampling's `logit_bias` or `min_end_tokens`) or for more positions than
        a lane holds: its prompt plus `max_tokens`, less the last token, which is never fed,
        above `n_ctx_seq`. The engine ends such a request as rejected (or raises to a submitter
        on its own thread) instead of failing every plan it would be in."""
        self._require_open()
        n_vocab = self.n_vocab
        name = sequence.id
        for field_name in ("prompt_tokens", "generated_tokens"):
            tokens = getattr(sequence, field_name)
            if len(tokens) and max(tokens) >= n_vocab:
                at, token = next((i, t) for i, t in enumerate(tokens) if t >= n_vocab)
                raise ValueError(f"request {name!r}: {field_name}[{at}] = {token} is outside "
                                 f"[0, {n_vocab}), this model's vocabulary")
        sampling = sequence.sampling
        if isinstance(sampling, SamplingParams):
            assert self._samplers is not None
            self._samplers.check_vocabulary(sampling)
            output = sampling.output
            if output is not None and output.grammar is not None:
                # The grammar reads the tokens from prompt_length on (the end of a prompt
                # that started the answer, then the generated ones), and llama.cpp ends the
                # process on one it refuses: they are tried here first.
                start, length = output.prompt_length, len(sequence.prompt_tokens)
                if start > length:
                    raise ValueError(
                        f"request {name!r}: output.prompt_length {start} is past the prompt's "
                        f"{length} tokens (the grammar reads from there)")
                self._samplers.check_grammar(output.grammar)
                fed = [*sequence.prompt_tokens[start:], *sequence.generated_tokens]
                if fed:
                    self._samplers.check_generated(output.grammar, fed, start)
        prompt = len(sequence.prompt_tokens)
        generated = max(sequence.max_tokens, len(sequence.generated_tokens), 1)
        if prompt + generated - 1 > self.n_ctx_seq:
            raise ValueError(
                f"request {name!r} needs {prompt + generated - 1} positions ({prompt} prompt "
                f"tokens and {generated} to generate, the last never fed) but a lane of this "
                f"host holds {self.n_ctx_seq} (n_ctx_seq): shorten the prompt or max_tokens")
        return sequence

    def host_state(self, detail: bool = False) -> HostState:
        """Lanes, KV tokens, samplers; with `detail`, the positions llama.cpp itself holds per
        lane (one call per lane: for leak checks, not every step)."""
        lanes = self._lanes
        cells = self._cells
        return HostState(
            lanes=self.n_seq_max, free_lanes=lanes.free, active=tuple(lanes.active),
            kv_tokens=lanes.kv_tokens, kv_capacity=self.n_ctx,
            kv_lane_capacity=min(self.n_ctx, self.n_seq_max * self.n_ctx_seq),
            samplers=len(self._samplers) if self._samplers else 0,
            decoded_tokens=self.decoded_tokens, shared_tokens=self.shared_tokens,
            kv_copies=cells.copies if cells is not None else 0,
            staged_ahead=self.staged_ahead, not_staged_ahead=dict(self.not_staged_ahead),
            lane_positions=(cells.positions_held(self.n_seq_max)
                            if detail and self._ctx and cells is not None else {}))

    def execute_async(self, plan: Plan) -> "Future[int]":
        """`execute` on the host's worker thread (one: the context runs one decode at a time);
        the engine plans the next step and completes the previous one meanwhile. The ctypes
        call to `llama_decode` releases the GIL for the length of the decode."""
        self._require_open()
        return self._worker.start(plan)

    def execute_after(self, plan: Plan, earlier: list[Plan]) -> "Future[int]":
        """`execute` on the worker behind the plans already started, its deferred inputs
        filled there from `earlier` once they have run (`inflight.HostWorker`): the next
        decode starts as soon as the one before ends, without waiting for the engine."""
        self._require_open()
        return self._worker.after(plan, earlier)

    def call_after(self, fn: Callable[[], object]) -> "Future[object]":
        """`fn()` on the worker behind the plans started (the engine's releases)."""
        return self._worker.call(fn)

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Free llama.cpp's context and model, once the plans started on the worker have run
        and a plan another thread is running has returned; the lanes are empty after it, and
        a plan run after it raises (the host is closed)."""
        self._worker.close()
        with self._busy:
            if self._samplers is not None:
                self._samplers.close()
            if self._cells is not None:
                self._cells.close()
            if self._ctx:
                _ll.llama_free(self._ctx)
                self._ctx = None
            if self._model:
                _ll.llama_model_free(self._model)
                self._model = None
            lanes = getattr(self, "_lanes", None)
            if lanes is not None:
                for sequence_id in list(lanes.active):
                    lanes.give_back(sequence_id)

    def __enter__(self) -> "LlamaHost":
        return self

    def __repr__(self) -> str:
        lanes = getattr(self, "_lanes", None)
        if not getattr(self, "_ctx", None) or lanes is None:
            return f"<LlamaHost {getattr(self, 'model_path', '?')!r}: closed>"
        holders = f", prefix holders {self.prefix_holders}" if self.prefix_holders else ""
        return (f"<LlamaHost {self.model_path!r}: {len(lanes.active)}/{self.n_seq_max} lanes "
                f"busy, n_ctx={self.n_ctx} (n_ctx_seq={self.n_ctx_seq}), "
                f"n_batch={self.n_batch}{holders}>")

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # pragma: no cover - best effort at interpreter exit
        try:
            self.close()
        except Exception:
            pass

    def _require_open(self) -> None:
        if not self._ctx:
            raise RuntimeError("the host is closed")

    @property
    def n_params(self) -> int:
        self._require_open()
        return int(_ll.llama_model_n_params(self._model))

    # ------------------------------------------------------------------ vocabulary
    def is_eog(self, token: int) -> bool:
        return self.tokenizer.is_eog(token)

    def tokenize(self, text: str, *, add_bos: bool | None = None,
                 special: bool = False) -> list[int]:
        self._require_open()
        return self.tokenizer.tokenize(text, add_bos=add_bos, special=special)

    def token_bytes(self, token: int, *, special: bool = False) -> bytes:
        """Reads only the vocabulary: safe from any thread."""
        self._require_open()
        return self.tokenizer.token_bytes(token, special=special)

    def check_grammar(self, grammar: str) -> None:
        """ValueError unless llama.cpp's grammar sampler parses `grammar` (GBNF, root rule
        `root`); reads only the vocabulary: safe from any thread."""
        self._require_open()
        assert self._samplers is not None
        self._samplers.check_grammar(grammar)

    def chat_template(self) -> str | None:
        self._require_open()
        return self.tokenizer.chat_template()

    @property
    def eog_tokens(self) -> list[int]:
        ids: list[int] = self.tokenizer.eog_ids.tolist()
        return ids

    # ------------------------------------------------------------------ lanes
    @property
    def active_sequences(self) -> list[str]:
        return self._lanes.active

    @property
    def free_slots(self) -> int:
        return self._lanes.free

    def seq_id_of(self, sequence_id: str) -> int | None:
        return self._lanes.lane_of(sequence_id)

    def kv_tokens(self, sequence_id: str) -> int:
        """Positions of `sequence_id` held in the KV cache (0 when it has no lane)."""
        lane = self._lanes.lane_of(sequence_id)
        return 0 if lane is None else self._lanes.end(lane)

    # ------------------------------------------------------------------ prefix events
    def watch_prefixes(self, watcher: Watcher) -> None:
        """Call `watcher("inserted" | "evicted", entry)` after every change of the prefix
        store's residency (the serving seam's `PrefixEventsHost`; nothing without reuse)."""
        if self.holders is not None:
            self.holders.watch(watcher)

    def held_tokens(self, sequence_id: str) -> list[int] | None:
        """The tokens the KV of running `sequence_id` stands for, position 0 first; None when
        it holds no lane, or without reuse (only the prefix holders record a lane's tokens)."""
        lane = self._lanes.lane_of(sequence_id)
        if lane is None or self.holders is None:
            return None
        tokens: list[int] = self.holders.lane_tokens(lane, self._lanes.end(lane)).tolist()
        return tokens

    def release(self, sequence_id: str,
                reason: ReleaseReason = ReleaseReason.FINISHED, *, keep: bool = True) -> bool:
        """Free a sequence's lane and its KV cells. With prefix reuse the cells first become a
        resident prefix when the store takes them, whatever the reason: they hold what the
        positions say (a preempted sequence then restores its own prefix when re-admitted).
        `keep=False` frees them without offering them (the server's warm-up, engine/warmup.py)."""
        with self._busy:
            return self._release(sequence_id, keep)

    def _release(self, sequence_id: str, keep: bool) -> bool:
        lane = self._lanes.lane_of(sequence_id)
        if lane is None:
            return False
        assert self._samplers is not None
        self._samplers.drop(lane)
        self._forks.forget(lane)
        try:
            end = self._lanes.end(lane)
            if keep and self.holders is not None and end > 0 and self._ctx:
                self.holders.keep(lane, end)
        finally:
            self._lanes.give_back(sequence_id)  # the lane comes back whatever the store did
        return True

    def keep_prompt(self, sequence_id: str, tokens: int) -> bool:
        """Offer the running sequence's first `tokens` positions (its computed prompt) to the
        store now, as a release would (the cold prefix hold, docs/hosts.md); whether they are
        resident now: False without reuse, when it holds fewer positions or no lane, or when the
        store refused them (every holder pinned, or no room)."""
        with self._busy:
            lane = self._lanes.lane_of(sequence_id)
            if self.holders is None or lane is None or not 0 < tokens <= self._lanes.end(lane):
                return False
            return self.holders.keep_prompt(lane, tokens)

    def release_all(self) -> None:
        for sequence_id in self._lanes.active:
            self.release(sequence_id, ReleaseReason.CANCELLED)

    # ------------------------------------------------------------------ plan execution
    def execute(self, plan: Plan) -> int:
        """Run one plan as one `llama_decode`; fill `plan.outputs`; return the output count
        (`_execute`, with the host held against a close from another thread)."""
        with self._busy:
            return self._execute(plan)

    def _execute(self, plan: Plan) -> int:
        """Run one plan as one `llama_decode`; fill `plan.outputs`; return the output count.

        End-of-generation tokens are reported as -1 so that the scheduler finishes the
        sequence (the end signal is not one of the sequence's tokens).

        With `stage_ahead`, once this plan's decode is launched and before its outputs are
        waited for, the plan queued next on the worker is read and staged into the decoder's
        other batch when that changes no state (rows.py `RowRunner.stage`); its run then only
        copies its tokens in (its deferred inputs filled from this plan's outputs) and
        launches it.
        """
        self._require_open()
        ahead, self._ahead = self._ahead, None
        miss, self._ahead_miss = self._ahead_miss, None
        outputs = plan.outputs
        if len(plan) == 0:
            outputs.count = 0
            return 0
        rows_ = self._rows
        step: Staged | None
        if ahead is not None and ahead.plan is not plan:
            ahead, miss = None, "restaged"  # staged for a plan that did not run
        if ahead is not None and (self._lanes.changes == ahead.lane_changes
                                  or rows_.still_staged(ahead.step)):
            rows, step = ahead.rows, ahead.step
            # its deferred inputs are filled now
            check_tokens(rows.tokens, self.n_vocab, rows.offsets, rows.positions, rows.ids)
            self.staged_ahead += 1
            self.staged_ahead_past_calls += ahead.past_calls
        else:
            if ahead is not None:
                self.staged_again += 1
                miss = "restaged"
            if miss is not None:
                self.not_staged_ahead[miss] += 1
            rows = read_plan(plan, self.n_batch, self.n_vocab)
            samplers = self._samplers
            assert samplers is not None
            holders = self.holders
            # How the sequences of the plan's new rows start (read from the plan, not guessed).
            starting = {n.sequence_id: Start(samplers.resolve(n.sampling),
                                             n.holder if holders is not None else None)
                        for n in rows.new}
            step = rows_.stage(rows.ids, rows.starts, starting, rows.offsets, rows.tokens,
                               rows.positions, rows.sample_rows)
            assert step is not None
        ahead_now = self._stage_ahead and len(step.flagged) > 0
        rows_.launch(step, wait=not ahead_now)
        if ahead_now:
            try:
                self._ahead_miss = self._stage_next()
            except Exception:  # staging ahead never fails this plan: the next is staged
                self._ahead = None  # when it runs, which reports what is wrong with it
                self._ahead_miss = "not_stageable"
        elif self._stage_ahead:
            self._ahead_miss = "plan_before_waited"
        try:
            tokens, details = rows_.finish(step)
        except BaseException:
            self._ahead, self._ahead_miss = None, None  # staged against this plan's lanes
            raise
        if details:
            kept = self._details
            kept[id(plan)] = (plan, details)
            while len(kept) > _KEPT_DETAILS:
                del kept[next(iter(kept))]
        sample_rows = rows.sample_rows
        k = len(sample_rows)
        outputs.request_indexes[:k] = sample_rows
        outputs.predicted_tokens[:k] = np.where(self.tokenizer.eog[tokens], -1, tokens)
        outputs.count = k
        return k

    def _stage_next(self) -> str | None:
        """Stage the plan queued next on the worker, if it can be staged ahead (`execute`);
        None if it was, else why not (`NOT_STAGED_REASONS`). Raises what reading the plan
        raises (a plan no longer live, a bad plan)."""
        # The launch just now woke the engine (it handed the plan before out): it is making
        # the next plan, so wait for it a while, at most half the last such step (the device
        # is still running this one) and 5 ms.
        worker = self._worker
        last = self._decoder.last_wait_ns
        wait_s = min(last / 2e9, _AHEAD_WAIT_S) if worker.released and last else 0.0
        queued = worker.next_plan(wait_s)
        if queued is None:
            return "not_queued"
        plan, calls = queued
        if len(plan) == 0:
            return None  # runs as nothing
        if bool(np.any(plan.new_rows)):
            return "new_rows"
        rows = read_plan(plan, self.n_batch, self.n_vocab, check=False)
        step = self._rows.stage(rows.ids, rows.starts, {}, rows.offsets, rows.tokens,
                                rows.positions, rows.sample_rows, ahead=True)
        if step is not None:
            # Calls before it (the engine's releases and keeps) change lanes it has no row
            # on, and so would anything else that changes the lanes meanwhile: what it was
            # staged against is checked again when it runs if the lanes changed.
            self._ahead = _Ahead(plan, rows, step, self._lanes.changes, calls > 0)
            return None
        return "not_stageable"

    @property
    def shared_tokens(self) -> int:
        """Entries a fork's copy replaced instead of a decode (forks.py)."""
        return self._forks.shared_tokens

    @property
    def decoded_tokens(self) -> int:
        """Batch entries decoded (a fork's copied rows and filler rows not included)."""
        return self._rows.decoded_tokens

    @property
    def backend_chain_attaches(self) -> int:
        """Sampler chains attached to the context so far (backend sampling; each makes
        llama.cpp reserve its graphs again at the next decode)."""
        device = self._samplers.device if self._samplers is not None else None
        return device.attaches if device is not None else 0

    @property
    def gap_fill_rows(self) -> int:
        """Filler entries decoded (rows.py `RowRunner._gap_fill`)."""
        return self._rows.gap_fill_rows

    @property
    def solo_fill_rows(self) -> int:
        """Filler entries decoded beside a batch of one token (rows.py
        `RowRunner._solo_fill`)."""
        return self._rows.solo_fill_rows

    @property
    def solo_fill(self) -> bool:
        """Whether a batch of one token gets a filler row on another lane, so that its logits
        are the bits it gets in any batch on llama.cpp's CPU backend; settable."""
        return self._rows.solo_fill

    @solo_fill.setter
    def solo_fill(self, value: bool) -> None:
        self._rows.solo_fill = value

    @property
    def gap_fill_max(self) -> int:
        """Filler rows close gaps of at most this many lanes in a batch's run of decoding
        lanes (0: off); settable."""
        return self._rows.gap_fill_max

    @gap_fill_max.setter
    def gap_fill_max(self, value: int) -> None:
        self._rows.gap_fill_max = value

    def logits_of_batch_row(self, batch_row: int) -> npt.NDArray[np.float32]:
        """Copy of the logits of one flagged entry of the last decode (`llama_get_logits_ith`)."""
        self._require_open()
        return self._decoder.logits_of(batch_row)

    def sample_details(self, plan: Plan) -> Mapping[int, SampleDetail] | None:
        """What `execute(plan)` reported with its samples (`SampleDetail` by work index), once;
        None when no sequence of the plan asked for any."""
        if not self._details:
            return None
        kept = self._details.pop(id(plan), None)
        return kept[1] if kept is not None and kept[0] is plan else None

    # ------------------------------------------------------------------ rows outside plans
    def run_rows(self, rows: Iterable[tuple[str, _Seq[int], int, bool]],
                 sampling: dict[str, object] | None = None) -> dict[str, int]:
        """Decode explicit rows (sequence id, tokens, start position, sample_last) in one call;
        the raw sampled token of every sampling row by sequence id (direct.py)."""
        self._require_open()
        return self._direct.run_rows(rows, sampling)

    def generate_alone(self, prompt: _Seq[int], max_tokens: int,
                       sampling: object = None) -> list[int]:
        """Tokens of `prompt` run as the only sequence, up to `max_tokens` or the first
        end-of-generation token (included): the reference for equality tests (direct.py)."""
        self._require_open()
        return self._direct.generate_alone(prompt, max_tokens, sampling, self.release)

