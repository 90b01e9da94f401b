"""A Hugging Face model folder from a GGUF's tokenizer, checked against llama.cpp's tokenizer.

Dynamo's frontend tokenizes prompts itself (it hands a backend token ids) and refuses a `.gguf`
path: it needs a folder with `tokenizer.json`, `tokenizer_config.json` (the chat template, the
BOS/EOS tokens) and `config.json`. `export_folder` writes that folder from the GGUF's metadata
(`tokenizer.ggml.*`), then `check_folder` tokenizes a built-in test set with both llama.cpp
(`llama_cpp.Llama(vocab_only=True)`) and the written `tokenizer.json` (the `tokenizers`
library, the one Dynamo's frontend runs) and reports how many strings came out equal. A folder
whose tokens differ from llama.cpp's on any test string is refused (`ExportMismatch`): its
prefixes would never match the ones cached by traffic tokenized by llama.cpp.

What converts:

* ``tokenizer.ggml.model = "llama"`` (SentencePiece BPE with byte fallback, as LLaMA 1/2,
  Mistral, TinyLlama): a byte-fallback BPE whose merges are ranked by the merged piece's score
  (llama.cpp merges the highest-scoring pair first), a ``▁`` prefixed to every piece of text
  (llama.cpp's `add_space_prefix`, after each special token as well) and spaces as ``▁``.
* ``tokenizer.ggml.model = "gpt2"`` (byte-level BPE) with the pre-tokenizers of
  `PRE_TOKENIZERS` (Llama 3, Qwen2, GPT-2): the GGUF's merges, llama.cpp's split regex, and
  Llama 3's `ignore_merges` (a word that is a token is that token).

Anything else is refused before anything is written (`UnsupportedTokenizer`): give Dynamo the
model's own Hugging Face folder instead.

Control, user-defined and unknown tokens become added tokens (matched in the text, as
llama.cpp's `parse_special` does), by the attributes llama.cpp gives them when it loads the file
(`llama_vocab_get_attr`), not by the GGUF's token types alone: llama.cpp makes "control-looking"
tokens (``</s>``, ``<|endoftext|>``, ``<|im_end|>``...) control tokens whatever their type, and
for some models strips the whitespace beside a special token (Phi-3: the newline after
``<|user|>``), which an added token's ``lstrip``/``rstrip`` says. The check's strings are
`TEST_STRINGS`, each added token alone and amid text, spaces and newlines, and a chat as `serve`
renders it (`check_strings`). llama.cpp strips ASCII whitespace only, a tokenizer.json any
Unicode whitespace, so a model with such tokens (Phi-3) fails the check, which says why.

The chat template is the GGUF's when llama.cpp recognises it, ChatML otherwise: the template
`skippy-scheduler serve` renders (serve/chat.py), so a chat reaches the engine as the same tokens
either way.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

# gguf's token types (gguf.TokenType), kept here so reading the GGUF is the only use of gguf.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
# llama.cpp's token attributes (llama.h, enum llama_token_attr), bits.
ATTR_UNKNOWN, ATTR_UNUSED, ATTR_NORMAL, ATTR_CONTROL = 1 << 0, 1 << 1, 1 << 2, 1 << 3
ATTR_USER_DEFINED, ATTR_BYTE, ATTR_NORMALIZED = 1 << 4, 1 << 5, 1 << 6
ATTR_LSTRIP, ATTR_RSTRIP, ATTR_SINGLE_WORD = 1 << 7, 1 << 8, 1 << 9
# A token llama.cpp matches in the text (its special tokens cache, llama-vocab.cpp).
ATTR_MATCHED = ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN
# The attribute llama.cpp's loader gives each token type before its own fix-ups.
_TYPE_ATTR = {UNKNOWN: ATTR_UNKNOWN, UNUSED: ATTR_UNUSED, NORMAL: ATTR_NORMAL,
              CONTROL: ATTR_CONTROL, USER_DEFINED: ATTR_USER_DEFINED, BYTE: ATTR_BYTE}
SPM_SPACE = "\u2581"

# llama.cpp's split regexes (src/llama-vocab.cpp) by `tokenizer.ggml.pre`, in the spelling of
# the models' own tokenizer.json; (regex, ignore_merges). None: ByteLevel's own GPT-2 regex.
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+"
           r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
          r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS: dict[str, tuple[Optional[str], bool]] = {
    "llama3": (_LLAMA3, True), "llama-v3": (_LLAMA3, True), "llama-bpe": (_LLAMA3, True),
    "falcon3": (_LLAMA3, True),
    "qwen2": (_QWEN2, False), "deepseek-r1-qwen": (_QWEN2, False),
    "gpt-2": (None, False), "gpt2": (None, False), "phi-2": (None, False),
}

# ChatML, as serve/chat.py renders it (llama.cpp's "chatml"), in Jinja.
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

# The strings both tokenizers must agree on: words, spaces, digits, code, punctuation,
# contractions, accents, CJK, emoji, control characters, chat markers.
TEST_STRINGS: tuple[str, ...] = (
    "Hello world", " Hello world", "Hello  world", "  leading spaces", "trailing spaces  ",
    "hello\nworld", "line one\n\nline three\n", "\ttab\tseparated", "\r\nwindows\r\n",
    "The quick brown fox jumps over the lazy dog.", "THE QUICK BROWN FOX",
    "3.14159 and 2718281828 and 1,000,000", "1234567890 0987654321", "a1b2c3 99bottles",
    "I'm, you're, they've, he'll, she'd, it's, we'RE, DON'T", "l'homme d'affaires",
    "def f(x):\n    return x ** 2  # square\n", "if (a && b) { c[i] = d->e; }",
    "<html><body class=\"x\">text</body></html>", "https://example.com/a?b=c&d=e#f",
    "email@example.com", "!!!???...,,,;;;", "(parenthesis) [brackets] {braces}",
    "naïve café résumé Ångström", "Grüße aus Köln", "¿Qué tal? ¡Muy bien!",
    "Привет, мир", "Γειά σου κόσμε", "你好，世界", "こんにちは世界", "안녕하세요",
    "مرحبا بالعالم", "שלום עולם", "नमस्ते दुनिया", "🙂 emoji 🚀🔥 mixed 👍🏽",
    "zero\u200bwidth", "tabs\t\tand\n\n\nnewlines", "   ", "\n", "a", "A", " ",
    "supercalifragilisticexpialidocious", "wordwordwordwordwordword",
    "<s> not really a bos", "mixed CASE and snake_case and camelCase",
    "price: $12.50 (-15%)", "x = y + z * w / v - u",
)


# A chat for the check, rendered as `serve` renders it: system, user, assistant, user turns,
# their texts with spaces and newlines at either end (where a special token's strip shows).
CHECK_CHAT: tuple[tuple[str, str], ...] = (
    ("system", "You are a helpful assistant."), ("user", "hi"),
    ("assistant", " Hello! How can I help?\n"), ("user", "\n  Write a poem\nabout the sea. "))


def token_strings(token: str) -> tuple[str, ...]:
    """The check's strings for one added token: alone, between words, with spaces, newlines
    and a tab on either side, twice in a row, at the start and the end of a text. Not beside a
    space that is not ASCII: a tokenizer.json's lstrip/rstrip strips one and llama.cpp's
    LSTRIP/RSTRIP keeps it (`_strip_note`), a difference no tokenizer.json can express, which
    docs/fleet.md states for the models it touches (Phi-3)."""
    t = token
    return (t, f"Hello{t}world", f"Hello {t} world", f"hi\n{t}\nthere", f"  {t}  ",
            f"\n\n{t}\t\n", f"{t}{t}", f"{t}\nhi {t} ", f"x{t}", f"{t}x")


def check_strings(v: GgufVocab) -> tuple[str, ...]:
    """The strings `export_folder` checks: `TEST_STRINGS`, `token_strings` of every token
    llama.cpp matches in the text (an added token of the export), and `CHECK_CHAT` as
    `skippy-scheduler serve` renders it (the model's template, or ChatML)."""
    from ..serve.chat import ChatTemplate

    out = list(TEST_STRINGS)
    for i, text in enumerate(v.tokens):
        if v.attr(i) & ATTR_MATCHED and text:
            out += token_strings(text)
    out.append(ChatTemplate(v.chat_template).render(CHECK_CHAT))
    return tuple(dict.fromkeys(out))


class UnsupportedTokenizer(ValueError):
    """The GGUF's tokenizer has no conversion here (its model or pre-tokenizer)."""


@dataclass(frozen=True)
class GgufVocab:
    """What a GGUF says about its tokenizer and shape (the fields this export reads)."""

    model: str
    pre: Optional[str]
    tokens: list[str]
    types: list[int]
    scores: list[float]
    merges: list[str]
    bos: Optional[int]
    eos: Optional[int]
    unk: Optional[int]
    pad: Optional[int]
    eot: Optional[int]
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    chat_template: Optional[str]
    architecture: str
    name: Optional[str]
    hparams: dict[str, Any] = field(default_factory=dict)
    eog: tuple[int, ...] = ()  # llama.cpp's end-of-generation tokens (`_LlamaVocab.resolve`)
    # llama.cpp's token attributes (ATTR_*), one per token (`_LlamaVocab.resolve`); empty: the
    # token types' (llama.cpp's loader's mapping, without the fix-ups it makes after it).
    attrs: tuple[int, ...] = ()

    def attr(self, token_id: int) -> int:
        if self.attrs:
            return self.attrs[token_id]
        return _TYPE_ATTR.get(self.types[token_id], 0)

    def token(self, token_id: Optional[int]) -> Optional[str]:
        if token_id is None or not 0 <= token_id < len(self.tokens):
            return None
        return self.tokens[token_id]


def read_vocab(path: str, *, reader: Any = None) -> GgufVocab:
    """The tokenizer metadata of the GGUF at `path` (the `gguf` package reads it, mapped;
    `reader`: its `hosts.offload.open_gguf` reader, if the caller has it). A file the gguf
    package cannot read is `ModelFileError` (hosts/offload.py), in one line."""
    if reader is None:
        from ..hosts.offload import open_gguf

        reader = open_gguf(path)
    fields = reader.fields

    def get(key: str, default: Any = None) -> Any:
        f = fields.get(key)
        return default if f is None else f.contents()

    arch = str(get("general.architecture", "llama"))
    model = get("tokenizer.ggml.model")
    if model is None:
        raise UnsupportedTokenizer(f"{path} has no tokenizer (tokenizer.ggml.model)")
    tokens = list(get("tokenizer.ggml.tokens", []))
    types = [int(t) for t in get("tokenizer.ggml.token_type", [NORMAL] * len(tokens))]
    scores = [float(s) for s in get("tokenizer.ggml.scores", [0.0] * len(tokens))]
    hparams = {k[len(arch) + 1:]: get(k) for k in fields if k.startswith(arch + ".")}

    def opt_int(key: str) -> Optional[int]:
        value = get(key)
        return None if value is None else int(value)

    return GgufVocab(
        model=str(model), pre=get("tokenizer.ggml.pre"), tokens=tokens, types=types,
        scores=scores, merges=list(get("tokenizer.ggml.merges", [])),
        bos=opt_int("tokenizer.ggml.bos_token_id"), eos=opt_int("tokenizer.ggml.eos_token_id"),
        unk=opt_int("tokenizer.ggml.unknown_token_id"),
        pad=opt_int("tokenizer.ggml.padding_token_id"),
        eot=opt_int("tokenizer.ggml.eot_token_id"),
        add_bos=bool(get("tokenizer.ggml.add_bos_token", model == "llama")),
        add_eos=bool(get("tokenizer.ggml.add_eos_token", False)),
        add_space_prefix=bool(get("tokenizer.ggml.add_space_prefix", model == "llama")),
        chat_template=get("tokenizer.chat_template"), architecture=arch,
        name=get("general.name"), hparams=hparams)


# -- tokenizer.json ------------------------------------------------------------------------


def _added_tokens(v: GgufVocab) -> list[dict[str, Any]]:
    """The tokens llama.cpp's `parse_special` matches in the text (control, user-defined and
    unknown ones, by llama.cpp's attributes), with the spaces it strips beside them (LSTRIP,
    RSTRIP). Control and unknown ones are "special" (llama.cpp leaves them out of decoded text;
    user-defined ones stay). Each is matched in the raw text (normalized: False) and anywhere in
    it (single_word: False): llama.cpp's tokenizer reads neither NORMALIZED nor SINGLE_WORD
    (tokenizer_st_partition), so the export does not either (were a later llama.cpp to read
    them, `token_strings` in the check would show it)."""
    out = []
    for i, text in enumerate(v.tokens):
        attr = v.attr(i)
        if attr & ATTR_MATCHED and text:
            out.append({"id": i, "content": text, "single_word": False,
                        "lstrip": bool(attr & ATTR_LSTRIP), "rstrip": bool(attr & ATTR_RSTRIP),
                        "normalized": False,
                        "special": bool(attr & (ATTR_CONTROL | ATTR_UNKNOWN))})
    return out


def _post_processor(v: GgufVocab) -> Optional[dict[str, Any]]:
    """BOS (and EOS) around a sequence when the model adds them (add_special_tokens=True)."""
    bos = v.token(v.bos) if v.add_bos else None
    eos = v.token(v.eos) if v.add_eos else None
    if bos is None and eos is None:
        return None
    single: list[dict[str, Any]] = []
    pair: list[dict[str, Any]] = []
    special: dict[str, Any] = {}
    for tok, tid in ((bos, v.bos), ):
        if tok is not None:
            single.append({"SpecialToken": {"id": tok, "type_id": 0}})
            special[tok] = {"id": tok, "ids": [tid], "tokens": [tok]}
    single.append({"Sequence": {"id": "A", "type_id": 0}})
    if eos is not None:
        single.append({"SpecialToken": {"id": eos, "type_id": 0}})
        special[eos] = {"id": eos, "ids": [v.eos], "tokens": [eos]}
    pair = single + [{"Sequence": {"id": "B", "type_id": 1}}]
    return {"type": "TemplateProcessing", "single": single, "pair": pair,
            "special_tokens": special}


def _spm_merges(v: GgufVocab) -> list[list[str]]:
    """Merges of a SentencePiece BPE vocabulary: every split of a normal piece into two pieces
    of the vocabulary, ranked by the merged piece's score, best first (llama.cpp merges the
    highest-scoring pair first; transformers' SentencePieceExtractor ranks them the same)."""
    vocab = {t: i for i, t in enumerate(v.tokens)}
    ranked: list[tuple[float, int, int, str, str]] = []
    for i, (piece, kind) in enumerate(zip(v.tokens, v.types)):
        if kind != NORMAL or len(piece) < 2:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            li, ri = vocab.get(left), vocab.get(right)
            if li is not None and ri is not None:
                ranked.append((-v.scores[i], li, ri, left, right))
    ranked.sort()
    return [[left, right] for _, _, _, left, right in ranked]


def tokenizer_json(v: GgufVocab) -> dict[str, Any]:
    """The `tokenizers` library's serialization of the GGUF's tokenizer (UnsupportedTokenizer
    where there is no conversion)."""
    vocab: dict[str, int] = {}
    for i, t in enumerate(v.tokens):
        vocab.setdefault(t, i)
    base: dict[str, Any] = {"version": "1.0", "truncation": None, "padding": None,
                            "added_tokens": _added_tokens(v),
                            "post_processor": _post_processor(v)}
    if v.model == "llama":
        normalizers: list[dict[str, Any]] = []
        if v.add_space_prefix:
            normalizers.append({"type": "Prepend", "prepend": SPM_SPACE})
        normalizers.append({"type": "Replace", "pattern": {"String": " "},
                            "content": SPM_SPACE})
        decoders: list[dict[str, Any]] = [
            {"type": "Replace", "pattern": {"String": SPM_SPACE}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"}]
        if v.add_space_prefix:
            decoders.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
        base.update(
            normalizer={"type": "Sequence", "normalizers": normalizers},
            pre_tokenizer=None,
            decoder={"type": "Sequence", "decoders": decoders},
            model={"type": "BPE", "dropout": None, "unk_token": v.token(v.unk),
                   "continuing_subword_prefix": None, "end_of_word_suffix": None,
                   "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                   "vocab": vocab, "merges": _spm_merges(v)})
        return base
    if v.model == "gpt2":
        pre = v.pre or "gpt-2"
        if pre not in PRE_TOKENIZERS:
            raise UnsupportedTokenizer(
                f"the GGUF's pre-tokenizer {pre!r} has no conversion here (known: "
                f"{', '.join(sorted(PRE_TOKENIZERS))}); give the model's own Hugging Face "
                "folder instead")
        regex, ignore_merges = PRE_TOKENIZERS[pre]
        byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                      "use_regex": regex is None}
        pre_tokenizer: dict[str, Any] = byte_level
        if regex is not None:
            pre_tokenizer = {"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated",
                 "invert": False}, byte_level]}
        merges = [m.split(" ", 1) for m in v.merges]
        base.update(
            normalizer=None, pre_tokenizer=pre_tokenizer,
            decoder={"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                     "use_regex": True},
            model={"type": "BPE", "dropout": None, "unk_token": None,
                   "continuing_subword_prefix": None, "end_of_word_suffix": None,
                   "fuse_unk": False, "byte_fallback": False, "ignore_merges": ignore_merges,
                   "vocab": vocab, "merges": merges})
        return base
    raise UnsupportedTokenizer(
        f"the GGUF's tokenizer model {v.model!r} has no conversion here (known: llama, gpt2); "
        "give the model's own Hugging Face folder instead")


# -- the other files -----------------------------------------------------------------------


def without_leading_bos(template: str) -> str:
    """`template` rendering as it did less a BOS text it writes first (Dynamo's frontend
    renders it with the model's BOS text, which its tokenizer reads as the BOS id, so a chat
    prompt would reach the worker with the BOS in front where a completion prompt has none;
    the worker puts the BOS there itself, adapter.py, and announces its blocks without it,
    routing_events.py: with this, chat and completion prompts hash alike). The output is
    captured whole and only a leading BOS is cut, so a template that writes the BOS again
    for later turns keeps those (as llama.cpp renders them for `serve`). Slicing only: no
    string method a template engine may lack."""
    return ("{%- set skippy_rendered %}" + template + "{% endset %}"
            "{%- if bos_token and skippy_rendered[:bos_token|length] == bos_token -%}"
            "{{ skippy_rendered[bos_token|length:] }}"
            "{%- else -%}{{ skippy_rendered }}{%- endif -%}")


def chat_template_of(v: GgufVocab) -> tuple[str, str]:
    """(template, source): the GGUF's template when llama.cpp recognises it ("model"), else
    ChatML ("chatml"), as `skippy-scheduler serve` decides (serve/chat.py); a template that
    writes `bos_token` renders without a leading one (`without_leading_bos`)."""
    from ..serve.chat import ChatTemplate

    if v.chat_template and ChatTemplate(v.chat_template).source == "model":
        template = v.chat_template
        if "bos_token" in template:
            template = without_leading_bos(template)
        return template, "model"
    return CHATML_TEMPLATE, "chatml"


def tokenizer_config(v: GgufVocab, chat_template: str, max_length: int) -> dict[str, Any]:
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length,
        "add_bos_token": v.add_bos, "add_eos_token": v.add_eos,
        "clean_up_tokenization_spaces": False, "chat_template": chat_template}
    for key, tid in (("bos_token", v.bos), ("eos_token", v.eot if v.eot is not None else v.eos),
                     ("unk_token", v.unk), ("pad_token", v.pad)):
        text = v.token(tid)
        if text is not None:
            config[key] = text
    return config


def eog_ids(v: GgufVocab) -> list[int]:
    """The end-of-generation ids: EOT's and EOS's first, then llama.cpp's other EOG tokens."""
    return list(dict.fromkeys([t for t in (v.eot, v.eos) if t is not None] + list(v.eog)))


def _eos_field(v: GgufVocab) -> Any:
    """transformers' eos_token_id: one id, or a list of them (None when there is none)."""
    eog = eog_ids(v)
    return eog if len(eog) > 1 else (eog[0] if eog else None)


def model_config(v: GgufVocab, max_length: int) -> dict[str, Any]:
    """config.json: what Dynamo's model card reads (context length, vocabulary, special ids)
    and the shape, in transformers' names."""
    h = v.hparams
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM" if v.architecture == "llama"
                          else f"{v.architecture.capitalize()}ForCausalLM"],
        "model_type": v.architecture, "vocab_size": len(v.tokens),
        "max_position_embeddings": max_length, "bos_token_id": v.bos,
        "eos_token_id": _eos_field(v),
        "torch_dtype": "float16", "skippy_gguf_name": v.name}
    for ours, theirs in (("embedding_length", "hidden_size"),
                         ("block_count", "num_hidden_layers"),
                         ("attention.head_count", "num_attention_heads"),
                         ("attention.head_count_kv", "num_key_value_heads"),
                         ("feed_forward_length", "intermediate_size"),
                         ("attention.layer_norm_rms_epsilon", "rms_norm_eps"),
                         ("rope.freq_base", "rope_theta")):
        if ours in h and not isinstance(h[ours], list):
            config[theirs] = h[ours]
    return config


