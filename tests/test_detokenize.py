"""Incremental text: the same text as decoding everything, with a few tokens of work per token,
for a SentencePiece-style tokenizer (which drops the space of the text's first word) and a
byte-level one (which splits characters over tokens); stop strings are cut as they complete.
A token that is not UTF-8 alone is keyed by its bytes, as OpenAI writes it, with every tokenizer."""
import json

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from llama_xla_helpers.data import ByteTokenizer, load_corpus, small_tokenizer
from llama_xla_helpers.detokenize import BYTE_LEVEL, CONTEXT, TextStream, token_bytes, token_key

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


BYTE_ID = {  # the id of one byte's token
    ByteTokenizer: lambda tok, b: b,
    sentencepiece_style: lambda tok, b: tok.token_to_id(f"<0x{b:02X}>"),
    byte_level: lambda tok, b: tok.token_to_id({v: c for c, v in BYTE_LEVEL.items()}[b]),
    small_tokenizer: lambda tok, b: tok.convert_tokens_to_ids({v: c for c, v in BYTE_LEVEL.items()}[b]),
}


@pytest.mark.parametrize("make", list(BYTE_ID), ids=lambda f: f.__name__)
def test_a_token_that_is_not_utf8_alone_is_keyed_by_its_bytes_as_openai_does(make):
    tok = make()
    c3, a9, a = (BYTE_ID[make](tok, b) for b in (0xC3, 0xA9, ord("A")))  # "é" is C3 A9
    assert len({c3, a9, a}) == 3 and tok.decode([c3]) == tok.decode([a9]) == "\ufffd"  # two tokens, one text
    assert (token_key(tok, c3), token_key(tok, a9), token_key(tok, a)) == ("bytes:\\xc3", "bytes:\\xa9", "A")
    assert (token_bytes(tok, c3), token_bytes(tok, a9), token_bytes(tok, a)) == (b"\xc3", b"\xa9", b"A")


def test_the_byte_level_alphabet_is_the_tokenizers():
    tok = byte_level()
    assert set(BYTE_LEVEL) == set(pre_tokenizers.ByteLevel.alphabet())
    assert sorted(BYTE_LEVEL.values()) == list(range(256))
    for c, b in BYTE_LEVEL.items():  # each byte inside a whole character: ASCII alone, a continuation after C2
        if b < 0xC0:
            seq = [b] if b < 0x80 else [0xC2, b]
            assert tok.decode([BYTE_ID[byte_level](tok, x) for x in seq]) == bytes(seq).decode(), hex(b)
