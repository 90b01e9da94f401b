"""`export-hf-tokenizer` gives each added token the attributes llama.cpp works out when it loads
the GGUF (not only the GGUF's token types): a "control-looking" token of normal type is matched
as llama.cpp matches it (Qwen2's `</s>`), and Phi-3's special tokens strip the whitespace after
them. Its check tries every added token amid text, spaces and newlines and a rendered chat, and a
difference no tokenizer.json can express is refused, named."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("llama_cpp")
pytest.importorskip("gguf")
pytest.importorskip("tokenizers")

from skippy_scheduler.cli import main  # noqa: E402
from skippy_scheduler.dynamo import hf_export  # noqa: E402
from skippy_scheduler.hosts.tiny_model import spm_vocabulary  # noqa: E402

# Phi-3's chat template (its GGUF's), which llama.cpp recognises as "phi3".
PHI3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') %}"
    "{{'<|user|>' + '\n' + message['content'] + '<|end|>' + '\n' + '<|assistant|>' + '\n'}}"
    "{% elif (message['role'] == 'assistant') %}{{message['content'] + '<|end|>' + '\n'}}"
    "{% endif %}{% endfor %}")
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
          "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
PHI3_CHAT = "<|user|>\nhi<|end|>\n<|assistant|>\n"  # what the template renders for "hi"


def _write(path, name, tokenizer, tokens, types, *, scores=None, merges=None, pre=None,
           bos, eos, add_bos, template):
    """A vocabulary-only GGUF (as llama.cpp's models/ggml-vocab-*.gguf): LLaMA-shaped
    hyperparameters, the tokenizer, no tensors."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    try:
        writer.add_name(name)
        writer.add_context_length(512)
        writer.add_embedding_length(64)
        writer.add_block_count(2)
        writer.add_feed_forward_length(128)
        writer.add_head_count(4)
        writer.add_head_count_kv(2)
        writer.add_layer_norm_rms_eps(1e-5)
        writer.add_rope_dimension_count(16)
        writer.add_vocab_size(len(tokens))
        writer.add_tokenizer_model(tokenizer)
        if pre is not None:
            writer.add_tokenizer_pre(pre)
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        if scores is not None:
            writer.add_token_scores(scores)
        if merges is not None:
            writer.add_token_merges(merges)
        writer.add_bos_token_id(bos)
        writer.add_eos_token_id(eos)
        writer.add_add_bos_token(add_bos)
        writer.add_chat_template(template)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    return str(path)


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    """SentencePiece, named like Phi-3 (llama.cpp sets RSTRIP on its special tokens but
    <unk>, <s>, <|endoftext|>), Phi-3's chat markers as control tokens and its template."""
    from gguf import TokenType

    tokens, scores, types = spm_vocabulary(384)
    extra = ["<|endoftext|>", "<|assistant|>", "<|system|>", "<|end|>", "<|user|>"]
    tokens += extra
    scores += [0.0] * len(extra)
    types += [int(TokenType.CONTROL)] * len(extra)
    return _write(tmp_path_factory.mktemp("phi3") / "phi3.gguf", "Phi3", "llama", tokens,
                  types, scores=scores, bos=1, eos=tokens.index("<|endoftext|>"), add_bos=True,
                  template=PHI3_TEMPLATE)


def _byte_chars() -> list[str]:
    """GPT-2's byte-to-character map (byte-level BPE), in byte order."""
    keep = (list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD))
            + list(range(0xAE, 0x100)))
    out, n = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + n)
            n += 1
    return [out[b] for b in range(256)]


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    """Byte-level BPE with Qwen2's pre-tokenizer, a `</s>` of normal type (llama.cpp makes it a
    control token: it is one of its end-of-generation texts), ChatML markers."""
    from gguf import TokenType

    tokens = _byte_chars()
    merges = ["h e", "l l", "he ll", "hell o", "\u0120 w", "o r", "\u0120w or", "l d",
              "\u0120wor ld", "\u0120 h", "\u0120h i", "\u010a \u010a"]
    for m in merges:
        tokens.append(m.replace(" ", ""))
    types = [int(TokenType.NORMAL)] * len(tokens)
    for text, kind in (("</s>", TokenType.NORMAL), ("<|endoftext|>", TokenType.CONTROL),
                       ("<|im_start|>", TokenType.CONTROL), ("<|im_end|>", TokenType.CONTROL)):
        tokens.append(text)
        types.append(int(kind))
    eot = tokens.index("<|endoftext|>")
    return _write(tmp_path_factory.mktemp("qwen2") / "qwen2.gguf", "qwen2-like", "gpt2", tokens,
                  types, merges=merges, pre="qwen2", bos=eot, eos=eot, add_bos=False,
                  template=CHATML)


def _llama_ids(path, text):
    import llama_cpp

    llama = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    try:
        return llama.tokenize(text.encode(), add_bos=False, special=True)
    finally:
        llama.close()


