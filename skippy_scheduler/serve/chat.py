"""Chat messages to one prompt string, with the model's chat template.

llama.cpp's `llama_chat_apply_template` renders the template the GGUF carries
(`tokenizer.chat_template`) when it recognises it. A model without a template, or with one
llama.cpp does not recognise, is rendered as ChatML, which is also what llama.cpp's own server
falls back to:

    <|im_start|>system
    You are helpful.<|im_end|>
    <|im_start|>user
    Hi<|im_end|>
    <|im_start|>assistant

`/v1/models` reports which template is in use (`chat_template`: "model" or "chatml"), and a
template the model carries that llama.cpp does not recognise is named in a warning at startup:
its chats are ChatML, which the model may not have been trained on.

ChatML is rendered here, exactly as llama.cpp renders it; llama.cpp (`llama_cpp`, imported when
first needed) is only asked to render a template a model carries, so a host without one (a
model-free host) serves chats without llama-cpp-python.
"""
from __future__ import annotations

import ctypes
import logging
from typing import Optional, Sequence

FALLBACK = "chatml"

log = logging.getLogger(__name__)


def chatml(messages: Sequence[tuple[str, str]]) -> str:
    """`messages` as ChatML, ending with the assistant's turn opened (llama.cpp's "chatml")."""
    turns = "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in messages)
    return turns + "<|im_start|>assistant\n"


def _apply(template: bytes, messages: Sequence[tuple[str, str]]) -> Optional[str]:
    """The rendered prompt, or None when llama.cpp does not know the template."""
    import llama_cpp as _ll

    arr = (_ll.llama_chat_message * len(messages))()
    keep = []  # the byte strings must outlive the call
    for i, (role, content) in enumerate(messages):
        r, c = role.encode("utf-8"), content.encode("utf-8")
        keep += [r, c]
        arr[i].role = r
        arr[i].content = c
    size = 2 * sum(len(c) for c in keep) + 256
    for _ in range(2):
        buf = ctypes.create_string_buffer(size)
        n = _ll.llama_chat_apply_template(template, arr, len(messages), True, buf, size)
        if n < 0:
            return None
        if n <= size:
            return buf.raw[:n].decode("utf-8", "replace")
        size = n + 1
    return None  # pragma: no cover - the second buffer always fits


class ChatTemplate:
    """Renders chat messages for one model (see the module docstring)."""

    def __init__(self, model_template: Optional[str]) -> None:
        self.source = FALLBACK
        self.text: Optional[str] = None  # the model's template, when it is the one in use
        self._template: Optional[bytes] = None  # the model's, when llama.cpp knows it
        if model_template:
            raw = model_template.encode("utf-8")
            if _apply(raw, [("user", "probe")]) is not None:
                self._template = raw
                self.source = "model"
                self.text = model_template
            else:
                log.warning("the model's chat template (%d characters, starting %.60r) is not "
                            "one llama.cpp recognises: chats are rendered as ChatML",
                            len(model_template), model_template)

    def render(self, messages: Sequence[tuple[str, str]]) -> str:
        if self._template is not None:
            text = _apply(self._template, messages)
            if text is not None:
                return text
            # a recognised template refused these messages (e.g. roles): ChatML
        return chatml(messages)
