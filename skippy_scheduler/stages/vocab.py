"""The driver's vocabulary: a vocabulary-only load of a model file (stage 0 or the source).

The driver tokenizes prompts and checks token ids without loading any weights; the verbs are
the llama host's `Tokenizer`.
"""
from __future__ import annotations

from typing import Any

from ..hosts.llama.tokenizer import Tokenizer


class Vocabulary(Tokenizer):
    """A `Tokenizer` over a vocabulary-only model that it owns (`close` frees it)."""

    def __init__(self, path: str) -> None:
        import llama_cpp as ll

        from ..hosts.llama.backend import init_backend, recent_log

        init_backend()
        self._ll: Any = ll
        mparams = ll.llama_model_default_params()
        mparams.vocab_only = True
        model = ll.llama_model_load_from_file(path.encode(), mparams)
        if not model:
            raise RuntimeError(f"llama.cpp could not read the vocabulary of {path}: "
                               f"{recent_log()}")
        super().__init__(model)

    @property
    def vocab(self) -> Any:
        """The llama.cpp vocabulary handle (a grammar sampler needs it)."""
        return self._vocab

    def close(self) -> None:
        if self._model:
            self._ll.llama_model_free(self._model)
            self._model = None
