"""`export-hf-tokenizer`: the Hugging Face folder written from a GGUF tokenizes as llama.cpp does,
or the command refuses with the counts."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("llama_cpp")
pytest.importorskip("gguf")
pytest.importorskip("tokenizers")

from skippy_scheduler.cli import main  # noqa: E402
from skippy_scheduler.dynamo import hf_export  # noqa: E402
from skippy_scheduler.hosts.tiny_model import write_tiny_llama  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny.gguf")


def test_tiny_model_exports_and_matches_llama_cpp(tiny, tmp_path, capsys):
    folder = tmp_path / "hf"
    assert main(["export-hf-tokenizer", str(tiny), str(folder)]) == 0
    out = capsys.readouterr().out
    # TEST_STRINGS, each of <unk> <s> </s> amid text, spaces and newlines, a ChatML chat.
    total = len(hf_export.TEST_STRINGS) + 3 * len(hf_export.token_strings("<s>")) + 1
    assert f"{total}/{total} test strings tokenize as llama.cpp does" in out
    assert sorted(p.name for p in folder.iterdir()) == sorted(hf_export.FILES)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    # The tiny model has no chat template: serve renders ChatML, so the folder carries it.
    assert config["chat_template"] == hf_export.CHATML_TEMPLATE
    assert (config["bos_token"], config["eos_token"], config["add_bos_token"]) == (
        "<s>", "</s>", True)
    model = json.loads((folder / "config.json").read_text())
    assert (model["vocab_size"], model["max_position_embeddings"]) == (384, 512)
    assert model["eos_token_id"] == 2 and model["bos_token_id"] == 1


def test_exported_tokenizer_adds_bos_as_llama_cpp(tiny, tmp_path):
    from tokenizers import Tokenizer

    import llama_cpp

    hf_export.export_folder(str(tiny), str(tmp_path))
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    llama = llama_cpp.Llama(model_path=str(tiny), vocab_only=True, verbose=False)
    text = "<s> the weather\nis fine"  # a control token's text is that token in both
    assert tok.encode(text).ids == llama.tokenize(text.encode(), add_bos=True, special=True)
    assert tok.decode(tok.encode("hello there").ids) == "hello there"


def test_mismatch_is_refused_with_the_counts(tiny, tmp_path, monkeypatch, capsys):
    # Without merges the BPE spells every word out in single characters: llama.cpp does not.
    monkeypatch.setattr(hf_export, "_spm_merges", lambda v: [])
    assert main(["export-hf-tokenizer", str(tiny), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert "differs from llama.cpp's" in err
    assert f"/{len(hf_export.TEST_STRINGS) + 3 * 10 + 1} test strings" in err


def test_unknown_tokenizer_model_is_refused_before_writing(tmp_path):
    vocab = hf_export.GgufVocab(
        model="bert", pre=None, tokens=["a"], types=[1], scores=[0.0], merges=[], bos=None,
        eos=None, unk=None, pad=None, eot=None, add_bos=False, add_eos=False,
        add_space_prefix=False, chat_template=None, architecture="bert", name=None)
    with pytest.raises(hf_export.UnsupportedTokenizer, match="'bert'"):
        hf_export.tokenizer_json(vocab)
    gpt2 = hf_export.GgufVocab(**{**vars(vocab), "model": "gpt2", "pre": "starcoder"})
    with pytest.raises(hf_export.UnsupportedTokenizer, match="'starcoder'"):
        hf_export.tokenizer_json(gpt2)


def test_not_a_gguf_is_a_usage_error(tmp_path, capsys):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"nope")
    assert main(["export-hf-tokenizer", str(bad), str(tmp_path / "hf")]) == 2
    assert "not a GGUF" in capsys.readouterr().err


def test_a_template_that_writes_the_bos_renders_without_a_leading_one(tiny):
    """Dynamo's frontend renders the exported template with the model's BOS text; the worker
    puts the BOS in front itself and announces blocks without it, so the exported template
    writes no leading BOS (a chat prompt's ids hash as a completion's do), and keeps one it
    writes again for a later turn."""
    import dataclasses

    jinja2 = pytest.importorskip("jinja2")

    llama2 = ("{% for message in messages %}{% if message['role'] == 'user' %}"
              "{{ bos_token + '[INST] ' + message['content'] + ' [/INST]' }}{% else %}"
              "{{ message['content'] + eos_token }}{% endif %}{% endfor %}")
    llama3 = ("{{- bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + "
              "message['role'] + '<|end_header_id|>' + message['content'] + '<|eot_id|>' }}"
              "{% endfor %}")
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
             {"role": "user", "content": "more"}]
    want = {llama2: "[INST] hi [/INST]yo</s><s>[INST] more [/INST]",
            llama3: "<|start_header_id|>user<|end_header_id|>hi<|eot_id|>"
                    "<|start_header_id|>assistant<|end_header_id|>yo<|eot_id|>"
                    "<|start_header_id|>user<|end_header_id|>more<|eot_id|>"}
    base = hf_export.read_vocab(str(tiny))
    for original, rendered in want.items():
        template, source = hf_export.chat_template_of(
            dataclasses.replace(base, chat_template=original))
        assert source == "model" and template != original
        env = jinja2.Environment()
        assert env.from_string(template).render(messages=turns, bos_token="<s>",
                                                eos_token="</s>") == rendered
        # No BOS text: the output is the original's.
        assert env.from_string(template).render(messages=turns, bos_token="",
                                                eos_token="</s>") == \
            env.from_string(original).render(messages=turns, bos_token="", eos_token="</s>")
    # A template without bos_token is exported as it is.
    chatml = hf_export.CHATML_TEMPLATE
    assert hf_export.chat_template_of(dataclasses.replace(base, chat_template=None))[0] == chatml