# -- writing and checking --------------------------------------------------------------------


@dataclass(frozen=True)
class CheckResult:
    """How the written tokenizer compared with llama.cpp's on the test strings."""

    matched: int
    total: int
    mismatches: tuple[tuple[str, list[int], list[int]], ...]  # (text, llama.cpp, exported)
    bos_matched: bool  # add_special_tokens=True adds BOS exactly when llama.cpp does

    @property
    def ok(self) -> bool:
        return self.matched == self.total and self.bos_matched

    def line(self) -> str:
        return (f"{self.matched}/{self.total} test strings tokenize as llama.cpp does"
                + ("" if self.bos_matched else "; BOS differs"))


class ExportMismatch(ValueError):
    """The written tokenizer does not tokenize as llama.cpp does (`result` says where; `note`,
    why, where it is known)."""

    def __init__(self, result: CheckResult, note: str = "") -> None:
        self.result = result
        self.note = note
        worst = "; ".join(f"{text!r}: llama.cpp {a[:12]} exported {b[:12]}"
                          for text, a, b in result.mismatches[:3])
        super().__init__(f"the exported tokenizer differs from llama.cpp's: {result.line()}"
                         + (f" (first: {worst})" if worst else "") + (f". {note}" if note else ""))


def _strip_note(v: GgufVocab, result: CheckResult) -> str:
    """Why `result` differs, where the cause is one no tokenizer.json can express: llama.cpp
    strips ASCII whitespace beside the tokens it marks LSTRIP/RSTRIP (isspace), a tokenizer's
    lstrip/rstrip every Unicode whitespace (a no-break or ideographic space too)."""
    strip = [text for i, text in enumerate(v.tokens)
             if text and v.attr(i) & ATTR_MATCHED and v.attr(i) & (ATTR_LSTRIP | ATTR_RSTRIP)]
    found = [t for t in strip
             if any(t in text and any(c.isspace() and ord(c) > 127 for c in text)
                    for text, _, _ in result.mismatches)]
    if not found:
        return ""
    return (f"llama.cpp strips only ASCII whitespace beside {len(strip)} special tokens "
            f"(e.g. {', '.join(map(repr, found[:3]))}), a tokenizer.json's lstrip/rstrip any "
            "Unicode whitespace: no tokenizer.json tokenizes this model as llama.cpp does "
            "(export-hf-tokenizer --no-check writes it anyway)")


