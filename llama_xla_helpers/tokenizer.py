"""Tokenizers: the byte tokenizer, Hugging Face tokenizers from a local folder, and a small BPE
tokenizer trained offline.

`ByteTokenizer` (UTF-8 bytes, BOS 256, EOS 257) is for a model trained from random init, or one
whose vocabulary is the byte tokenizer's (a config with BOS 256 and EOS 257, as `tiny`); any
other model needs its own Hugging Face tokenizer (`get_tokenizer(folder)`, `load_tokenizer`).
`tokenizer_and_config` checks the two against each other: a tokenizer with more tokens than the
model's vocab_size is an error, and a model built from random init for a tokenizer gets
`padded_vocab_size(len(tokenizer))`, a multiple of 64. `small_tokenizer()` trains a 512-token
byte-level BPE with Llama 3's special tokens and chat format on the pydoc topics
(`corpus_documents`, data.py's default corpus), offline, in about a second: the same vocabulary
on every run with the same Python (its pydoc topics are the corpus) and `tokenizers` (pinned).
Tests and notebooks use it. `tokenizer_sha` names a tokenizer's ids, for token files' names.

This module imports neither data.py (token files, SFT rows) nor generate.py, which both import
it; `data` still exports every name here that it held before (`data.ByteTokenizer`, ...), and
`generate` exports `load_tokenizer`.
"""
import copy
import hashlib
import json
import os
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")  # a folder holding a tokenizer
VOCAB_MULTIPLE = 64          # a random-init model's vocab_size is rounded up to a multiple of this
# Llama 3's special tokens (small_tokenizer's, at ids 0-5) and its chat format, as generate.llama3_chat.
SPECIAL_TOKENS = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                  "<|eot_id|>", "<|pad|>")
CHAT_TEMPLATE = ("{{ bos_token }}{% for message in messages %}"
                 "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
                 "{{ message['content'] | trim }}<|eot_id|>{% endfor %}"
                 "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")


