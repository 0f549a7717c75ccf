"""Structured output's host side (no device): xgrammar's token bitmask equals one written by hand
from the tokenizer's token bytes, `sampling.allowed_by` reads it as xgrammar's own masking does,
and a schema xgrammar cannot compile is an error naming where it is."""
import pytest
import torch

from llama_xla_helpers.detokenize import token_bytes
from llama_xla_helpers.grammar import Grammars, matcher
from llama_xla_helpers.sampling import allowed_by
from llama_xla_helpers.tokenizer import SPECIAL_TOKENS, ByteTokenizer, small_tokenizer

pytestmark = pytest.mark.fixed_dtype  # no test here reads the default dtype (conftest checks)

VOCAB = 520  # the model's: past the tokenizer's 512, ids no text can use


def bitmask_by_hand(allowed, vocab_size):
    """(ceil(vocab_size / 32),) int32: bit j of word i set iff token 32 i + j is allowed."""
    words = [sum(1 << (t - 32 * i) for t in allowed if 32 * i <= t < 32 * i + 32) for i in range(-(-vocab_size // 32))]
    return torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)


def allowed_by_hand(texts, prefix, pieces, stop_ids):
    """The tokens that keep `prefix` on the way to one of `texts` (a finite language: those tokens
    whose bytes extend it to a prefix of a text), and the stop ids once it is a whole text."""
    allowed = {t for t, piece in pieces.items() if any(text.startswith(prefix + piece) for text in texts)}
    return allowed | (set(stop_ids) if prefix in texts else set())


@pytest.mark.parametrize("which", ["bpe", "bytes"])
def test_the_bitmask_of_an_enum_equals_one_by_hand_at_every_token(which):
    """{"enum": [...]}: JSON text is one of the quoted strings (compact, `Grammars`). At each token of
    a greedy walk (the lowest allowed id), xgrammar's mask is the by-hand one over the tokenizer's
    token bytes (special tokens have no text), and the walk ends at a whole text then a stop id."""
    if which == "bpe":  # Llama 3's special tokens first (`tokenizer.small_tokenizer`), then bytes and merges
        tok = small_tokenizer()
        stop, special, size = [tok.eos_token_id], set(range(len(SPECIAL_TOKENS))), len(tok)
    else:
        tok = ByteTokenizer()
        stop, special, size = [tok.eos_id], {tok.bos_id, tok.eos_id}, tok.vocab_size
    pieces = {t: token_bytes(tok, t) for t in range(size) if t not in special}
    texts = [b'"yes"', b'"no"', b'"not sure"']
    state = matcher(Grammars(tok, VOCAB, stop).json_schema({"enum": ["yes", "no", "not sure"]}))
    prefix, walked = b"", []
    mask = torch.full((1, -(-VOCAB // 32)), -1, dtype=torch.int32)
    while not state.is_terminated():
        state.fill_next_token_bitmask(mask, 0)
        allowed = allowed_by_hand(texts, prefix, pieces, stop)
        assert torch.equal(mask[0], bitmask_by_hand(allowed, VOCAB)), prefix
        assert set(allowed_by(mask, VOCAB)[0].nonzero()[:, 0].tolist()) == allowed
        token = min(allowed - set(stop)) if allowed - set(stop) else stop[0]
        assert state.accept_token(token)
        walked.append(token)
        prefix += pieces.get(token, b"")
    assert prefix in texts and walked[-1] == stop[0] and len(walked) > 2


def test_allowed_by_reads_the_bitmask_as_xgrammar_masks_logits():
    """On the host and on the XLA device (where torch_xla's `>>` shifts -1 to 0: `allowed_by`)."""
    import torch_xla
    import xgrammar
    vocab = 70  # three words, the last one partly past the vocabulary
    g = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-2 ** 31, 2 ** 31 - 1, (4, 3), generator=g, dtype=torch.int32)
    logits = torch.randn(4, vocab)
    want = logits.clone()
    xgrammar.apply_token_bitmask_inplace(want, bitmask)
    assert torch.equal(logits.masked_fill(~allowed_by(bitmask, vocab), float("-inf")), want)
    assert torch.equal(allowed_by(bitmask.to(torch_xla.device()), vocab).cpu(), allowed_by(bitmask, vocab))


@pytest.mark.parametrize("fmt, message", [
    ({"type": "json_schema", "json_schema": {"schema": {"type": "strin"}}},
     "response_format.json_schema.schema: xgrammar cannot compile this JSON schema: Unsupported type \"strin\""),
    ({"type": "json_schema", "json_schema": {"schema": {"$ref": "#/nowhere"}}},
     "response_format.json_schema.schema: xgrammar cannot compile this JSON schema: .*nowhere"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "string", "pattern": "^[a-z]{129}$"}}},
     "response_format.json_schema.schema: xgrammar cannot compile this JSON schema"),  # 128 at most: grammar.py
    ({"type": "json_schema", "json_schema": "an object"}, "response_format.json_schema must be an object"),
    ({"type": "yaml"}, "response_format.type='yaml' must be 'text', 'json_object' or 'json_schema'"),
])
def test_a_format_that_cannot_compile_is_named(fmt, message):
    with pytest.raises(ValueError, match=message):
        Grammars(ByteTokenizer(), VOCAB, [ByteTokenizer.eos_id]).response_format(fmt)


@pytest.mark.parametrize("schema, raw_control", [({"type": "string"}, False),
                                                  ({"type": "string", "pattern": "^[a-z]{0,5}$"}, False),
                                                  ({"type": "string", "maxLength": 5}, True),
                                                  ({"type": "string", "minLength": 1}, True)])
def test_the_known_limit_of_string_lengths(schema, raw_control):
    """xgrammar 0.2.8's limit, documented in grammar.py and the README: a string with maxLength or
    minLength allows a raw control character (here U+0001) after its opening quote, which strict JSON
    parsers reject; a plain string or a pattern does not. If xgrammar fixes it, this fails: update the docs."""
    state = matcher(Grammars(ByteTokenizer(), VOCAB, [ByteTokenizer.eos_id]).json_schema(schema))
    assert state.accept_token(ord('"'))
    assert state.accept_token(1) == raw_control