def _exported_ids(folder, text):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    return tok.encode(text, add_special_tokens=False).ids


def _added(folder):
    tok = json.loads((folder / "tokenizer.json").read_text())
    return {t["content"]: t for t in tok["added_tokens"]}


def test_control_looking_normal_token_is_matched_as_llama_cpp_does(qwen2, tmp_path, capsys):
    folder = tmp_path / "hf"
    assert main(["export-hf-tokenizer", qwen2, str(folder)]) == 0
    out = capsys.readouterr().out
    ids = _llama_ids(qwen2, "hello</s>")
    assert ids[-1] == hf_export.read_vocab(qwen2).tokens.index("</s>")  # one token, as llama.cpp
    assert _exported_ids(folder, "hello</s>") == ids
    chat = "<|im_start|>user\nhi</s><|im_end|>\n<|im_start|>assistant\n"
    assert _exported_ids(folder, chat) == _llama_ids(qwen2, chat)
    added = _added(folder)
    assert added["</s>"]["special"] is True  # a control token: out of decoded text
    assert not any(t["lstrip"] or t["rstrip"] for t in added.values())
    total = len(_strings(qwen2))
    assert f"{total}/{total} test strings tokenize as llama.cpp does" in out


def test_phi3_special_tokens_strip_the_whitespace_after_them(phi3, tmp_path):
    folder = tmp_path / "hf"
    assert main(["export-hf-tokenizer", phi3, str(folder)]) == 0
    ids = _llama_ids(phi3, PHI3_CHAT)
    user, end, assistant = (_added(folder)[t]["id"] for t in ("<|user|>", "<|end|>",
                                                                "<|assistant|>"))
    assert ids[0] == user and ids[-2:] == [end, assistant]  # no newline tokens: stripped
    assert _exported_ids(folder, PHI3_CHAT) == ids
    for text in ("<|user|>\n  hi there <|end|>\n\n", "<s> x<|system|>\tsys<|end|>\n",
                 "<|endoftext|>  tail"):
        assert _exported_ids(folder, text) == _llama_ids(phi3, text), text
    added = _added(folder)
    assert added["<|user|>"]["rstrip"] and added["</s>"]["rstrip"]
    for kept in ("<s>", "<unk>", "<|endoftext|>"):  # llama.cpp leaves these unstripped
        assert not added[kept]["rstrip"]
    assert not any(t["lstrip"] or t["normalized"] or t["single_word"] for t in added.values())
    # check_folder's default strings are the export's, and all of them agree.
    result = hf_export.check_folder(phi3, str(folder))
    assert result.total == len(_strings(phi3)) and result.bos_matched
    assert not result.mismatches


def test_phi3_exports_and_its_one_known_difference_is_unicode_space_beside_a_token(phi3,
                                                                                  tmp_path):
    """Phi-3 exports and passes its check; what differs, as docs/fleet.md says, is only a
    non-ASCII space beside a special token (llama.cpp's strip takes ASCII whitespace only, a
    tokenizer.json's any)."""
    folder = str(tmp_path / "hf")
    hf_export.export_folder(phi3, folder)
    odd = ["<|end|>\u00a0x", "<|user|>\u3000x"]
    result = hf_export.check_folder(phi3, folder, strings=odd)
    assert len(result.mismatches) == len(odd)


def test_strip_left_out_of_the_export_fails_its_check(phi3, tmp_path, monkeypatch):
    """The check catches an export that matches the tokens but not llama.cpp's strip (what the
    export wrote before it read llama.cpp's attributes): the rendered chat and the tokens
    beside newlines differ."""
    real = hf_export._added_tokens

    def unstripped(v):
        return [{**t, "rstrip": False, "lstrip": False} for t in real(v)]

    monkeypatch.setattr(hf_export, "_added_tokens", unstripped)
    with pytest.raises(hf_export.ExportMismatch) as exc:
        hf_export.export_folder(phi3, str(tmp_path / "hf"))
    texts = [text for text, _, _ in exc.value.result.mismatches]
    assert "<|end|>\n" in "".join(texts) and any(t.startswith("<|user|>\n") for t in texts)
    assert any("\u00a0" not in t for t in texts)


def test_check_strings_try_every_added_token_and_a_rendered_chat(phi3):
    strings = _strings(phi3)
    assert set(hf_export.TEST_STRINGS) <= set(strings)
    for token in ("<unk>", "<s>", "</s>", "<|endoftext|>", "<|user|>", "<|end|>"):
        for s in (token, f"Hello{token}world", f"Hello {token} world",
                  f"hi\n{token}\nthere", f"  {token}  "):
            assert s in strings
    # The chat as `serve` renders it with the model's template (llama.cpp's "phi3").
    assert any(s.startswith("<|system|>\n") and PHI3_CHAT in s for s in strings)


def _strings(path):
    llama = hf_export._LlamaVocab(str(path))
    try:
        return hf_export.check_strings(llama.resolve(hf_export.read_vocab(str(path))))
    finally:
        llama.close()
