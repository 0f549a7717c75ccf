"""Training text that needs no network, a byte tokenizer, and fixed-length training chunks.

The default corpus is the Python documentation's topic texts that ship with the standard
library (`pydoc_data.topics`, about 0.47 MB of English prose and code), so every machine has it.
"""
from pathlib import Path

import torch


def load_corpus(path=None):
    """The text of a local UTF-8 file, or by default the standard library's pydoc topic texts."""
    if path is not None:
        if not Path(path).is_file():
            raise FileNotFoundError(f"data file {str(path)!r} does not exist; pass a UTF-8 text file")
        data = Path(path).read_bytes()
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{path} is not UTF-8 text: byte {e.start} is 0x{data[e.start]:02x}; pass a text "
                             f"file (the byte tokenizer reads text, encoded as UTF-8)") from None
    from pydoc_data.topics import topics
    return "\n\n".join(topics[k] for k in sorted(topics))


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255, plus BOS (256) and EOS (257)."""

    bos_id, eos_id, vocab_size = 256, 257, 258

    def encode(self, text, bos=True, eos=False):
        return [self.bos_id] * bos + list(text.encode("utf-8")) + [self.eos_id] * eos

    def decode(self, ids):
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def chunks(text, seq_len, tokenizer=ByteTokenizer()):
    """Non-overlapping (n, seq_len) chunks of the encoded text (the tail that does not fit is dropped)."""
    ids = torch.tensor(tokenizer.encode(text), dtype=torch.long)
    n = len(ids) // seq_len
    return ids[:n * seq_len].view(n, seq_len)


def train_val_split(text, seq_len, val_fraction=0.1):
    """(train, val) chunks: the last `val_fraction` of the text is held out."""
    cut = int(len(text) * (1 - val_fraction))
    return chunks(text[:cut], seq_len), chunks(text[cut:], seq_len)


class StepSampler(torch.utils.data.Sampler):
    """Indices for `steps` batches starting at step `start`, reshuffled every epoch.

    Batch s is a function of (seed, s) alone, so a run resumed at step k sees exactly the
    batches an uninterrupted run sees from step k on.
    """

    def __init__(self, n, batch_size, seed, start, steps):
        if n < batch_size:
            raise ValueError(f"{n} training chunks cannot fill one batch of {batch_size}; "
                             f"use more text, a shorter seq_len or a smaller batch_size")
        self.n, self.batch_size, self.seed, self.start, self.steps = n, batch_size, seed, start, steps

    def __len__(self):
        return self.steps * self.batch_size

    def __iter__(self):
        per_epoch = self.n // self.batch_size  # drop_last: every batch is full
        epoch_drawn, order = None, None
        for step in range(self.start, self.start + self.steps):
            epoch, i = divmod(step, per_epoch)
            if epoch != epoch_drawn:  # one permutation per epoch, not per step
                epoch_drawn, order = epoch, self.order(epoch)
            yield from order[i * self.batch_size:(i + 1) * self.batch_size].tolist()

    def order(self, epoch):
        """The shuffled indices of `epoch`: a function of (seed, epoch) alone."""
        return torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + epoch))