@dataclass(frozen=True)
class Exported:
    folder: str
    files: tuple[str, ...]
    chat_template_source: str  # "model" or "chatml"
    check: CheckResult


class _LlamaVocab:
    """llama.cpp's tokenizer of a GGUF, vocabulary only."""

    def __init__(self, path: str) -> None:
        import llama_cpp

        from ..hosts.llama.backend import init_backend

        init_backend()  # llama.cpp's log to the package's sink (not stderr), as every load
        self._llama = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)

    def resolve(self, v: GgufVocab) -> GgufVocab:
        """`v` with the special tokens and BOS/EOS rules llama.cpp derives (its defaults per
        tokenizer type fill what the GGUF leaves out), and its end-of-generation tokens."""
        import dataclasses

        import llama_cpp

        m = self._llama._model
        vocab = llama_cpp.llama_model_get_vocab(m.model)
        n = int(llama_cpp.llama_vocab_n_tokens(vocab))

        def tid(value: int) -> Optional[int]:
            return int(value) if 0 <= value < n else None

        eog = tuple(t for t in range(n) if llama_cpp.llama_vocab_is_eog(vocab, t))
        # The attributes llama.cpp works out when it loads the vocabulary (llama-vocab.cpp:
        # the GGUF's token types, then its fix-ups by token text and model name).
        attrs = tuple(int(llama_cpp.llama_vocab_get_attr(vocab, t)) for t in range(n))
        if n != len(v.tokens):
            raise UnsupportedTokenizer(
                f"llama.cpp reads {n} tokens where the GGUF lists {len(v.tokens)}")
        return dataclasses.replace(
            v, add_bos=bool(m.add_bos_token()), add_eos=bool(m.add_eos_token()),
            bos=tid(m.token_bos()), eos=tid(m.token_eos()), eot=tid(m.token_eot()), eog=eog,
            attrs=attrs)

    def tokenize(self, text: str, add_bos: bool) -> list[int]:
        return list(self._llama.tokenize(text.encode("utf-8"), add_bos=add_bos, special=True))

    def close(self) -> None:
        close = getattr(self._llama, "close", None)
        if close is not None:
            close()


