"""The model's vocabulary: tokenizing, token bytes, end-of-generation ids, the chat template.

Reads only the model (never the context), so every verb is safe from any thread while the
context decodes on another.
"""
from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import numpy.typing as npt

import llama_cpp as _ll


class Tokenizer:
    """The vocabulary of one loaded llama.cpp model."""

    def __init__(self, model: Any) -> None:
        self._model = model
        self._vocab = _ll.llama_model_get_vocab(model)
        self.n_vocab = int(_ll.llama_vocab_n_tokens(self._vocab))
        # One vocabulary scan up front so that sampling never calls back per token.
        self.eog: npt.NDArray[np.bool_] = np.fromiter(
            (bool(_ll.llama_vocab_is_eog(self._vocab, t)) for t in range(self.n_vocab)),
            dtype=bool, count=self.n_vocab)
        self.eog_ids: npt.NDArray[np.int32] = np.flatnonzero(self.eog).astype(np.int32)

    def is_eog(self, token: int) -> bool:
        return 0 <= token < self.n_vocab and bool(self.eog[token])

    def tokenize(self, text: str, *, add_bos: bool | None = None,
                 special: bool = False) -> list[int]:
        """Tokenize with the model's tokenizer; BOS is added when the model asks for it.
        `special` parses control-token text (a chat template's markers) as those tokens."""
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
        tokens are empty unless `special`."""
        buf = ctypes.create_string_buffer(64)
        n = _ll.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = _ll.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
        return bytes(buf.raw[:n])

    def chat_template(self) -> str | None:
        """The model's default chat template (GGUF `tokenizer.chat_template`), if it has one."""
        raw = _ll.llama_model_chat_template(self._model, None)
        return raw.decode("utf-8", "replace") if raw else None
