"""Execute the scheduler's iteration plans on llama.cpp (through `llama-cpp-python`).

`LlamaHost` owns one llama.cpp model and context and turns each plan into exactly one
`llama_decode` call: the plan's flat token/position arena is copied into a batch whose buffers
are numpy arrays owned by the host, every row's entries carry the llama sequence id of that row's
sequence, and logits are requested only for the last entry of sampling rows. Predictions go back
into the plan's compact output block as (work index, token) pairs, the same hand-off as the
native ABI (docs/hosts.md).

Sampling is per sequence (`Sequence.sampling`, see `skippy_scheduler.sampling`): greedy
sequences (None) take one vectorised argmax over the plan's logits, exactly as before sampling
existed; any other sequence gets its own llama.cpp sampler chain, built when the sequence takes
a llama sequence id and freed with it. A chain's state is a function of the sequence's tokens
(the penalty window is refilled from the rows it is fed, so a recompute after preemption
rebuilds it) and of the predicted position (each draw is seeded from the sequence's seed and
that position), so a seeded sequence samples the same tokens alone, batched or preempted.

Each active scheduler sequence is mapped to a llama sequence id (a *lane*) taken from a free
list of ids below `n_seq_max`. When a sequence ends, is cancelled or is preempted, `release`
removes its KV cells from the lane.

Prefix reuse (`prefix_cache_tokens > 0`, docs/hosts.md "Prefix reuse"): the context then has
`prefix_holders` more sequence ids, the *holders*, above the lanes. The host owns a
`PrefixStore` whose holder ids are those; the engine attaches it to the scheduler, which then
reads restores from it natively. Releasing a sequence first keeps its KV as a resident prefix
under the new entry's holder (`llama_memory_seq_cp` from the lane), then `seq_rm` of the lane. A
sequence admitted with a restore gets the prefix by `seq_cp` from the holder the plan names
(`IterationWork.restore_holder`) into its lane, so only the suffix is prefilled; a full-prompt
hit replays the last prompt token for its logits. Eviction removes the holder's KV. Two layouts:
by default every lane and holder has a KV stream of its own and `seq_cp` copies a whole stream
(then the copy is trimmed to the prefix); with `kv_unified=True` all share one cache and
`seq_cp` shares cells without copying, but then every token's attention spans the cells of all
sequences. Positions never move (a restored prefix keeps its positions), so
`llama_memory_can_shift` is not needed.

Defaults favour exactness: f32 weights (the tiny model), f32 KV cache and flash attention off are
the settings under which a sequence's greedy tokens do not depend on what it was batched with.
"""
from __future__ import annotations

import collections
import ctypes
import heapq
import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Iterable, Sequence as _Seq

import numpy as np

import llama_cpp as _ll

from ..prefix_store import PrefixStore
from ..sampling import SamplingParams, is_native_config, step_seed

# ggml log levels as llama.cpp emits them: DEBUG 1, INFO 2, WARN 3, ERROR 4, CONT 5 (the
# Python binding's own constants are off by one).
_LOG_WARN, _LOG_ERROR, _LOG_CONT = 3, 4, 5
_recent_log: collections.deque[str] = collections.deque(maxlen=64)
_log_keep_continuation = False


# A shared part shorter than this is not worth a holder sequence of its own.
_MIN_SPLIT_TOKENS = 16


class _HolderBackend:
    """The store's backend: holder sequences of the host's context (module docs)."""

    def __init__(self, host: "LlamaHost") -> None:
        self._host = host

    def inserted(self, entry: Any) -> None:
        self._host._holder_inserted(entry)

    def evicted(self, entry: Any) -> None:
        self._host._holder_evicted(entry)