def check_folder(gguf_path: str, folder: str,
                 strings: Optional[Sequence[str]] = None) -> CheckResult:
    """Tokenize `strings` (None: `check_strings` of the GGUF, the export's own check) with
    llama.cpp (special tokens parsed, no BOS) and with the folder's tokenizer.json (no special
    tokens added), and count the equal ones; then whether BOS is added by both or neither
    (llama.cpp's add_bos against add_special_tokens=True)."""
    llama = _LlamaVocab(gguf_path)
    try:
        if strings is None:
            strings = check_strings(llama.resolve(read_vocab(gguf_path)))
        return _check(llama, folder, strings)
    finally:
        llama.close()


def _check(llama: _LlamaVocab, folder: str, strings: Sequence[str]) -> CheckResult:
    from tokenizers import Tokenizer

    exported = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    mismatches = []
    for text in strings:
        ours = llama.tokenize(text, add_bos=False)
        theirs = list(exported.encode(text, add_special_tokens=False).ids)
        if ours != theirs:
            mismatches.append((text, ours, theirs))
    probe = "Hello world"
    bos_ok = (llama.tokenize(probe, add_bos=True)
              == list(exported.encode(probe, add_special_tokens=True).ids))
    return CheckResult(matched=len(strings) - len(mismatches), total=len(strings),
                       mismatches=tuple(mismatches), bos_matched=bos_ok)


