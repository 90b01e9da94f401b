"""The driver's vocabulary: a vocabulary-only load of a model file (stage 0 or the source).

The driver tokenizes prompts and checks token ids without loading any weights.
"""
from __future__ import annotations

from typing import Any


class Vocabulary:
    """A vocabulary-only load of a model file: tokenizing and end-of-generation ids."""

    def __init__(self, path: str) -> None:
        import llama_cpp as ll

        from ..hosts.llama import _init_backend, recent_log

        _init_backend()
        self._ll = ll
        mparams = ll.llama_model_default_params()
        mparams.vocab_only = True
        self._model = ll.llama_model_load_from_file(path.encode(), mparams)
        if not self._model:
            raise RuntimeError(f"llama.cpp could not read the vocabulary of {path}: "
                               f"{recent_log()}")
        self._v = ll.llama_model_get_vocab(self._model)
        self.n_vocab = int(ll.llama_vocab_n_tokens(self._v))

    def tokenize(self, text: str) -> list[int]:
        ll = self._ll
        data = text.encode("utf-8")
        cap = len(data) + 8
        buf = (ll.llama_token * cap)()
        add_bos = bool(ll.llama_vocab_get_add_bos(self._v))
        n = ll.llama_tokenize(self._v, data, len(data), buf, cap, add_bos, False)
        return list(buf[:max(n, 0)])

    def is_eog(self, token: int) -> bool:
        return 0 <= token < self.n_vocab and bool(self._ll.llama_vocab_is_eog(self._v, token))

    def close(self) -> None:
        if self._model:
            self._ll.llama_model_free(self._model)
            self._model = None