@_ll.llama_log_callback  # type: ignore[untyped-decorator, unused-ignore]
def _log_sink(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    # Keep warnings and errors for error messages; the INFO metadata dump would drown a terminal.
    global _log_keep_continuation
    if level == _LOG_CONT:
        keep = _log_keep_continuation
    else:
        keep = level in (_LOG_WARN, _LOG_ERROR)
        _log_keep_continuation = keep
    if keep:
        _recent_log.append(text.decode("utf-8", "replace"))


_backend_ready = False


def _init_backend() -> None:
    global _backend_ready
    if not _backend_ready:
        _ll.llama_log_set(_log_sink, ctypes.c_void_p(0))
        _ll.llama_backend_init()
        _backend_ready = True


def recent_log(n: int = 8) -> str:
    """The last `n` warning/error lines llama.cpp logged (for diagnostics)."""
    return "".join(list(_recent_log)[-n:]).strip()


_KV_TYPES = {"f32": 0, "f16": 1}  # ggml_type values of GGML_TYPE_F32 / GGML_TYPE_F16


def _check_int(name: str, value: object, lo: int, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    value = int(value)
    if value < lo or (hi is not None and value > hi):
        bound = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise ValueError(f"{name} must be {bound}, got {value}")
    return value


class _Sampler:
    """The llama.cpp sampler chain of one sequence and what it has been fed.

    `history` holds every token of the sequence before position `fed` (only when a penalty is
    active: the penalty window is the chain's one piece of token-dependent state). Random draws
    are made by a `dist` sampler appended for one sample and removed again, seeded by
    `step_seed(seed, position)`, so no RNG state is carried from one token to the next.
    """

    __slots__ = ("params", "chain", "fixed", "history", "fed", "_bias_keep")

    def __init__(self, params: SamplingParams, n_vocab: int, eog_ids: np.ndarray) -> None:
        self.params = params
        self.history: list[int] | None = [] if params.penalized else None
        self.fed = 0
        self.chain = None
        self.fixed = 0
        self._bias_keep = None
        if not params.plain_greedy:
            self._build(n_vocab, eog_ids)

    def _build(self, n_vocab: int, eog_ids: np.ndarray) -> None:
        p = self.params
        cparams = _ll.llama_sampler_chain_default_params()
        cparams.no_perf = True
        chain = _ll.llama_sampler_chain_init(cparams)
        if not chain:
            raise RuntimeError("llama.cpp could not create a sampler chain")
        self.chain = chain
        stages = []
        bias = dict(p.logit_bias)
        if p.ignore_eos:
            for t in eog_ids.tolist():
                bias[t] = -float("inf")
        if bias:
            arr = (_ll.llama_logit_bias * len(bias))()
            for i, (t, b) in enumerate(sorted(bias.items())):
                arr[i].token = t
                arr[i].bias = b
            stages.append(_ll.llama_sampler_init_logit_bias(n_vocab, len(bias), arr))
        if p.penalized:
            stages.append(_ll.llama_sampler_init_penalties(
                n_vocab, p.penalty_last_n, p.repetition_penalty, p.frequency_penalty,
                p.presence_penalty))
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

    def feed(self, tokens: np.ndarray, start: int) -> None:
        """The row's tokens at positions start, start + 1, ...: the ones not yet seen go into
        the penalty window (a decode row's input is the token the chain sampled itself)."""
        end = start + len(tokens)
        if end <= self.fed:
            return
        new = tokens[self.fed - start:] if self.fed > start else tokens
        self.history.extend(new.tolist())  # type: ignore[union-attr]
        # Only the last penalty_last_n tokens can still be in the window.
        for t in new[-self.params.penalty_last_n:].tolist():
            _ll.llama_sampler_accept(self.chain, t)
        self.fed = end

    def rewind(self, start: int, n_vocab: int, eog_ids: np.ndarray) -> None:
        """Forget positions >= start (the sequence replays from there)."""
        if self.history is None or start >= self.fed:
            self.fed = min(self.fed, start)
            return
        kept = self.history[:start]
        self.free()
        self._build(n_vocab, eog_ids)
        self.history, self.fed = [], 0
        self.feed(np.asarray(kept, dtype=np.int32), 0)

    def sample(self, ctx, batch_row: int, position: int) -> int:
        """Sample the token at `position` from the logits of `batch_row` of the last decode."""
        chain = self.chain
        if not self.params.greedy:
            _ll.llama_sampler_chain_add(chain, _ll.llama_sampler_init_dist(
                step_seed(self.params.seed, position)))
        token = int(_ll.llama_sampler_sample(chain, ctx, batch_row))  # also accepts it
        if not self.params.greedy:
            _ll.llama_sampler_free(_ll.llama_sampler_chain_remove(chain, self.fixed))
        if self.history is not None:
            self.history.append(token)
            self.fed = position + 1
        return token


def _row_sequence_ids(plan: Any) -> list[str]:
    # NOTE: both schedulers' plans list their row ids (`plan.sequence_ids`); a hand-made plan
    # (the host's own tests) may only have `work`.
    ids = getattr(plan, "sequence_ids", None)
    if ids is not None:
        return list(ids)
    return [w.sequence_id for w in plan.work]


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
        flash_attn: bool = False,
        kv_unified: bool | None = None,
        prefix_cache_tokens: int = 0,
        prefix_holders: int = 16,
    ) -> None:
        n_seq_max = _check_int("n_seq_max", n_seq_max, 1, 256)
        prefix_cache_tokens = _check_int("prefix_cache_tokens", prefix_cache_tokens, 0)
        holders = 0
        if prefix_cache_tokens:
            holders = _check_int("prefix_holders", prefix_holders, 1, 256 - n_seq_max)
        # With reuse and kv_unified left unset, every lane and holder has a KV stream of its own
        # (n_ctx is split evenly over them) and prefixes move by whole-stream copies; with
        # kv_unified=True they share cells of one cache (module docs).
        kv_unified = bool(kv_unified)
        n_ctx = _check_int("n_ctx", n_ctx, 1)
        n_threads = _check_int("n_threads", n_threads, 1)
        n_batch = _check_int("n_batch", n_batch, 1)
        n_ubatch = n_batch if n_ubatch is None else _check_int("n_ubatch", n_ubatch, 1, n_batch)
        if kv_type not in _KV_TYPES:
            raise ValueError(f"kv_type must be one of {sorted(_KV_TYPES)}, got {kv_type!r}")
        path = os.fspath(model_path)
        if not os.path.isfile(path):
            raise FileNotFoundError(path)
        self.model_path = path
        self._model = None
        self._ctx = None
        self._worker: ThreadPoolExecutor | None = None
        _init_backend()

        mparams = _ll.llama_model_default_params()
        mparams.n_gpu_layers = 0
        model = _ll.llama_model_load_from_file(path.encode(), mparams)
        if not model:
            raise RuntimeError(f"llama.cpp could not load {path}: {recent_log()}")
        self._model = model

        # Fields are set by name: the struct layout changes between llama.cpp versions.
        cparams = _ll.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = n_batch
        cparams.n_ubatch = n_ubatch
        cparams.n_seq_max = n_seq_max + holders
        # NOTE: llama.cpp reserves one output row per sequence id at creation and asserts that
        # this fits its output limit, which defaults to n_batch: with fewer batch tokens than
        # sequence ids (a 3-token batch over 4 lanes) the context aborts the process. A plan
        # never samples more rows than it has tokens, so raising the limit to the id count only
        # sizes the reserve llama.cpp makes anyway.
        cparams.n_outputs_max = max(n_batch, n_seq_max + holders)
        cparams.n_threads = n_threads
        cparams.n_threads_batch = n_threads
        cparams.flash_attn_type = 1 if flash_attn else 0
        cparams.type_k = _KV_TYPES[kv_type]
        cparams.type_v = _KV_TYPES[kv_type]
        cparams.kv_unified = bool(kv_unified)
        cparams.embeddings = False
        cparams.no_perf = True
        ctx = _ll.llama_init_from_model(model, cparams)
        if not ctx:
            self.close()
            raise RuntimeError(f"llama.cpp could not create a context: {recent_log()}")
        self._ctx = ctx
        self._mem = _ll.llama_get_memory(ctx)
        self._vocab = _ll.llama_model_get_vocab(model)
        self.n_vocab = int(_ll.llama_vocab_n_tokens(self._vocab))
        self.n_seq_max = n_seq_max
        # What the context got, not what was asked: llama.cpp caps the batch at the context
        # size it was given (before rounding that up to 256 per lane) and the micro-batch at the
        # batch, and a plan above its batch aborts the process in llama_decode. Plans are sized
        # from `n_batch` (the server's and `run`'s max_tokens_per_iteration).
        self.n_batch = int(_ll.llama_n_batch(ctx))
        n_ubatch = int(_ll.llama_n_ubatch(ctx))
        got_seq = int(_ll.llama_n_seq_max(ctx))
        if got_seq != n_seq_max + holders or self.n_batch < 1:
            self.close()
            raise ValueError(f"llama.cpp gave the context {got_seq} sequence ids and a batch "
                             f"of {self.n_batch} tokens; the host needs {n_seq_max + holders} "
                             "sequence ids and a batch of at least one token")
        self.n_ctx = int(_ll.llama_n_ctx(ctx))
        self.n_ctx_seq = int(_ll.llama_n_ctx_seq(ctx))
        self.settings = {
            "n_ctx": self.n_ctx, "n_ctx_seq": self.n_ctx_seq, "n_seq_max": n_seq_max,
            "n_batch": self.n_batch, "n_ubatch": n_ubatch, "n_threads": n_threads,
            "kv_type": kv_type, "flash_attn": bool(flash_attn), "kv_unified": bool(kv_unified),
            "prefix_cache_tokens": prefix_cache_tokens, "prefix_holders": holders,
        }
        # One vocabulary scan up front so that sampling never calls back per token.
        self._eog = np.fromiter(
            (bool(_ll.llama_vocab_is_eog(self._vocab, t)) for t in range(self.n_vocab)),
            dtype=bool, count=self.n_vocab,
        )
        self._eog_ids = np.flatnonzero(self._eog).astype(np.int32)

        # Batch buffers owned by the host; the llama_batch struct only points into them.
        n_batch = self.n_batch
        self._tok = np.zeros(n_batch, dtype=np.int32)
        self._pos = np.zeros(n_batch, dtype=np.int32)
        self._nsid = np.ones(n_batch, dtype=np.int32)
        self._sid = np.zeros(n_batch, dtype=np.int32)
        self._flag = np.zeros(n_batch, dtype=np.int8)
        # seq_id is int32**: entry i points at self._sid[i], so seq ids are filled with numpy.
        self._sid_ptrs = np.uint64(self._sid.ctypes.data) + np.uint64(4) * np.arange(
            n_batch, dtype=np.uint64
        )
        batch = _ll.llama_batch()
        batch.n_tokens = 0
        batch.token = self._tok.ctypes.data_as(ctypes.POINTER(_ll.llama_token))
        batch.embd = ctypes.POINTER(ctypes.c_float)()
        batch.pos = self._pos.ctypes.data_as(ctypes.POINTER(_ll.llama_pos))
        batch.n_seq_id = self._nsid.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        batch.seq_id = ctypes.cast(
            self._sid_ptrs.ctypes.data, ctypes.POINTER(ctypes.POINTER(_ll.llama_seq_id))
        )
        batch.logits = self._flag.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))
        self._batch = batch

        # Sequence-id bookkeeping: lowest free ids first, so that batches use consecutive ids
        # (llama.cpp splits a non-unified batch into fewer ubatches then).
        self._free: list[int] = list(range(n_seq_max))
        self._slot: dict[str, int] = {}
        self._next_pos = [0] * n_seq_max
        # Sequences that are not plain greedy, by llama sequence id.
        self._samplers: dict[int, _Sampler] = {}

        # Prefix reuse: the store, each lane's token history (the key its cells stand for) and
        # the resident entry of each holder id.
        self.prefix_store: PrefixStore | None = None
        self.prefix_holders = holders
        self._shared_cells = kv_unified  # else: one stream per sequence id, whole-stream copies
        self._hist: np.ndarray | None = None
        self._holder_entry: dict[int, Any] = {}
        self._keeping_lane = -1
        self.kept_prefixes = 0
        if prefix_cache_tokens:
            self._hist = np.zeros((n_seq_max, self.n_ctx), dtype=np.int32)
            self.prefix_store = PrefixStore(prefix_cache_tokens, holders,
                                            backend=_HolderBackend(self),
                                            first_holder_id=n_seq_max)

    @property
    def sequence_id_settings(self) -> dict[str, int]:
        """The scheduler config fields that match this host's sequence ids: the lanes below,
        the holders in the reserved range above them (docs/behaviour.md §0.4d)."""
        return {"sequence_id_limit": self.n_seq_max + self.prefix_holders,
                "reserved_sequence_ids": self.prefix_holders}

    # ------------------------------------------------------------------ lifecycle
    def execute_async(self, plan: Any) -> "Future[int]":
        """`execute` on the host's worker thread (one: the context runs one decode at a time);
        the engine plans the next step and completes the previous one meanwhile. The ctypes
        call to `llama_decode` releases the GIL for the length of the decode."""
        self._require_open()
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llama-decode")
        return self._worker.submit(self.execute, plan)

    def close(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None
        for sampler in self._samplers.values():
            sampler.free()
        self._samplers.clear()
        if self._ctx:
            _ll.llama_free(self._ctx)
            self._ctx = None
        if self._model:
            _ll.llama_model_free(self._model)
            self._model = None

    def __enter__(self) -> "LlamaHost":
        return self

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

    # ------------------------------------------------------------------ vocabulary
    def is_eog(self, token: int) -> bool:
        return 0 <= token < self.n_vocab and bool(self._eog[token])

    def tokenize(self, text: str, *, add_bos: bool | None = None,
                 special: bool = False) -> list[int]:
        """Tokenize with the model's tokenizer; BOS is added when the model asks for it.
        `special` parses control-token text (a chat template's markers) as those tokens."""
        self._require_open()
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        if add_bos is None:
            add_bos = bool(_ll.llama_vocab_get_add_bos(self._vocab))
        data = text.encode("utf-8")
        cap = len(data) + 8
        buf = (_ll.llama_token * cap)()
        n = _ll.llama_tokenize(self._vocab, data, len(data), buf, cap, add_bos, special)
        if n < 0:  # cannot happen with cap > bytes + specials, but the API allows it
            cap = -n
            buf = (_ll.llama_token * cap)()
            n = _ll.llama_tokenize(self._vocab, data, len(data), buf, cap, add_bos, special)
        return list(buf[:n])

    def token_bytes(self, token: int, *, special: bool = False) -> bytes:
        """The bytes a token stands for (a piece may hold part of a UTF-8 character); control
        tokens are empty unless `special`. Reads only the vocabulary: safe from any thread."""
        self._require_open()
        buf = ctypes.create_string_buffer(64)
        n = _ll.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = _ll.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
        return buf.raw[:n]

    def chat_template(self) -> str | None:
        """The model's default chat template (GGUF `tokenizer.chat_template`), if it has one."""
        self._require_open()
        raw = _ll.llama_model_chat_template(self._model, None)
        return raw.decode("utf-8", "replace") if raw else None

    @property
    def eog_tokens(self) -> list[int]:
        return self._eog_ids.tolist()

    # ------------------------------------------------------------------ sequence slots
    @property
    def active_sequences(self) -> list[str]:
        return list(self._slot)

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def seq_id_of(self, sequence_id: str) -> int | None:
        return self._slot.get(sequence_id)

    def kv_tokens(self, sequence_id: str) -> int:
        """Positions of `sequence_id` held in the KV cache (0 when it has no slot)."""
        sid = self._slot.get(sequence_id)
        return 0 if sid is None else self._next_pos[sid]

    def release(self, sequence_id: str) -> bool:
        """Free a sequence's llama sequence id and its KV cells (finish, cancel, preempt); with
        prefix reuse the cells first become a resident prefix when the store takes them."""
        sid = self._slot.pop(sequence_id, None)
        if sid is None:
            return False
        sampler = self._samplers.pop(sid, None)
        if sampler is not None:
            sampler.free()
        try:
            if self.prefix_store is not None and self._next_pos[sid] > 0 and self._ctx:
                self._keep_prefix(sid)
        finally:
            self._drop_kv(sid)  # the lane comes back whatever the store did
            heapq.heappush(self._free, sid)
        return True

    def _keep_prefix(self, sid: int) -> None:
        """Offer the lane's cells to the store as the prefix they stand for."""
        store = self.prefix_store
        assert store is not None and self._hist is not None
        n = self._next_pos[sid]
        key = self._hist[sid, :n].copy()
        hit = store.match(key)
        if hit.matched_tokens == n:
            store.touch(hit.entry)  # all of it is resident already
            return
        matched = hit.matched_tokens
        parent = None
        if self._shared_cells:
            # The parent is the deepest resident entry whose whole key is a prefix of this one:
            # its cells are shared, so the store counts them once. (With a stream per holder
            # every entry holds its whole key and is counted so, with no parent.)
            parent = hit.entry
            while parent is not None and parent.length > matched:
                parent = parent.parent
        self._keeping_lane = sid
        try:
            if self._shared_cells and matched >= _MIN_SPLIT_TOKENS and (
                    parent is None or parent.length < matched):
                # The shared part becomes an entry of its own (a branch point), so the store
                # counts the cells it shares with the other key once, as the KV cache holds them.
                split = store.insert(key[:matched], parent)
                if split is not None:
                    parent = split
            if store.insert(key, parent) is not None:
                self.kept_prefixes += 1
        finally:
            self._keeping_lane = -1

    def _holder_inserted(self, entry: Any) -> None:
        # The new entry's holder shares cells, nothing is copied: its parent's cells for the
        # parent's positions (the store counts those once, under the parent, so they must be
        # the same cells even when the lane computed its own copy), the lane's for the rest.
        holder = entry.holder
        _ll.llama_memory_seq_rm(self._mem, holder, -1, -1)
        if not self._shared_cells:
            # Streams of their own: the holder gets a copy of the lane's stream (llama.cpp copies
            # whole streams only; the data moves at the next decode), trimmed to the key.
            _ll.llama_memory_seq_cp(self._mem, self._keeping_lane, holder, -1, -1)
            _ll.llama_memory_seq_rm(self._mem, holder, entry.length, -1)
        else:
            start = 0
            if entry.parent is not None:
                start = entry.parent.length
                _ll.llama_memory_seq_cp(self._mem, entry.parent.holder, holder, 0, start)
            _ll.llama_memory_seq_cp(self._mem, self._keeping_lane, holder, start, entry.length)
        self._holder_entry[holder] = entry

    def _holder_evicted(self, entry: Any) -> None:
        self._holder_entry.pop(entry.holder, None)
        if self._ctx:
            _ll.llama_memory_seq_rm(self._mem, entry.holder, -1, -1)

    def _restore(self, sid: int, holder: int, start: int, sampler: "_Sampler | None") -> None:
        """Give lane `sid` the holder's first `start` positions (a prefix restore)."""
        entry = self._holder_entry.get(holder)
        if entry is None or not entry.alive or entry.length < start:
            raise ValueError(f"restore from holder {holder}: it holds "
                             f"{0 if entry is None else entry.length} positions, the row needs "
                             f"{start}")
        if self._shared_cells:
            _ll.llama_memory_seq_cp(self._mem, holder, sid, 0, start)
        else:
            _ll.llama_memory_seq_cp(self._mem, holder, sid, -1, -1)
            _ll.llama_memory_seq_rm(self._mem, sid, start, -1)
        self._next_pos[sid] = start
        assert self._hist is not None
        self._hist[sid, :start] = entry.key[:start]
        if sampler is not None and sampler.history is not None:
            sampler.feed(self._hist[sid, :start], 0)  # the penalty window sees the prefix too

    def release_all(self) -> None:
        for sequence_id in list(self._slot):
            self.release(sequence_id)

    def _drop_kv(self, sid: int) -> None:
        self._require_open()
        _ll.llama_memory_seq_rm(self._mem, sid, -1, -1)
        self._next_pos[sid] = 0

    # ------------------------------------------------------------------ plan execution
    def execute(self, plan: Any) -> int:
        """Run one plan as one `llama_decode`; fill `plan.outputs`; return the output count.

        End-of-generation tokens are reported as -1 so that the scheduler finishes the
        sequence (the end signal is not one of the sequence's tokens).
        """
        self._require_open()
        outputs = plan.outputs
        rows = len(plan)
        if rows == 0:
            outputs.count = 0
            return 0
        offsets = np.asarray(plan.row_offsets, dtype=np.int64)
        n = int(offsets[-1])
        if n > self.n_batch:
            raise ValueError(
                f"plan has {n} tokens but the host's batch holds {self.n_batch}; "
                "keep max_tokens_per_iteration <= n_batch"
            )
        tokens_in = np.asarray(plan.tokens)[:n]
        positions = np.asarray(plan.positions)[:n]
        if len(tokens_in) != n or len(positions) != n or n != plan.token_count:
            raise ValueError(
                f"plan arrays disagree: row_offsets end at {n}, token_count is "
                f"{plan.token_count}, {len(tokens_in)} tokens and {len(positions)} positions")
        if n and (int(tokens_in.min()) < 0 or int(tokens_in.max()) >= self.n_vocab):
            raise ValueError(f"plan tokens must be in [0, {self.n_vocab}) for this model")
        starts = positions[offsets[:-1]]
        ends = positions[offsets[1:] - 1] + 1
        # Validate every row before any state changes, then allocate ids for new sequences.
        ids = _row_sequence_ids(plan)
        sampling = self._new_sampling(plan, ids)
        holders = self._new_restores(plan, ids)
        row_sids = self._assign_slots(ids, starts.tolist(), sampling, holders)
        self._tok[:n] = tokens_in
        self._pos[:n] = positions
        sample_rows = np.asarray(plan.sample_rows, dtype=np.int64)
        try:
            tokens = self._decode(n, row_sids, offsets, sample_rows)
        except RuntimeError:
            self._undo(ids, row_sids, starts.tolist())
            raise
        for sid, end in zip(row_sids.tolist(), ends.tolist()):
            self._next_pos[sid] = end
        if self._hist is not None:
            self._hist[np.repeat(row_sids, np.diff(offsets)), positions] = tokens_in
        k = len(sample_rows)
        outputs.request_indexes[:k] = sample_rows
        outputs.predicted_tokens[:k] = np.where(self._eog[tokens], -1, tokens)
        outputs.count = k
        return k

    def _resolve(self, sampling: object) -> SamplingParams | None:
        """The params a `Sequence.sampling` stands for on this model; None for plain greedy."""
        if sampling is None:
            return None
        if is_native_config(sampling):
            sampling = SamplingParams.from_native(sampling)
            if sampling is None:
                return None
        elif not isinstance(sampling, SamplingParams):
            raise TypeError("sampling must be None, a SamplingParams or a cffi "
                            f"'skippy_sampling_config *', got {type(sampling).__name__}")
        for token, _ in sampling.logit_bias:
            if token >= self.n_vocab:
                raise ValueError(f"logit_bias names token {token}, outside [0, {self.n_vocab}) "
                                 "for this model")
        if sampling.plain_greedy and not sampling.ignore_eos:
            return None
        return sampling

    def _new_sampling(self, plan, ids: list[str]) -> dict[str, SamplingParams | None]:
        """Resolved sampling of the plan's sequences that have no llama sequence id yet."""
        if all(i in self._slot for i in ids):
            return {}
        # NOTE: `plan.work` is built only on plans that bring a sequence in (a prefill or a
        # recompute), never on the steady decode path.
        work = getattr(plan, "work", None) or []
        return {w.sequence_id: self._resolve(getattr(w, "sampling", None))
                for w in work if w.sequence_id not in self._slot}

    def _new_restores(self, plan, ids: list[str]) -> dict[str, int]:
        """Holder ids of the restores of the plan's sequences that have no lane yet."""
        if self.prefix_store is None or all(i in self._slot for i in ids):
            return {}
        work = getattr(plan, "work", None) or []
        return {w.sequence_id: w.restore_holder for w in work
                if w.sequence_id not in self._slot and getattr(w, "restore_holder", None) is not None}

    def _assign_slots(self, ids: list[str], starts: list[int],
                      sampling: dict[str, SamplingParams | None] | None = None,
                      holders: dict[str, int] | None = None) -> np.ndarray:
        new = [i for i in ids if i not in self._slot]
        if len(set(ids)) != len(ids):
            raise ValueError("a sequence appears in more than one row of the plan")
        if len(new) > len(self._free):
            raise RuntimeError(
                f"{len(new)} new sequences but only {len(self._free)} free llama sequence ids "
                f"(n_seq_max={self.n_seq_max}); keep max_active_sequences <= n_seq_max"
            )
        for seq, start in zip(ids, starts):
            if seq in self._slot:
                have = self._next_pos[self._slot[seq]]
            elif holders and seq in holders:
                entry = self._holder_entry.get(holders[seq])
                have = 0 if entry is None or not entry.alive else entry.length
            else:
                have = 0
            if start > have:
                raise ValueError(
                    f"row of {seq!r} starts at position {start} but the host holds {have} "
                    "positions for it (no resident prefix restores them)"
                )
        sids = np.empty(len(ids), dtype=np.int32)
        for i, (seq, start) in enumerate(zip(ids, starts)):
            sid = self._slot.get(seq)
            if sid is None:
                sid = heapq.heappop(self._free)
                self._slot[seq] = sid
                self._drop_kv(sid)
                params = sampling.get(seq) if sampling else None
                sampler = None
                if params is not None:
                    sampler = self._samplers[sid] = _Sampler(params, self.n_vocab, self._eog_ids)
                if start > 0:
                    assert holders is not None  # checked above
                    self._restore(sid, holders[seq], start, sampler)
            elif start < self._next_pos[sid]:
                # Replaying from an earlier position: drop the cells the replay rewrites.
                _ll.llama_memory_seq_rm(self._mem, sid, start, -1)
                self._next_pos[sid] = start
                sampler = self._samplers.get(sid)
                if sampler is not None:
                    sampler.rewind(start, self.n_vocab, self._eog_ids)
            sids[i] = sid
        return sids

    def _undo(self, ids: list[str], row_sids: np.ndarray, starts: list[int]) -> None:
        # A failed decode leaves each row's sequence as it was before the call.
        for seq, sid, start in zip(ids, row_sids.tolist(), starts):
            if start == 0:
                self.release(seq)
            else:
                _ll.llama_memory_seq_rm(self._mem, sid, start, -1)
                self._next_pos[sid] = start

    def _decode(
        self, n: int, row_sids: np.ndarray, offsets: np.ndarray, sample_rows: np.ndarray
    ) -> np.ndarray:
        """Decode the first `n` staged entries; return the sampled token of each sampling row
        (argmax for greedy sequences)."""
        counts = np.diff(offsets)
        self._sid[:n] = np.repeat(row_sids, counts)
        self._flag[:n] = 0
        out_rows = offsets[sample_rows + 1] - 1
        self._flag[out_rows] = 1
        self._batch.n_tokens = n
        rc = _ll.llama_decode(self._ctx, self._batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}: {recent_log()}")
        if self._samplers:
            self._feed_penalised(row_sids, offsets)
        k = len(sample_rows)
        if k == 0:
            return np.zeros(0, dtype=np.int32)
        # Output logits are contiguous, one row per flagged entry in batch order.
        ptr = _ll.llama_get_logits(self._ctx)
        logits = np.ctypeslib.as_array(ptr, shape=(k, self.n_vocab))
        tokens = logits.argmax(axis=1).astype(np.int32)
        if self._samplers:
            self._sample_special(tokens, logits, row_sids, sample_rows, out_rows)
        return tokens

    def _feed_penalised(self, row_sids: np.ndarray, offsets: np.ndarray) -> None:
        samplers = self._samplers
        for r, sid in enumerate(row_sids.tolist()):
            sampler = samplers.get(sid)
            if sampler is not None and sampler.history is not None:
                a, b = int(offsets[r]), int(offsets[r + 1])
                sampler.feed(self._tok[a:b], int(self._pos[a]))

    def _sample_special(self, tokens: np.ndarray, logits: np.ndarray, row_sids: np.ndarray,
                        sample_rows: np.ndarray, out_rows: np.ndarray) -> None:
        """Overwrite the argmax of every sampling row whose sequence has its own sampler."""
        samplers = self._samplers
        sids = row_sids.tolist()
        for j, r in enumerate(sample_rows.tolist()):
            sampler = samplers.get(sids[r])
            if sampler is None:
                continue
            batch_row = int(out_rows[j])
            if sampler.chain is None:  # greedy that never ends on its own
                row = logits[j].copy()
                row[self._eog_ids] = -np.inf
                tokens[j] = int(row.argmax())
            else:
                tokens[j] = sampler.sample(self._ctx, batch_row, int(self._pos[batch_row]) + 1)

    def logits_of_batch_row(self, batch_row: int) -> np.ndarray:
        """Copy of the logits of one flagged entry of the last decode (`llama_get_logits_ith`)."""
        self._require_open()
        ptr = _ll.llama_get_logits_ith(self._ctx, batch_row)
        if not ptr:
            raise ValueError(f"batch row {batch_row} has no logits in the last decode")
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy()

    # ------------------------------------------------------------------ direct rows
    def run_rows(self, rows: Iterable[tuple[str, _Seq[int], int, bool]],
                 sampling: dict[str, object] | None = None) -> dict[str, int]:
        """Decode explicit rows (sequence id, tokens, start position, sample_last) in one call.

        Returns the raw sampled token of every sampling row by sequence id (end-of-generation
        tokens as they are). `sampling` gives the `Sequence.sampling` of sequences that have no
        llama sequence id yet (default greedy). Used by `generate_alone` and calibration; plans
        go through `execute`.
        """
        self._require_open()
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
        if n > self.n_batch:
            raise ValueError(f"{n} tokens exceed the batch size {self.n_batch}")
        starts = [int(r[2]) for r in rows]
        resolved = {i: self._resolve(v) for i, v in (sampling or {}).items()
                    if i not in self._slot}
        row_sids = self._assign_slots(ids, starts, resolved)
        self._tok[:n] = np.concatenate(arrays)
        self._pos[:n] = np.concatenate(
            [np.arange(s, s + len(a), dtype=np.int32) for s, a in zip(starts, arrays)]
        )
        sample_rows = np.array([i for i, r in enumerate(rows) if r[3]], dtype=np.int64)
        try:
            tokens = self._decode(n, row_sids, offsets, sample_rows)
        except RuntimeError:
            self._undo(ids, row_sids, starts)
            raise
        for sid, start, a in zip(row_sids.tolist(), starts, arrays):
            self._next_pos[sid] = start + len(a)
        return {ids[i]: int(t) for i, t in zip(sample_rows.tolist(), tokens.tolist())}

    def generate_alone(self, prompt: _Seq[int], max_tokens: int,
                       sampling: object = None) -> list[int]:
        """Tokens of `prompt` run as the only sequence: the reference for equality tests
        (greedy, or with `sampling` as a `Sequence.sampling`).

        Stops after `max_tokens` tokens or at the first end-of-generation token (included).
        Uses a free llama sequence id and releases it afterwards.
        """
        max_tokens = _check_int("max_tokens", max_tokens, 1)
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError("prompt must contain at least one token")
        if any(t < 0 or t >= self.n_vocab for t in prompt):
            raise ValueError(f"prompt tokens must be in [0, {self.n_vocab})")
        if not self._free:
            raise RuntimeError("no free llama sequence id for an alone run")
        key = object().__repr__()  # a key no scheduler sequence can have
        try:
            pos = 0
            token = -1
            while pos < len(prompt):
                chunk = prompt[pos : pos + self.n_batch]
                last = pos + len(chunk) == len(prompt)
                token = self.run_rows([(key, chunk, pos, last)],
                                      {key: sampling} if pos == 0 else None).get(key, -1)
                pos += len(chunk)
            generated = [token]
            while len(generated) < max_tokens and not self._eog[token]:
                token = self.run_rows([(key, [token], pos, True)])[key]
                pos += 1
                generated.append(token)
            return generated
        finally:
            self.release(key)