FILES = ("tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json")


def export_folder(gguf_path: str, folder: str, *, max_length: Optional[int] = None,
                  check: bool = True) -> Exported:
    """Write the Hugging Face folder of `gguf_path` into `folder` (made if missing) and check
    it against llama.cpp; ExportMismatch (the files stay, for a look) where they differ,
    UnsupportedTokenizer before anything is written where there is no conversion.
    ModelFileError (hosts/offload.py) before anything is written for a file that is not a whole
    GGUF model (truncated, damaged, of an unknown version, or one stage of a split model): the
    check `run` and `serve` make of their model."""
    from ..hosts.offload import footprint_from_gguf, open_gguf

    reader = open_gguf(gguf_path)
    footprint_from_gguf(gguf_path, allow_stage=False, reader=reader)
    v = read_vocab(gguf_path, reader=reader)
    del reader  # its memory map, before llama.cpp opens the file
    tokenizer_json(v)  # UnsupportedTokenizer before llama.cpp loads anything
    llama = _LlamaVocab(gguf_path)
    try:
        return _export(llama, llama.resolve(v), gguf_path, folder, max_length, check)
    finally:
        llama.close()


def _export(llama: _LlamaVocab, v: GgufVocab, gguf_path: str, folder: str,
            max_length: Optional[int], check: bool) -> Exported:
    tok = tokenizer_json(v)
    if max_length is None:
        max_length = int(v.hparams.get("context_length") or 4096)
    template, source = chat_template_of(v)
    os.makedirs(folder, exist_ok=True)
    contents: dict[str, Any] = {
        "tokenizer.json": tok,
        "tokenizer_config.json": tokenizer_config(v, template, max_length),
        "config.json": model_config(v, max_length),
        "generation_config.json": {"bos_token_id": v.bos, "eos_token_id": _eos_field(v)},
    }
    for name, obj in contents.items():
        tmp = os.path.join(folder, f".{name}.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(obj, f, ensure_ascii=False, indent=1 if name != "tokenizer.json" else None)
            f.write("\n")
        os.replace(tmp, os.path.join(folder, name))
    result = (_check(llama, folder, check_strings(v)) if check
              else CheckResult(0, 0, (), bos_matched=True))
    if check and not result.ok:
        raise ExportMismatch(result, _strip_note(v, result))
    return Exported(folder=folder, files=FILES, chat_template_source=source, check=result)
