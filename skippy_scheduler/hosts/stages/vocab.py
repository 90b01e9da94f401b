"""The driver's vocabulary: a vocabulary-only load of a model file (stage 0 or the source).

The driver tokenizes prompts and checks token ids without loading any weights; the verbs are
the llama host's `Tokenizer`.
"""
from __future__ import annotations

from typing import Any, Optional

from ..llama.tokenizer import Tokenizer


class Vocabulary(Tokenizer):
    """A `Tokenizer` over a vocabulary-only model that it owns (`close` frees it)."""

    def __init__(self, path: str) -> None:
        import llama_cpp as ll

        from ..llama.backend import init_backend, recent_log

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


class VocabularyVerbs:
    """The vocabulary verbs of a host whose `_vocab` is a `Vocabulary` (a vocabulary-only
    model: safe from any thread while the engine runs plans)."""

    _vocab: Any

    def tokenize(self, text: str, *, add_bos: Optional[bool] = None,
                 special: bool = False) -> list[int]:
        return list(self._vocab.tokenize(text, add_bos=add_bos, special=special))

    def is_eog(self, token: int) -> bool:
        return bool(self._vocab.is_eog(token))

    def token_bytes(self, token: int, *, special: bool = False) -> bytes:
        return bytes(self._vocab.token_bytes(token, special=special))

    def chat_template(self) -> Optional[str]:
        template: Optional[str] = self._vocab.chat_template()
        return template
