"""A bare llama.cpp context for timing `llama_decode` alone: no scheduler, no server.

CPU only, f32 KV, flash attention off, a KV stream per sequence (`kv_unified` off): the layout
`serve` uses by default on the CPU. Tokens are a fixed function of the position and the
sequence, so every run decodes the same batch.
"""
from __future__ import annotations

import time
from typing import Sequence


class LlamaContext:
    """`model` loaded on the CPU with `n_seq` sequences over `n_ctx` cells, and a batch of 512."""

    def __init__(self, model: str, threads: int, n_seq: int, n_ctx: int, name: str) -> None:
        import llama_cpp as ll

        from skippy_scheduler.hosts.llama.backend import init_backend

        self.ll, self.name = ll, name
        init_backend()  # the package's log sink: llama.cpp's INFO lines are dropped
        mparams = ll.llama_model_default_params()
        mparams.n_gpu_layers = 0
        self.model = ll.llama_model_load_from_file(model.encode(), mparams)
        if not self.model:
            raise SystemExit(f"{name}: llama.cpp could not load {model}")
        cparams = ll.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = cparams.n_ubatch = 512
        cparams.n_seq_max = n_seq
        cparams.n_threads = cparams.n_threads_batch = threads
        cparams.type_k = cparams.type_v = 0  # f32
        cparams.flash_attn_type = 0
        cparams.kv_unified = False
        self.ctx = ll.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            ll.llama_model_free(self.model)
            raise SystemExit(f"{name}: llama.cpp could not create the context")
        self.batch = ll.llama_batch_init(512, 0, 1)
        self.n_vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(self.model))

    def decode(self, items: Sequence[tuple[int, int, int]]) -> float:
        """One llama_decode of (sequence, first position, tokens) items; its seconds."""
        b, n = self.batch, 0
        for seq, pos, count in items:
            for j in range(count):
                b.token[n] = 3 + ((pos + j) * 7919 + seq) % (self.n_vocab - 3)
                b.pos[n] = pos + j
                b.n_seq_id[n] = 1
                b.seq_id[n][0] = seq
                b.logits[n] = j == count - 1
                n += 1
        b.n_tokens = n
        t = time.perf_counter()
        rc = self.ll.llama_decode(self.ctx, b)
        elapsed = time.perf_counter() - t
        if rc != 0:
            raise SystemExit(f"{self.name}: llama_decode returned {rc}")
        return elapsed

    def clear(self, seq: int, start: int = -1) -> None:
        """Drop `seq`'s cells from position `start` on (-1: all of them)."""
        self.ll.llama_memory_seq_rm(self.ll.llama_get_memory(self.ctx), seq, start, -1)

    def close(self) -> None:
        self.ll.llama_batch_free(self.batch)
        self.ll.llama_free(self.ctx)
        self.ll.llama_model_free(self.model)
