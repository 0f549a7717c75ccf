"""Incremental text: the same text as decoding everything, with a few tokens of work per token,
for a SentencePiece-style tokenizer (which drops the space of the text's first word) and a
byte-level one (which splits characters over tokens); stop strings are cut as they complete."""
import json

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from llama_xla_helpers.data import load_corpus
from llama_xla_helpers.detokenize import CONTEXT, TextStream

TEXT = "The café's naïve déjà vu: 日本語のテキスト 🦙🦙 and  two spaces, then more words.\n\nEnd."


def sentencepiece_style():
    """Llama 2's layout: spaces as "▁", one prepended; unknown characters as <0xXX> byte tokens."""
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token=None, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.train_from_iterator([load_corpus()[:50000]], trainers.BpeTrainer(
        vocab_size=600, special_tokens=[f"<0x{b:02X}>" for b in range(256)], show_progress=False))
    spec = json.loads(tok.to_str())
    spec["model"]["byte_fallback"] = True  # training builds a new model without it
    spec["added_tokens"] = []  # the byte tokens are ordinary tokens, not special ones that decode skips
    return Tokenizer.from_str(json.dumps(spec))


def byte_level():
    """Llama 3's (GPT-2's) layout: bytes mapped to printable characters, merged."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([load_corpus()[:50000]], trainers.BpeTrainer(
        vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    return tok


@pytest.mark.parametrize("make, drops_a_space", [(sentencepiece_style, True), (byte_level, False)])
def test_streamed_text_is_what_decoding_everything_adds(make, drops_a_space):
    tok = make()
    ids = tok.encode(TEXT).ids
    windows = []

    def decode(tokens):
        windows.append(len(tokens))
        return tok.decode(tokens)

    assert decode(ids) == TEXT and any("\ufffd" in decode(ids[:k]) for k in range(len(ids)))  # split characters
    rewritten = 0
    for k in range(1, len(ids)):
        whole, before = decode(ids), decode(ids[:k])
        if before.endswith("\ufffd"):  # the prompt ends inside a character
            continue
        stream, seen = TextStream(decode, ids[:k]), []
        windows.clear()
        for t in ids[k:]:
            stream.add(t)
            seen.append(stream.text)
        stream.flush()
        assert stream.text == whole[len(before):], k
        assert all(seen[-1].startswith(s) and "\ufffd" not in s for s in seen)  # it only grows, never half a character
        assert max(windows) <= CONTEXT + 4  # a few tokens per call, whatever the length
        rewritten += tok.decode(ids[k:]) != stream.text  # decoding the new tokens alone: " word" -> "word"
    assert (rewritten > 0) == drops_a_space


def test_stop_strings_end_the_text_before_them_even_across_tokens():
    decode = lambda t: bytes(t).decode("utf-8", errors="replace")
    data = list("héllo wörld, 日本語\n\nend".encode())
    for stop, want in [("\n\n", "héllo wörld, 日本語"), ("wör", "héllo "), ("本", "héllo wörld, 日"), ("xyz", None)]:
        stream = TextStream(decode, [], (stop, "never"))
        for t in data:
            stream.add(t)
        stream.flush()
        assert (stream.text, stream.stopped) == ((want, True) if want else (decode(data), False))
