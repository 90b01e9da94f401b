"""A tiny random-weight LLaMA model in GGUF, written offline in milliseconds.

The model exists so that the llama.cpp host can be tested and demonstrated without downloading
anything: its logits are meaningless but deterministic, which is all an equality test between
batched and alone runs needs. Shapes, GGUF keys and the SPM vocabulary are the smallest set llama.cpp loads as a LLaMA model; the same
seed always gives a byte-identical file.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

# SPM word-boundary marker (U+2581).
SPM_SPACE = "\u2581"
# A few bigram pieces so that the tokenizer has merges to make beyond single characters.
_BIGRAMS = ("th", "he", "in", "er")


@dataclass(frozen=True)
class TinyModelShape:
    n_vocab: int = 384
    n_embd: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_head_kv: int = 2
    n_ff: int = 128
    context_length: int = 512
    rope_dimension: int = 16  # = n_embd / n_head, the whole head is rotated
    rms_eps: float = 1e-5
    rope_freq_base: float = 10000.0


def spm_vocabulary(n_vocab: int = 384) -> tuple[list[str], list[float], list[int]]:
    """Tokens, scores and token types of the SPM variant: 3 specials, 256 byte tokens, pieces."""
    from gguf import TokenType

    tokens = ["<unk>", "<s>", "</s>"]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [TokenType.BYTE] * 256
    pieces = [SPM_SPACE]
    pieces += [chr(c) for c in range(0x21, 0x7F)]  # printable ASCII; space is the marker
    pieces += [SPM_SPACE + chr(c) for c in range(ord("a"), ord("z") + 1)]
    pieces += list(_BIGRAMS)
    room = n_vocab - len(tokens)
    if room < len(pieces):
        raise ValueError(f"n_vocab must be at least {len(tokens) + len(pieces)}, got {n_vocab}")
    # Pad with unused filler pieces when a larger vocabulary is asked for.
    pieces += [f"<unused{i}>" for i in range(room - len(pieces))]
    tokens += pieces
    types += [TokenType.NORMAL] * len(pieces)
    # Earlier pieces win merges (SPM merges the highest-scoring pair first).
    scores = [0.0] * 259 + [-float(i) for i in range(259, n_vocab)]
    return tokens, scores, [int(t) for t in types]


def write_tiny_llama(
    path: str | os.PathLike[str],
    *,
    seed: int = 0,
    dtype: str = "f32",
    shape: TinyModelShape = TinyModelShape(),
    tie_output: bool = False,
    eos_token_id: int = 2,
) -> str:
    """Write the tiny model to `path` and return the path as a string.

    `dtype` is "f32" (exact batched-vs-alone equality) or "f16" (matrices only; norms stay f32).
    With `tie_output` the output projection is omitted and llama.cpp ties it to the embeddings.
    `eos_token_id` moves the end-of-generation token (same weights): pointing it at a token the
    model often predicts makes early stops common, which tests of EOG handling need.
    """
    import gguf

    if dtype not in ("f32", "f16"):
        raise ValueError(f"dtype must be 'f32' or 'f16', got {dtype!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    s = shape
    if isinstance(eos_token_id, bool) or not isinstance(eos_token_id, int) or not (
        0 <= eos_token_id < s.n_vocab
    ):
        raise ValueError(f"eos_token_id must be in [0, {s.n_vocab}), got {eos_token_id!r}")
    if s.n_embd % s.n_head or s.n_head % s.n_head_kv:
        raise ValueError("n_embd must divide by n_head and n_head by n_head_kv")
    head_dim = s.n_embd // s.n_head
    matrix_type = np.float32 if dtype == "f32" else np.float16
    rng = np.random.default_rng(seed)

    def matrix(rows: int, cols: int, std: float | None = None) -> np.ndarray:
        # numpy shape (ne1, ne0): rows are outputs, cols the input (fan_in).
        scale = 1.0 / np.sqrt(cols) if std is None else std
        return (rng.standard_normal((rows, cols), dtype=np.float32) * scale).astype(matrix_type)

    def norm() -> np.ndarray:
        return np.ones(s.n_embd, dtype=np.float32)

    tensors: list[tuple[str, np.ndarray]] = [("token_embd.weight", matrix(s.n_vocab, s.n_embd))]
    for i in range(s.n_layer):
        blk = f"blk.{i}"
        tensors += [
            (f"{blk}.attn_norm.weight", norm()),
            (f"{blk}.attn_q.weight", matrix(s.n_head * head_dim, s.n_embd)),
            (f"{blk}.attn_k.weight", matrix(s.n_head_kv * head_dim, s.n_embd)),
            (f"{blk}.attn_v.weight", matrix(s.n_head_kv * head_dim, s.n_embd)),
            (f"{blk}.attn_output.weight", matrix(s.n_embd, s.n_head * head_dim)),
            (f"{blk}.ffn_norm.weight", norm()),
            (f"{blk}.ffn_gate.weight", matrix(s.n_ff, s.n_embd)),
            (f"{blk}.ffn_up.weight", matrix(s.n_ff, s.n_embd)),
            (f"{blk}.ffn_down.weight", matrix(s.n_embd, s.n_ff)),
        ]
    tensors.append(("output_norm.weight", norm()))
    if not tie_output:
        # std 0.5 gives logits of std ~4: clear argmax margins, so greedy ties are rare.
        tensors.append(("output.weight", matrix(s.n_vocab, s.n_embd, 0.5)))

    tokens, scores, types = spm_vocabulary(s.n_vocab)
    path = os.fspath(path)
    writer = gguf.GGUFWriter(path, "llama")
    try:
        writer.add_name(f"skippy-tiny-llama-{dtype}-seed{seed}")
        writer.add_context_length(s.context_length)
        writer.add_embedding_length(s.n_embd)
        writer.add_block_count(s.n_layer)
        writer.add_feed_forward_length(s.n_ff)
        writer.add_head_count(s.n_head)
        writer.add_head_count_kv(s.n_head_kv)
        writer.add_layer_norm_rms_eps(s.rms_eps)
        writer.add_rope_dimension_count(s.rope_dimension)
        writer.add_rope_freq_base(s.rope_freq_base)
        writer.add_vocab_size(s.n_vocab)
        writer.add_file_type(0 if dtype == "f32" else 1)  # LLAMA_FTYPE_ALL_F32 / MOSTLY_F16
        writer.add_tokenizer_model("llama")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(eos_token_id)
        writer.add_unk_token_id(0)
        writer.add_add_bos_token(True)
        writer.add_add_eos_token(False)
        for name, data in tensors:
            writer.add_tensor(name, data)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    return path


def parameter_count(shape: TinyModelShape = TinyModelShape(), tie_output: bool = False) -> int:
    s = shape
    hd = s.n_embd // s.n_head
    per_layer = (
        2 * s.n_embd
        + 2 * s.n_head * hd * s.n_embd
        + 2 * s.n_head_kv * hd * s.n_embd
        + 3 * s.n_ff * s.n_embd
    )
    out = 0 if tie_output else s.n_vocab * s.n_embd
    return s.n_vocab * s.n_embd + s.n_layer * per_layer + s.n_embd + out
