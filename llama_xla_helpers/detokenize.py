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

Source: vLLM's incremental detokenization, https://github.com/vllm-project/vllm/blob/main/vllm/v1/engine/detokenizer.py;
Hugging Face's TextStreamer, https://github.com/huggingface/transformers/blob/main/src/transformers/generation/streamers.py
"""

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
