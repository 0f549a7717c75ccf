"""Text of a growing list of tokens with O(1) work per token, and stop strings found as it grows.

    stream = TextStream(tokenizer_decode, prompt_tokens, stop=("\\n\\n",))
    for token in tokens:
        stream.add(token)              # stream.text grows (not while a character is unfinished)
        if stream.stopped: break       # stream.text ends before the stop string
    stream.flush()                     # the end: what was held back

Decoding all tokens again for each new one costs O(n) per token. A tokenizer's decode is not
additive, though: SentencePiece drops the space of the text's first word ("▁world" alone is
"world", after "Hello" it is " world"), and a character split over byte tokens decodes to U+FFFD
until its last byte arrives. So, as vLLM's detokenizer and Hugging Face's streamers do, each new
token decodes a short window of the tokens before it, and the new text is the part of that
window's text after the text it had without the token. The window starts a few tokens back in
the prompt (on a whole character), so the first generated word keeps its space. A window ending in U+FFFD adds nothing
yet and grows until the character is whole.

A stop string can only end in the new text, so it is searched for in the new text and the
len(stop) - 1 characters before it.

One token's text, as a log-probability lists it (`token_key`), is not always text: a byte token,
or a piece of a character split over tokens, decodes to U+FFFD, so distinct tokens would share
one key. OpenAI writes such a token as its bytes, `bytes:\\xc3`, and so does `token_key`.

Source: vLLM's incremental detokenization, https://github.com/vllm-project/vllm/blob/main/vllm/v1/engine/detokenizer.py;
Hugging Face's TextStreamer, https://github.com/huggingface/transformers/blob/main/src/transformers/generation/streamers.py
"""

import re

CONTEXT = 5  # prompt tokens the first window starts with (vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET)


class TextStream:
    def __init__(self, decode, prompt=(), stop=()):
        self.decode, self.stop = decode, tuple(stop)
        self.tokens = list(prompt[-CONTEXT:])
        self.read = len(self.tokens)  # the window is tokens[start:]; tokens[:read] are in text
        # The window starts on a whole character (a split one would decode to U+FFFD for good).
        self.start = next((i for i in range(self.read) if not self.decode(self.tokens[i:]).startswith("\ufffd")),
                          self.read)
        self.text, self.stopped = "", False

    def add(self, token):
        """Append one token to the text (nothing once stopped)."""
        self.tokens.append(token)
        if self.stopped:
            return
        before = self.decode(self.tokens[self.start:self.read])
        after = self.decode(self.tokens[self.start:])
        if len(after) > len(before) and not after.endswith("\ufffd"):  # else: nothing yet, or an unfinished character
            self.start, self.read = self.read, len(self.tokens)
            self.append(after[len(before):])

    def flush(self):
        """The end of the request: the text held back (an unfinished character), as decode gives it."""
        if self.read < len(self.tokens) and not self.stopped:
            before, after = self.decode(self.tokens[self.start:self.read]), self.decode(self.tokens[self.start:])
            self.read = len(self.tokens)
            self.append(after[len(before):])

    def append(self, new):
        """text += new, cut before the first stop string; only the new text can complete one."""
        keep = len(self.text) - max(map(len, self.stop), default=1) + 1  # text before this can't be in a match
        tail = self.text[max(keep, 0):] + new
        hits = [i for i in map(tail.find, self.stop) if i >= 0]
        self.text += new
        if hits:
            self.text, self.stopped = self.text[:len(self.text) - len(tail) + min(hits)], True


def byte_level_alphabet():
    """{character: byte} of GPT-2's byte-level pieces (Llama 3's tokenizer): the printable bytes
    stand for themselves, the 68 others for the characters from U+0100 on, in byte order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    moved = [b for b in range(256) if b not in kept]
    return {chr(b): b for b in kept} | {chr(256 + i): b for i, b in enumerate(moved)}


BYTE_LEVEL = byte_level_alphabet()


def token_bytes(tokenizer, token):
    """The bytes of one token: its decoded text's unless that holds U+FFFD (a byte token, or part
    of a character split over tokens); then its piece's: Llama 2's byte tokens `<0xC3>`, Llama 3's
    byte-level characters (BYTE_LEVEL), or the byte tokenizer's ids 0-255 themselves. tokenizer:
    transformers' (convert_ids_to_tokens), `tokenizers`' (id_to_token) or the byte tokenizer."""
    text = tokenizer.decode([token])
    if "\ufffd" not in text:
        return text.encode()
    lookup = getattr(tokenizer, "convert_ids_to_tokens", None) or getattr(tokenizer, "id_to_token", None)
    if lookup is None:  # the byte tokenizer (tokenizer.ByteTokenizer): no pieces, ids 0-255 are bytes
        return bytes([token]) if token < 256 else text.encode()
    piece = lookup(token)
    if hexa := re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece):
        return bytes([int(hexa[1], 16)])
    if all(c in BYTE_LEVEL for c in piece):
        return bytes(BYTE_LEVEL[c] for c in piece)
    return text.encode()  # a piece whose text really holds U+FFFD


def token_key(tokenizer, token):
    """One token as OpenAI's log-probabilities write it: its text, or `bytes:\\xNN...` (each byte as
    \\x and two hex digits) when its bytes are not UTF-8 on their own. Distinct tokens get distinct
    keys whenever their bytes differ."""
    piece = token_bytes(tokenizer, token)
    try:
        return piece.decode()
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in piece)
