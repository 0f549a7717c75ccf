"""tokenizer.py: the byte tokenizer, Hugging Face tokenizers from a folder, the small BPE tokenizer,
and the old names data.py and generate.py still export (CPU only, no XLA)."""
import subprocess
import sys

import pytest
from transformers import LlamaConfig

from llama_xla_helpers import tokenizer
from llama_xla_helpers.configs import get_config
from llama_xla_helpers.data import load_corpus
from llama_xla_helpers.generate import llama3_chat
from llama_xla_helpers.tokenizer import (ByteTokenizer, check_vocab, get_tokenizer, padded_vocab_size, small_tokenizer,
                                         tokenizer_and_config)

pytestmark = pytest.mark.fixed_dtype  # no test here reads the default dtype (conftest checks)


@pytest.fixture(scope="module")
def tok():
    return small_tokenizer()


def test_old_names_are_the_tokenizer_module_s():
    from llama_xla_helpers import data, generate
    moved = ("ByteTokenizer", "get_tokenizer", "small_tokenizer", "tokenizer_and_config", "check_vocab",
             "padded_vocab_size", "special_ids", "tokenizer_size", "tokenizer_sha", "corpus_documents",
             "TOKENIZER_FILES", "VOCAB_MULTIPLE", "SPECIAL_TOKENS", "CHAT_TEMPLATE")
    for name in moved:
        assert getattr(data, name) is getattr(tokenizer, name), name
    assert generate.load_tokenizer is tokenizer.load_tokenizer and generate.ByteTokenizer is tokenizer.ByteTokenizer
    for module in (data, generate):  # moved, not copied: neither defines a tokenizer of its own
        assert all(getattr(module, n).__module__ == tokenizer.__name__
                   for n in (*moved, "load_tokenizer") if callable(getattr(module, n, None))), module


def test_the_tokenizer_module_imports_neither_data_nor_generate():
    code = "import sys, llama_xla_helpers.tokenizer; print(' '.join(sorted(sys.modules)))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert "llama_xla_helpers.tokenizer" in loaded
    assert "llama_xla_helpers.data" not in loaded and "llama_xla_helpers.generate" not in loaded


def test_small_tokenizer_is_deterministic_and_writes_llama3_chat(tok, tmp_path):
    again = small_tokenizer(path=tmp_path / "tok")
    assert len(tok) == 512 and tok.get_vocab() == again.get_vocab()
    assert tok.backend_tokenizer.to_str() == again.backend_tokenizer.to_str()
    assert tokenizer.tokenizer_sha(tok) == tokenizer.tokenizer_sha(again)
    loaded = get_tokenizer(tmp_path / "tok")  # save_pretrained, then AutoTokenizer from the folder
    text = load_corpus()[:2000]
    assert loaded.encode(text) == tok.encode(text) and tok.encode(text)[0] == tok.bos_token_id
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text  # byte-level: any text round-trips
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|begin_of_text|>", "<|eot_id|>", "<|pad|>")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " What is a list? "}]
    for t in (tok, loaded):
        assert t.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == llama3_chat(messages)
    assert get_tokenizer(None).__class__ is ByteTokenizer
    with pytest.raises(FileNotFoundError, match="is not a folder"):
        get_tokenizer(tmp_path / "nothing")


def test_padded_vocab_size_rounds_up_to_a_multiple_of_64():
    assert [padded_vocab_size(n) for n in (1, 64, 65, 258, 512, 32000, 128256)] == [64, 64, 128, 320, 512, 32000,
                                                                                      128256]


def test_a_tokenizer_longer_than_the_model_vocab_is_an_error(tok):
    with pytest.raises(ValueError, match=r"the tokenizer has 512 tokens but the model's vocab_size is 264: .*"
                                         r"padded_vocab_size\(512\) = 512"):
        check_vocab(tok, 264)
    tiny = get_config("tiny")
    with pytest.raises(ValueError, match="has 512 tokens but the model's vocab_size is 264"):
        tokenizer_and_config(tiny, tok, pretrained=True)  # fine-tuning tiny with it: an error
    _, sized = tokenizer_and_config(tiny, tok)  # from random init: the model is sized for the tokenizer
    assert (sized.vocab_size, sized.bos_token_id, sized.eos_token_id, sized.pad_token_id) == (
        512, tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)
    assert tiny.vocab_size == 264 and sized.hidden_size == tiny.hidden_size  # a copy; the rest is tiny's
    byte, same = tokenizer_and_config(tiny, None, pretrained=True)  # tiny is a byte-level model
    assert isinstance(byte, ByteTokenizer) and same is tiny
    with pytest.raises(ValueError, match="not trained with the byte tokenizer.*pass the model's own tokenizer"):
        tokenizer_and_config(get_config("llama3-8b"), None, pretrained=True)
    with pytest.raises(ValueError, match="has 258 tokens but the model's vocab_size is 200"):
        tokenizer_and_config(LlamaConfig(vocab_size=200), None)