def corpus_documents():
    """The standard library's pydoc topic texts, one per topic, in sorted order (the default corpus)."""
    from pydoc_data.topics import topics
    return [topics[k] for k in sorted(topics)]


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255, plus BOS (256) and EOS (257)."""

    bos_id, eos_id, vocab_size = 256, 257, 258

    def encode(self, text, bos=True, eos=False):
        return [self.bos_id] * bos + list(text.encode("utf-8")) + [self.eos_id] * eos

    def decode(self, ids):
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def get_tokenizer(path=None):
    """The byte tokenizer (path None), or the Hugging Face tokenizer saved in a local folder
    (`load_tokenizer`: AutoTokenizer, never the network)."""
    if path is None:
        return ByteTokenizer()
    if not Path(path).is_dir():
        raise FileNotFoundError(f"tokenizer {str(path)!r} is not a folder; pass a local folder with tokenizer.json "
                                f"(a model's folder, or one written by tokenizer.save_pretrained)")
    return load_tokenizer(path)


def tokenizer_size(tokenizer):
    """How many ids the tokenizer can produce: the byte tokenizer's 258, or len() of a Hugging Face
    tokenizer (its added tokens included, which `tokenizer.vocab_size` leaves out)."""
    return ByteTokenizer.vocab_size if isinstance(tokenizer, ByteTokenizer) else len(tokenizer)


def special_ids(tokenizer):
    """(BOS id or None, EOS id, pad id): the pad is the tokenizer's, else its EOS (padding is
    never attended to by the tokens before it, and its labels are data.IGNORE_INDEX)."""
    if isinstance(tokenizer, ByteTokenizer):
        return ByteTokenizer.bos_id, ByteTokenizer.eos_id, ByteTokenizer.eos_id
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError(f"the tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no EOS token, which "
                         f"ends every document; set tokenizer.eos_token (and save it) first")
    pad = tokenizer.pad_token_id
    return tokenizer.bos_token_id, eos, eos if pad is None else pad


def padded_vocab_size(n, multiple=VOCAB_MULTIPLE):
    """n rounded up to a multiple of `multiple` (64): the vocab_size of a random-init model for a
    tokenizer of n tokens, so that every mesh axis up to 64 divides the embedding's rows."""
    return -(-n // multiple) * multiple


def check_vocab(tokenizer, vocab_size):
    """ValueError unless every id of the tokenizer is a row of the model's embedding."""
    n = tokenizer_size(tokenizer)
    if n > vocab_size:
        raise ValueError(f"the tokenizer has {n} tokens but the model's vocab_size is {vocab_size}: ids "
                         f"{vocab_size}..{n - 1} have no embedding row. Use the model's own tokenizer, or "
                         f"train a model from random init sized for this tokenizer (no init_from: its "
                         f"vocab_size becomes padded_vocab_size({n}) = {padded_vocab_size(n)})")


def tokenizer_and_config(config, tokenizer=None, pretrained=False):
    """(tokenizer, LlamaConfig to build) for training, checked against each other.

    tokenizer: a folder (or a loaded tokenizer); None: the byte tokenizer. pretrained: `config` is
    that of existing weights (init_from), which must already fit the tokenizer; else the model
    is built from random init, so a Hugging Face tokenizer sizes it: vocab_size =
    padded_vocab_size(len(tokenizer)), bos/eos/pad ids the tokenizer's (a copy; `config` is
    not changed). The byte tokenizer goes with pretrained weights only if the config's BOS and
    EOS are the byte tokenizer's (256, 257: a model trained with it).
    """
    if tokenizer is None or isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = get_tokenizer(tokenizer)
    byte = isinstance(tokenizer, ByteTokenizer)
    if byte and pretrained and (config.bos_token_id, config.eos_token_id) != (ByteTokenizer.bos_id,
                                                                              ByteTokenizer.eos_id):
        raise ValueError(f"the model to fine-tune was not trained with the byte tokenizer (its bos_token_id="
                         f"{config.bos_token_id}, eos_token_id={config.eos_token_id}, vocab_size="
                         f"{config.vocab_size}; the byte tokenizer's BOS and EOS are 256 and 257): pass the "
                         f"model's own tokenizer, e.g. --tokenizer with the init_from folder")
    if byte or pretrained:
        check_vocab(tokenizer, config.vocab_size)
        return tokenizer, config
    bos, eos, _ = special_ids(tokenizer)
    config = copy.deepcopy(config)
    config.vocab_size = padded_vocab_size(tokenizer_size(tokenizer))
    config.bos_token_id, config.eos_token_id, config.pad_token_id = bos, eos, tokenizer.pad_token_id
    return tokenizer, config


def tokenizer_sha(tokenizer, chat=False):
    """sha256 of what decides a tokenizer's ids: the byte tokenizer's version, or a Hugging Face
    tokenizer's whole backend as JSON (`backend_tokenizer.to_str()`: vocabulary, merges, added
    tokens, normalizer, pre-tokenizer; what tokenizer.json holds, also for a tokenizer that was
    never saved) with its BOS/EOS/pad ids; with `chat`, its chat template too."""
    if isinstance(tokenizer, ByteTokenizer):
        what = {"byte": ByteTokenizer.vocab_size}
    else:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        what = {"backend": backend.to_str() if backend is not None else  # a tokenizer without tokenizer.json
                [type(tokenizer).__name__, sorted(tokenizer.get_vocab().items())],
                "special": [tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id]}
    if chat:
        what["chat_template"] = getattr(tokenizer, "chat_template", None)
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()


def small_tokenizer(vocab_size=512, path=None):
    """A byte-level BPE tokenizer of `vocab_size` tokens trained on the pydoc corpus, offline.

    A `transformers.PreTrainedTokenizerFast` with Llama 3's special tokens (ids 0-5: BOS
    <|begin_of_text|>, EOS <|eot_id|>, pad <|pad|>, the role headers) and a Llama-3-like chat
    template (the prompt `generate.llama3_chat` writes); encode() adds BOS. The 256 byte tokens
    are all in it, so it encodes any text. Deterministic: the same vocabulary every run, for a
    given Python (whose pydoc topics it learns from) and `tokenizers` version (pinned in
    pyproject.toml). Saved to `path` if given.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    core.train_from_iterator(corpus_documents(), trainer=trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
                                  pad_token="<|pad|>", add_bos_token=True, chat_template=CHAT_TEMPLATE)
    if path is not None:
        tok.save_pretrained(path)
    return tok


def load_tokenizer(path):
    """A Hugging Face tokenizer from a local directory (never the network)."""
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path, local_files_only=True)
