"""Training data: text that needs no network, token files read row by row, and SFT rows.

The default corpus is the Python documentation's topic texts that ship with the standard
library (`pydoc_data.topics`, about 0.47 MB of English prose and code), so every machine has it.

Tokenizers live in tokenizer.py (`ByteTokenizer`, `get_tokenizer`, `small_tokenizer`, ...); this
module imports them from there and still exports them under their old names (`data.ByteTokenizer`).

Token files. `token_file(data, tokenizer, directory)` tokenizes the data once into
`directory/tokens-<sha>.u32`: uint32 little-endian token ids, flat, every document as
[BOS] + text + [EOS]. <sha> covers the data file's bytes, the tokenizer's identity and this
format, so a second run (or another host) with the same inputs finds the file and tokenizes
nothing, and any change makes a new file. Only the lead process writes (on a pod, process 0; the
folder must be one every host sees, or a gs:// URL), into a temporary file renamed into place:
a crash never leaves a file by that name that is not complete. Given `share` (train passes it),
only process 0 reads the data, to name the file; the other hosts get the name from it, so only
process 0 needs the data. The other hosts wait for the file (30 minutes plus a second per MiB of
data; for a larger corpus, tokenize first on one host with `python -m llama_xla_helpers.data`).
Every host then reads only the rows it needs, through np.memmap or, from a gs:// folder, by
byte ranges (`TokenRows`), never the whole corpus; `token_rows` holds out the last
`val_fraction` of the rows, as `train_val_split` holds out the end of the text.

Data files: UTF-8 text (one document), or JSONL (`.jsonl`) with a string field "text" per line
(one document a line, so documents are separated by EOS). SFT data (`sft_file`): JSONL with
"messages", a list of {"role", "content"}; see `sft_example` for how the loss is restricted to
the assistant's tokens. `training_data` is the one call a training loop needs.
"""
import codecs
import hashlib
import json
import os
import re
import tempfile
import time
import uuid
import warnings
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import TensorDataset

from .tokenizer import (CHAT_TEMPLATE, SPECIAL_TOKENS, TOKENIZER_FILES, VOCAB_MULTIPLE,  # noqa: F401  re-exported
                        ByteTokenizer, check_vocab, corpus_documents, get_tokenizer, padded_vocab_size, small_tokenizer,
                        special_ids, tokenizer_and_config, tokenizer_sha, tokenizer_size)

IGNORE_INDEX = -100          # labels Hugging Face's loss skips (its CrossEntropyLoss ignore_index)
TOKEN_DTYPE = np.dtype("<u4")  # token files: uint32, little-endian
IGNORE_U32 = 0xFFFFFFFF      # IGNORE_INDEX as stored in a .u32 file (no token has this id)
TOKENS_FORMAT = "llama-xla tokens v1: uint32 little-endian, flat; a document is [BOS] + text + [EOS]"
SFT_FORMAT = ("llama-xla sft v1: uint32 little-endian rows of 2 * seq_len: ids, then labels "
              f"({IGNORE_U32:#x} = {IGNORE_INDEX}); right-padded with the pad id")
SFT_PACKED_FORMAT = ("llama-xla sft packed v1: uint32 little-endian rows of 4 * seq_len: ids, labels "
                     f"({IGNORE_U32:#x} = {IGNORE_INDEX}), segment ids, positions; conversations packed next-fit, "
                     "the rest of a row padded with the pad id as one more segment")
SFT_COLUMNS = {False: 2, True: 4}  # packed -> columns of seq_len per row: ids, labels (, segment ids, positions)
PIECE_CHARS = 1 << 20        # a text file is tokenized in pieces of about this many characters,
PIECES_PER_CALL = 8          # this many at a time
BATCH_DOCS = 512             # JSONL documents (or conversations) encoded per call
CACHE_DIR = "llama_xla_tokens"  # under the system's temporary folder: token files without a directory
SHARED = ("the token folder must be one that every host sees (the checkpoint_dir: a shared file "
          "system or a gs:// URL); process 0 writes the file, the others read it")
WAIT_S = 30 * 60             # a host waits this long for process 0's token file (gloo's default timeout),
WAIT_BYTES_PER_S = 1 << 20   # plus a second per MiB of data (tokenizing and uploading, at a slow pace)
POLL_S = 5                   # a waiting host looks for the file this often
TOKENIZE_FIRST = ("tokenize first, on one host: python -m llama_xla_helpers.data with the run's --checkpoint-dir, "
                  "--tokenizer and --data (or --sft and --seq-len), then start the run on every host")


# --- Text -------------------------------------------------------------------------------------

def load_corpus(path=None):
    """The text of a local UTF-8 file, or by default the standard library's pydoc topic texts."""
    if path is not None:
        _check_file(path)
        data = Path(path).read_bytes()
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{path} is not UTF-8 text: byte {e.start} is 0x{data[e.start]:02x}; pass a text "
                             f"file (the byte tokenizer reads text, encoded as UTF-8)") from None
    return "\n\n".join(corpus_documents())


def _check_file(path, what="data file", fix="pass a UTF-8 text file"):
    if not Path(path).is_file():
        raise FileNotFoundError(f"{what} {str(path)!r} does not exist; {fix}")


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


# --- Documents as a token file holds them -----------------------------------------------------

def _encode_plain(tokenizer, texts):
    """Token ids of each text without special tokens, as uint32 arrays."""
    if isinstance(tokenizer, ByteTokenizer):
        return [np.frombuffer(t.encode("utf-8"), np.uint8).astype(TOKEN_DTYPE) for t in texts]
    ids = tokenizer(list(texts), add_special_tokens=False, return_attention_mask=False, verbose=False)["input_ids"]
    return [np.asarray(i, dtype=TOKEN_DTYPE) for i in ids]


def encode_document(tokenizer, text):
    """A document's token ids as a token file holds them: [BOS] (if the tokenizer has one) + text + [EOS]."""
    bos, eos, _ = special_ids(tokenizer)
    return [bos] * (bos is not None) + _encode_plain(tokenizer, [text])[0].tolist() + [eos]


# --- Reading data files -----------------------------------------------------------------------

def _safe_cut(buf, limit):
    """An index <= limit where the text can be cut without changing its ids, or 0 if none: just after
    a newline between two non-space characters, else just before a space between a non-space
    character and a letter. Byte-level BPE pre-tokenizers (GPT-2's, Llama 3's, small_tokenizer's)
    always split there, and BPE never merges across a split, so pieces cut there encode to exactly
    the ids of the whole text."""
    i = buf.rfind("\n", 0, limit)
    while i > 0:
        if i + 1 < len(buf) and not buf[i - 1].isspace() and not buf[i + 1].isspace():
            return i + 1
        i = buf.rfind("\n", 0, i)
    i = buf.rfind(" ", 0, limit + 1)
    while i > 0:
        if i + 1 < len(buf) and not buf[i - 1].isspace() and buf[i + 1].isalpha():
            return i
        i = buf.rfind(" ", 0, i)
    return 0


def _pieces(buf, piece_chars, final):
    """(pieces to encode, rest): `buf` cut (`_safe_cut`) into pieces of at most piece_chars (one
    with no safe place is cut at piece_chars); with `final`, the rest is a piece too."""
    out = []
    while len(buf) > piece_chars:
        cut = _safe_cut(buf, piece_chars) or piece_chars
        out.append(buf[:cut])
        buf = buf[cut:]
    if final and buf:
        out.append(buf)
        buf = ""
    return out, buf


def _text_pieces(path, piece_chars):
    """A UTF-8 file's text in pieces (`_pieces`), read a block at a time: never the whole file."""
    decoder, buf, offset = codecs.getincrementaldecoder("utf-8")(), "", 0
    with open(path, "rb") as f:
        while True:
            block = f.read(piece_chars)
            pending = decoder.getstate()[0]
            try:
                buf += decoder.decode(block, final=not block)
            except UnicodeDecodeError as e:
                at = offset - len(pending) + e.start
                raise ValueError(f"{path} is not UTF-8 text: byte {at} is 0x{(pending + block)[e.start]:02x}; pass "
                                 f"a UTF-8 text file, or JSONL (.jsonl) with a 'text' field per line") from None
            offset += len(block)
            pieces, buf = _pieces(buf, piece_chars, final=not block)
            yield from pieces
            if not block:
                return


def _jsonl(path):
    """(line number, object) of each non-blank line of a JSONL file; ValueError naming the line."""
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path} line {n}: not UTF-8 (byte {e.start} of the line is "
                                 f"0x{raw[e.start]:02x})") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line.rstrip("\r\n"))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} line {n}: not valid JSON ({e.msg} at column {e.colno}); each line of a "
                                 f"JSONL file must be one JSON object") from None
            if not isinstance(record, dict):
                raise ValueError(f"{path} line {n}: a JSON {type(record).__name__}, not an object; each line must "
                                 f"be one JSON object")
            yield n, record


def _jsonl_texts(path, field="text"):
    for n, record in _jsonl(path):
        if field not in record:
            fields = ", ".join(map(repr, record)) or "none"
            raise ValueError(f"{path} line {n}: no field {field!r} (its fields: {fields}); each line must be an "
                             f"object with a string {field!r}, e.g. {{\"{field}\": \"...\"}}")
        if not isinstance(record[field], str):
            raise ValueError(f"{path} line {n}: {field!r} is a JSON {type(record[field]).__name__}, not a string")
        yield record[field]


def is_jsonl(path):
    return str(path).lower().endswith(".jsonl")


def read_documents(path):
    """The documents of a data file: the "text" of each line of a JSONL file, or a text file's whole text."""
    _check_file(path, fix="pass a UTF-8 text file or a JSONL file (.jsonl)")
    return list(_jsonl_texts(path)) if is_jsonl(path) else [load_corpus(path)]


def _batches(items, size):
    batch = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def _token_arrays(data, tokenizer, piece_chars):
    """The uint32 ids of the token file of `data` (None: the corpus; a text file; a .jsonl file), in order."""
    bos, eos, _ = special_ids(tokenizer)
    head, tail = np.asarray([bos] * (bos is not None), TOKEN_DTYPE), np.asarray([eos], TOKEN_DTYPE)
    if data is not None and is_jsonl(data):
        for texts in _batches(_jsonl_texts(data), BATCH_DOCS):
            yield np.concatenate([a for ids in _encode_plain(tokenizer, texts) for a in (head, ids, tail)])
        return
    pieces = _text_pieces(data, piece_chars) if data is not None else _pieces(load_corpus(), piece_chars, True)[0]
    yield head
    for batch in _batches(pieces, PIECES_PER_CALL):  # a batch is encoded in parallel (tokenizers' threads)
        yield from _encode_plain(tokenizer, batch)
    yield tail


# --- Token files ------------------------------------------------------------------------------

def _sha_file(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def _data_sha(data):
    """sha256 of the data's bytes (the corpus's text, if data is None)."""
    if data is None:
        return hashlib.sha256(load_corpus().encode("utf-8")).hexdigest()
    return _sha_file(data)


def _name(prefix, *parts):
    return f"{prefix}-{hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]}.u32"


def _write_atomic(final, arrays, meta):
    """Write the uint32 arrays to `final` through a temporary file in its folder, renamed into place
    last (and meta, with the token count, to final + ".json" before it): `final` exists only complete.
    An exception removes the temporary file; a killed process leaves it, under a hidden name."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    tokens = 0
    try:
        with open(tmp, "wb") as f:
            for a in arrays:
                a = np.ascontiguousarray(a, dtype=TOKEN_DTYPE)
                f.write(a.tobytes())
                tokens += a.size
            f.flush()
            os.fsync(f.fileno())
        meta = {**meta, "tokens": tokens}
        info = tmp.with_suffix(".json.tmp")
        info.write_text(json.dumps(meta, indent=1))
        os.replace(info, f"{final}.json")
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return meta


def _is_url(path):
    return "://" in str(path)


def wait_seconds(data):
    """How long a host other than the lead waits for the lead's file of `data` (None: the corpus):
    WAIT_S, plus a second per WAIT_BYTES_PER_S bytes of the data file."""
    return WAIT_S + (0 if data is None else os.path.getsize(data) / WAIT_BYTES_PER_S)


def _wait_for(there, where, wait):
    """Return once there() is true, looking every POLL_S seconds; FileNotFoundError after `wait` seconds."""
    deadline = time.monotonic() + wait
    while not there():
        left = deadline - time.monotonic()
        if left <= 0:
            raise FileNotFoundError(f"{where} does not exist on this host after {wait:.0f} s of waiting for process "
                                    f"0 to write it: {SHARED}. If process 0 is still tokenizing (a large corpus), "
                                    f"{TOKENIZE_FIRST}")
        time.sleep(min(POLL_S, left))


def _named(directory, lead, share, data, wait, check, kind, fmt, *key):
    """(file name, wait) of the file made from `data`: check() (which raises on bad input), then
    `_name(kind, fmt, <data's sha>, *key)` and `wait` (None: `wait_seconds(data)`). On a pod with
    `share`, the lead's answer on every host, so no other host reads (or even needs) its own
    copy of the data; an error in the lead raises on every host. share(value) is a collective:
    every host calls it and gets the lead's value (train passes `checkpoint.lead_value`). share
    or directory None: every host names the file itself (no directory: each writes its own
    file, `_place`)."""
    def name():
        check()
        return _name(kind, fmt, _data_sha(data), *key), wait_seconds(data) if wait is None else wait
    if share is None or directory is None:
        return name()
    try:
        mine = (name(), None) if lead else None
    except Exception as e:  # noqa: BLE001  shared first, so that the other hosts do not wait for a file
        share((None, f"{type(e).__name__}: {e}"))
        raise
    named, error = share(mine)
    if error is not None:
        raise RuntimeError(f"process 0 could not name the token file: {error}")
    return named


def _place(directory, name, write, lead, wait):
    """The path of `directory/name`, written by `write(local path)` on the lead process if it is
    missing; any other process waits up to `wait` seconds for it to appear (`_wait_for`).
    directory None: the system's temporary folder, written by every process for itself.
    A URL (gs://...): the lead writes the file locally (to the temporary folder) and uploads it
    (an object appears whole or not at all); every host gets the URL, which `TokenRows` reads
    by byte ranges: nothing downloads the whole file."""
    if directory is None:
        directory, lead = Path(tempfile.gettempdir()) / CACHE_DIR, True
    wait = 0 if lead else wait
    if not _is_url(directory):
        final = Path(directory) / name
        if lead and not final.is_file():
            write(final)
        _wait_for(final.is_file, final, wait)
        return final
    import fsspec
    fs, root = fsspec.core.url_to_fs(str(directory))
    remote, local = f"{root.rstrip('/')}/{name}", Path(tempfile.gettempdir()) / CACHE_DIR / name

    def there():
        fs.invalidate_cache()  # a listing cached before the lead's upload
        return fs.exists(remote)
    if lead and not there():
        if not local.is_file():
            write(local)
        fs.put_file(f"{local}.json", f"{remote}.json")
        fs.put_file(str(local), remote)  # last: the data file is there only complete
    url = f"{str(directory).rstrip('/')}/{name}"
    _wait_for(there, url, wait)
    return url


def token_file(data, tokenizer, directory=None, *, lead=True, wait=None, piece_chars=PIECE_CHARS, share=None):
    """The path (for a gs:// directory, its URL) of the token file of `data` (None: the pydoc
    corpus; a UTF-8 text file; a .jsonl file with "text" per line), tokenized once into
    `directory/tokens-<sha>.u32`.

    Every document is [BOS] + its ids + [EOS] (BOS if the tokenizer has one), documents in the
    file's order. A text file is one document, encoded in pieces of at most `piece_chars` cut
    where its pre-tokenizer splits anyway (`_safe_cut`: exactly the ids of the whole text for
    byte-level BPE tokenizers; a SentencePiece tokenizer may encode the first word of a piece as
    if it began the text), so neither the text nor its ids are ever in memory as a whole.

    <sha> covers the data file's bytes (not its path or mtime: a copy of the file on another
    host or in another folder names the same tokens, and an edit that keeps size and mtime
    cannot reuse stale ones; hashing reads the file once, far cheaper than tokenizing it), the
    tokenizer (`tokenizer_sha`), `piece_chars` and the format (TOKENS_FORMAT). If the file is
    there it is used as it is. lead: this process writes a missing file (on a pod: process 0
    only); any other waits for it to appear, up to `wait` seconds (None: `wait_seconds(data)`,
    30 minutes plus a second per MiB of data), then fails with an error that says how to
    tokenize first (`python -m llama_xla_helpers.data`, on one host). share: on a pod, the
    collective that gives every host the lead's name and wait (`_named`): then only the lead
    reads and hashes `data`, and only its copy needs to exist; None: each host hashes its own
    copy. directory None: a folder under the system's temporary folder, which every process
    writes for itself. Its meta (source, counts) is next to it, in tokens-<sha>.u32.json.
    """
    tok_sha = tokenizer_sha(tokenizer)

    check = lambda: data is None or _check_file(  # noqa: E731
        data, fix="pass a UTF-8 text file or a JSONL file (.jsonl) with a 'text' field per line")
    name, wait = _named(directory, lead, share, data, wait, check, "tokens", TOKENS_FORMAT, tok_sha, piece_chars)
    meta = {"format": TOKENS_FORMAT, "data": str(data) if data is not None else "pydoc_data.topics",
            "tokenizer_sha256": tok_sha}
    write = lambda path: _write_atomic(path, _token_arrays(data, tokenizer, piece_chars), meta)  # noqa: E731
    return _place(directory, name, write, lead, wait)


def file_meta(path):
    """The meta written next to a token or SFT file (its token count; for SFT, what was dropped)."""
    import fsspec
    with fsspec.open(f"{path}.json", "r", encoding="utf-8") as f:  # a local path or a URL
        return json.load(f)


class TokenRows:
    """Rows of `seq_len` token ids of a .u32 file, read through np.memmap (a URL, gs://: by one
    byte range per row, through fsspec): indexing reads only the rows indexed, as int64 tensors,
    so no host holds or downloads the whole file.

    Rows start_row .. start_row + n_rows (default: to the end) of the file seen as rows of `stride`
    ids (default seq_len; the tail that does not fill a row is left out), columns column ..
    column + seq_len of each (an SFT file's rows are ids then labels: stride 2 * seq_len). A
    stored IGNORE_U32 reads as IGNORE_INDEX (-100).

    It works where a (n, seq_len) tensor does in `TensorDataset` and `sharded_loader`: `shape`,
    `size()`, `len()` and indexing by an int, a slice, a list / array / tensor of row indices, or
    (rows, columns), e.g. `t[rows[index[0]]][:, index[1]]`.
    """

    dtype = torch.int64

    def __init__(self, path, seq_len, start_row=0, n_rows=None, *, stride=None, column=0):
        stride = stride or seq_len
        if seq_len < 1 or column < 0 or column + seq_len > stride:
            raise ValueError(f"columns {column}..{column + seq_len} do not fit in rows of stride {stride}")
        self.path, self.seq_len, self.stride, self.column = str(path), seq_len, stride, column
        self._open()
        total = self._size // (TOKEN_DTYPE.itemsize * stride)
        n_rows = total - start_row if n_rows is None else n_rows
        if start_row < 0 or n_rows < 0 or start_row + n_rows > total:
            raise ValueError(f"rows {start_row}..{start_row + n_rows} are not all in {path}, which holds {total} "
                             f"rows of {stride} tokens")
        self.start_row, self.n_rows, self.total = start_row, n_rows, total

    def _open(self):
        """A local file: its size and np.memmap. A URL: its size and file system (`_read`)."""
        self._array = None
        if _is_url(self.path):
            import fsspec
            self._fs, self._remote = fsspec.core.url_to_fs(self.path)
            self._size = self._fs.size(self._remote)
            return
        self._size = os.path.getsize(self.path)
        rows = self._size // (TOKEN_DTYPE.itemsize * self.stride)
        self._array = (np.memmap(self.path, TOKEN_DTYPE, "r", shape=(rows, self.stride)) if rows
                       else np.zeros((0, self.stride), TOKEN_DTYPE))

    def _read(self, rows):
        """The file's `rows` (an int, a slice of step 1 or an index array), columns column..column +
        seq_len, as uint32: through the memmap, or from a URL one byte range per run of consecutive
        rows (across the other columns between them, for rows of stride > seq_len), all in one
        `cat_ranges` call (gcsfs sends the ranged reads concurrently)."""
        if self._array is not None:
            return self._array[rows, self.column:self.column + self.seq_len]
        index = np.arange(rows.start, rows.stop) if isinstance(rows, slice) else np.atleast_1d(rows)
        runs = [run for run in np.split(index, np.flatnonzero(np.diff(index) != 1) + 1) if run.size]
        starts = [int(run[0] * self.stride + self.column) * TOKEN_DTYPE.itemsize for run in runs]
        ends = [start + int((len(run) - 1) * self.stride + self.seq_len) * TOKEN_DTYPE.itemsize
                for start, run in zip(starts, runs)]
        blobs = self._fs.cat_ranges([self._remote] * len(runs), starts, ends, on_error="raise")
        tokens = [np.frombuffer(blob, TOKEN_DTYPE) for blob in blobs]  # a run: its rows, stride apart
        block = np.array([run_tokens[i * self.stride:i * self.stride + self.seq_len]
                          for run, run_tokens in zip(runs, tokens) for i in range(len(run))],
                         TOKEN_DTYPE).reshape(len(index), self.seq_len)
        return block[0] if isinstance(rows, (int, np.integer)) else block

    def __getstate__(self):  # a DataLoader worker reopens the file; it does not copy the rows
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._open()

    @property
    def shape(self):
        return torch.Size((self.n_rows, self.seq_len))

    def size(self, dim=None):
        return self.shape if dim is None else self.shape[dim]

    def dim(self):
        return 2

    def __len__(self):
        return self.n_rows

    def __repr__(self):
        return (f"TokenRows({self.path!r}, seq_len={self.seq_len}, start_row={self.start_row}, "
                f"n_rows={self.n_rows}, stride={self.stride}, column={self.column})")

    def rows(self, start, stop):
        """Rows start..stop of these, as a TokenRows (nothing is read)."""
        start, stop, _ = slice(start, stop).indices(self.n_rows)
        return TokenRows(self.path, self.seq_len, self.start_row + start, max(stop - start, 0),
                         stride=self.stride, column=self.column)

    def _file_rows(self, index):
        """The file's row index (int), slice or index array for `index` into these rows."""
        n = self.n_rows
        if isinstance(index, (int, np.integer)) or (torch.is_tensor(index) and index.dim() == 0):
            i = int(index)
            if not -n <= i < n:
                raise IndexError(f"row {i} is out of range for {n} rows")
            return self.start_row + i % n
        if isinstance(index, slice):
            start, stop, step = index.indices(n)
            if step == 1:
                return slice(self.start_row + start, self.start_row + max(start, stop))
            return self.start_row + np.arange(start, stop, step)
        rows = np.asarray(index.cpu() if torch.is_tensor(index) else index)
        if rows.dtype == bool:
            rows = np.flatnonzero(rows)
        if rows.dtype.kind not in "iu":
            raise IndexError(f"rows must be indexed by ints, a slice or an int array, not {rows.dtype}")
        if rows.size and (rows.min() < -n or rows.max() >= n):
            raise IndexError(f"row indices must be in -{n}..{n - 1}")
        return self.start_row + (rows % n if n else rows)

    def __getitem__(self, index):
        columns = None
        if isinstance(index, tuple):
            if len(index) > 2:
                raise IndexError(f"too many indices for rows of shape {tuple(self.shape)}: {len(index)}")
            index, columns = index if len(index) == 2 else (index[0], None)
        rows = self._file_rows(index)
        try:
            block = self._read(rows).astype(np.int64)
        except OSError as e:  # which file and rows, wherever it surfaces (a loader's thread hands it on)
            raise OSError(f"reading rows {rows} of {self.path}: {e}") from e
        block[block == IGNORE_U32] = IGNORE_INDEX
        out = torch.from_numpy(block)
        if columns is None:
            return out
        return out[columns] if out.dim() == 1 else out[:, columns]


def split_rows(n, val_fraction=0.1):
    """(training rows, held-out rows): the last `val_fraction` of n rows is held out (at least one)."""
    train = int(n * (1 - val_fraction))
    if val_fraction > 0 and train == n:
        train = n - 1
    if train < 1 or (val_fraction > 0 and n - train < 1):
        raise ValueError(f"{n} rows cannot be split into training and held-out rows (val_fraction="
                         f"{val_fraction}); use more data or a shorter seq_len")
    return train, n - train


def token_rows(path, seq_len, val_fraction=0.1):
    """(train, val) TokenRows of a token file: its rows of seq_len ids, the last `val_fraction` held out."""
    train, val = split_rows(TokenRows(path, seq_len).n_rows, val_fraction)
    return TokenRows(path, seq_len, 0, train), TokenRows(path, seq_len, train, val)


# --- Supervised fine-tuning (SFT) -------------------------------------------------------------

def _check_messages(messages, where):
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: 'messages' must be a non-empty list of {{\"role\", \"content\"}} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"{where}: message {i} must be an object with string 'role' and 'content', not "
                             f"{json.dumps(m)[:200]}")
    if messages[0]["role"] == "assistant":
        raise ValueError(f"{where}: message 0 is the assistant's; a conversation starts with a system or user "
                         f"message (the prompt the assistant answers)")


def sft_example(tokenizer, messages, where="conversation"):
    """(ids, labels) of one conversation rendered with the tokenizer's chat template: labels are the
    ids on the assistant's tokens (each reply and the end token the template writes after it,
    e.g. <|eot_id|>) and IGNORE_INDEX elsewhere (system and user turns, the role headers, BOS).
    Hugging Face's LlamaForCausalLM shifts the labels itself: pass labels aligned with the ids.

    The assistant's tokens are found by rendering the conversation prefix by prefix: reply k
    spans the characters from the end of the first k messages rendered with the generation
    prompt (the assistant header) to the end of the first k + 1 messages; a token is the
    assistant's if it starts inside such a span (offsets from the fast tokenizer). This works
    with any template, e.g. Meta's Llama 3 templates, which have no {% generation %} markers
    (`return_assistant_tokens_mask` needs them); it costs two renders per reply and one
    tokenization of the whole (diffing token counts of prefixes would tokenize every prefix, and
    assume a prefix's tokens are a prefix of the whole's). It checks that each prefix renders as
    a prefix of the whole: a template that rewrites earlier turns (e.g. drops old reasoning) is
    refused with a ValueError naming the message.
    """
    _check_messages(messages, where)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{where}: the tokenizer has no chat template; SFT data needs one (a chat model's "
                         f"tokenizer, or small_tokenizer())")
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(f"{where}: SFT needs a fast tokenizer (one with tokenizer.json), whose character offsets "
                         f"locate the assistant's tokens; {type(tokenizer).__name__} has none")
    render = lambda msgs, prompt: tokenizer.apply_chat_template(msgs, tokenize=False,  # noqa: E731
                                                               add_generation_prompt=prompt)
    text, spans = render(messages, False), []
    for k, m in enumerate(messages):
        if m["role"] == "assistant":
            start, end = render(messages[:k], True), render(messages[:k + 1], False)
            if not (text.startswith(start) and text.startswith(end)):
                raise ValueError(f"{where}: the chat template renders messages 0..{k} differently on their own "
                                 f"than inside the whole conversation, so the assistant's tokens of message {k} "
                                 f"cannot be located")
            spans.append((len(start), len(end)))
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    starts = np.asarray([s for s, _ in enc["offset_mapping"]], dtype=np.int64)
    assistant = np.zeros(len(starts), dtype=bool)
    for s, e in spans:
        assistant |= (starts >= s) & (starts < e)
    ids = np.asarray(enc["input_ids"], dtype=np.int64)
    return ids, np.where(assistant, ids, IGNORE_INDEX)


def _sft_examples(data, tokenizer, seq_len, long, stats):
    """(ids, labels) of each conversation of a JSONL file that fits in seq_len (or is cut to it); counts in `stats`."""
    for n, record in _jsonl(data):
        stats["conversations"] += 1
        where = f"{data} line {n}"
        if "messages" not in record:
            raise ValueError(f"{where}: no field 'messages' (its fields: {', '.join(map(repr, record)) or 'none'}); "
                             f"each line must be an object with 'messages': [{{\"role\", \"content\"}}, ...]")
        ids, labels = sft_example(tokenizer, record["messages"], where)
        if len(ids) > seq_len:
            stats["longest"] = max(stats["longest"], len(ids))
            if long == "drop":
                stats["dropped_too_long"] += 1
                continue
            stats["truncated"] += 1
            ids, labels = ids[:seq_len], labels[:seq_len]
        if not (labels[1:] != IGNORE_INDEX).any():  # position 0 predicts nothing (the labels shift)
            stats["dropped_no_assistant"] += 1
            continue
        yield ids, labels


def pack_next_fit(examples, seq_len):
    """Lists of examples (ids, labels) whose lengths add up to at most seq_len, in order: each joins
    the row being filled if it fits, else starts the next (next-fit: one pass, no reordering)."""
    row, used = [], 0
    for example in examples:
        if row and used + len(example[0]) > seq_len:
            yield row
            row, used = [], 0
        row.append(example)
        used += len(example[0])
    if row:
        yield row


def sft_row(examples, seq_len, pad, packed=False):
    """One SFT file row of the conversations `examples` [(ids, labels), ...], which fit in seq_len
    together, right-padded with `pad`: (2 * seq_len,) uint32, ids then labels; packed: (4 * seq_len,),
    then each token's segment (its conversation's index in the row) and its position in it.

    A packed row's conversations do not learn across their boundaries: each starts with a token
    whose label is ignored (BOS or a header, never the assistant's), so no token of one predicts
    the next one's first. The padding is one more segment, so that no conversation reads it."""
    row = np.zeros((SFT_COLUMNS[packed], seq_len), dtype=TOKEN_DTYPE)
    row[0], row[1] = pad, IGNORE_U32
    start = 0
    for segment, (ids, labels) in enumerate(examples):
        end = start + len(ids)
        row[0, start:end] = ids
        row[1, start:end] = np.where(labels == IGNORE_INDEX, IGNORE_U32, labels)
        if packed:
            row[2, start:end], row[3, start:end] = segment, np.arange(len(ids))
        start = end
    if packed:
        row[2, start:], row[3, start:] = len(examples), np.arange(seq_len - start)
    return row.reshape(-1)


def _sft_rows(data, tokenizer, seq_len, long, stats, packed=False):
    """Rows (`sft_row`) of the conversations of a JSONL file: one per row, or packed next-fit; counts in `stats`."""
    _, _, pad = special_ids(tokenizer)
    examples = _sft_examples(data, tokenizer, seq_len, long, stats)
    for batch in _batches(pack_next_fit(examples, seq_len) if packed else ([e] for e in examples), BATCH_DOCS):
        stats["rows"] += len(batch)
        stats["conversation_tokens"] += sum(len(ids) for group in batch for ids, _ in group)
        yield np.concatenate([sft_row(group, seq_len, pad, packed) for group in batch])


def sft_file(data, tokenizer, seq_len, directory=None, *, long="drop", packed=False, lead=True, wait=None,
             share=None):
    """The path (or URL) of the SFT rows of a JSONL file of conversations ("messages": [{"role",
    "content"}, ...] per line), written once to `directory/sft-<sha>.u32` as `token_file` writes
    (same atomic write, lead / wait / share and folder rules; <sha> also covers the chat template,
    seq_len, `long` and `packed`). Read it with `sft_rows`.

    Not packed: each conversation is one row (`sft_example`), right-padded to seq_len with the pad
    id (labels IGNORE_INDEX; causal attention keeps the real tokens from seeing the padding, so
    no attention mask is needed), and the padding is compute spent on nothing. Packed: as many
    conversations per row as fit in order (`pack_next_fit`), each with its segment id and its
    positions from 0 (`sft_row`), for attention that keeps segments apart (`attention.py`'s
    blockwise and flash: eager attention cannot, the segment ids would need a (bsz, 1, seq_len,
    seq_len) mask per step) and RoPE that starts each conversation at position 0, so each
    conversation's loss is what it is alone in a row.

    A conversation longer than seq_len is dropped (long="drop", the default: a cut row loses the
    end of its last reply with its end token, and cutting only ever hits the longest replies) or
    cut to seq_len (long="truncate"); conversations left with no assistant token are dropped. A
    warning gives the counts, which the meta (`file_meta`) keeps, with the rows written and the
    tokens of their conversations.
    """
    if long not in ("drop", "truncate"):
        raise ValueError(f"long={long!r} must be 'drop' or 'truncate'")
    tok_sha = tokenizer_sha(tokenizer, chat=True)
    fmt = SFT_PACKED_FORMAT if packed else SFT_FORMAT

    check = lambda: _check_file(data, what="SFT file", fix="pass a JSONL file with 'messages' per line")  # noqa: E731
    name, wait = _named(directory, lead, share, data, wait, check, "sft", fmt, tok_sha, seq_len, long)
    stats = dict(conversations=0, rows=0, conversation_tokens=0, dropped_too_long=0, truncated=0,
                 dropped_no_assistant=0, longest=0)
    meta = {"format": fmt, "data": str(data), "seq_len": seq_len, "long": long, "tokenizer_sha256": tok_sha}

    def counted():  # runs once every row is written, before the file is renamed into place
        if stats["rows"] == 0:
            raise ValueError(f"{data}: none of its {stats['conversations']} conversations fits in seq_len={seq_len} "
                             f"with an assistant token ({stats}); pass a larger seq_len")
        meta.update(stats)

    def write(path):
        _write_atomic(path, _then(_sft_rows(data, tokenizer, seq_len, long, stats, packed), counted), meta)
        if stats["dropped_too_long"] or stats["truncated"]:
            what = "dropped" if long == "drop" else "truncated"
            warnings.warn(f"{data}: {what} {stats['dropped_too_long'] + stats['truncated']} of "
                          f"{stats['conversations']} conversations longer than seq_len={seq_len} tokens (the "
                          f"longest has {stats['longest']}); pass a larger seq_len"
                          + (" or long='truncate'" if long == "drop" else ""), stacklevel=4)

    return _place(directory, name, write, lead, wait)


def _then(iterable, done):
    """The items of `iterable`, then a call of `done()` (once every item has been produced)."""
    yield from iterable
    done()


def sft_rows(path, seq_len, val_fraction=0.1):
    """The columns of an SFT file as TokenRows, (train, val): (ids, labels), and for a packed file
    (its meta says) (ids, labels, segment ids, positions); the last `val_fraction` of the rows are
    held out."""
    columns = SFT_COLUMNS[file_meta(path)["format"] == SFT_PACKED_FORMAT]
    stride = columns * seq_len
    train, val = split_rows(TokenRows(path, seq_len, stride=stride).n_rows, val_fraction)
    part = lambda start, n: tuple(TokenRows(path, seq_len, start, n, stride=stride, column=c * seq_len)  # noqa: E731
                                  for c in range(columns))
    return part(0, train), part(train, val)


# --- Everything a training loop needs ---------------------------------------------------------

def training_data(seq_len, tokenizer=None, data=None, sft=None, directory=None, *, val_fraction=0.1,
                  lead=True, wait=None, long="drop", packed=False, share=None):
    """(train, val) TensorDatasets of TokenRows for `sharded_loader`.

    Pretraining (data: None for the pydoc corpus, a text file or a .jsonl file): each dataset
    holds one (n, seq_len) tensor of ids; the labels are the ids. SFT (sft: a .jsonl file of
    conversations; not with data): two, (ids, labels), to pass as model(input_ids=ids,
    labels=labels); packed (`sft_file`), four: (ids, labels, segment ids, positions).
    tokenizer: a loaded one, a folder, or None for the byte tokenizer.
    directory: where the token file goes (the checkpoint_dir; None: a temporary folder).
    lead, wait, share: on a pod, process 0 names and writes the file (lead), the others wait for it
    (`token_file`); with `share`, only process 0 needs the data.
    """
    if tokenizer is None or isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = get_tokenizer(tokenizer)
    if sft is not None:
        if data is not None:
            raise ValueError("pass data (pretraining text) or sft (conversations), not both")
        train, val = sft_rows(sft_file(sft, tokenizer, seq_len, directory, long=long, packed=packed, lead=lead,
                                       wait=wait, share=share), seq_len, val_fraction)
        return TensorDataset(*train), TensorDataset(*val)
    train, val = token_rows(token_file(data, tokenizer, directory, lead=lead, wait=wait, share=share), seq_len,
                            val_fraction)
    return TensorDataset(train), TensorDataset(val)


# --- Conversations for SFT, from text that ships with Python ----------------------------------

QUESTIONS = ("What is the Python topic {topic!r} about?", "Explain {topic!r} in Python briefly.",
             "What does the Python reference say about {topic!r}?")
SYSTEM = "You answer questions about Python from its language reference."


def _summary(text, sentences=2, limit=400):
    """The first sentences of a pydoc topic's first paragraph of prose (its title if it has none)."""
    paragraphs = text.split("\n\n")
    for p in paragraphs[1:]:
        lines = p.strip("\n").split("\n")
        if (not lines[0] or lines[0][0].isspace() or set(lines[-1]) <= set("=-*~^")
                or re.match(r"(New|Changed|Added|Deprecated) in version", lines[0])):
            continue  # code or grammar, a heading, a version note
        prose = " ".join(line.strip() for line in lines)
        out = re.sub(r":$", ".", " ".join(re.split(r"(?<=[.!?])\s+", prose)[:sentences]))  # "...:" led into code
        return out if len(out) <= limit else out[:out.rfind(" ", 0, limit)] + " ..."
    return paragraphs[0].split("\n")[0]


def sft_conversations(n):
    """n conversations about the pydoc topics, deterministic: conversation i asks about topic
    i % 79 (with one of three phrasings, by i // 79) and the assistant answers with the first
    sentences of its text. Every 4th has a system message first, every 3rd a second question
    (about the next topic) and answer."""
    from pydoc_data.topics import topics
    keys = sorted(topics)
    out = []
    for i in range(n):
        messages = [{"role": "system", "content": SYSTEM}] if i % 4 == 3 else []
        for j in range(1 + (i % 3 == 2)):
            key = keys[(i + j) % len(keys)]
            question = QUESTIONS[(i // len(keys) + j) % len(QUESTIONS)].format(topic=key)
            messages += [{"role": "user", "content": question}, {"role": "assistant", "content": _summary(topics[key])}]
        out.append({"messages": messages})
    return out


def write_jsonl(path, records):
    """Write records (dicts), one JSON object a line, UTF-8; returns path."""
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    return path


# --- Command line: tokenize before a pod's run ------------------------------------------------

def main(argv=None):
    """`python -m llama_xla_helpers.data --checkpoint-dir DIR [--tokenizer T] [--data F | --sft F --seq-len N]`:
    write the token (or SFT) file a run with these flags reads, on this host alone, and print its path."""
    from .cli import ArgumentParser, user_errors
    parser = ArgumentParser(prog="python -m llama_xla_helpers.data",
                            description="Tokenize a run's data into its checkpoint folder before the run (on a pod: "
                                        "on one host, so that no host waits for process 0 to tokenize).")
    parser.add_argument("--checkpoint-dir", required=True, help="the run's --checkpoint-dir (gs:// or shared)")
    parser.add_argument("--tokenizer", help="the run's tokenizer folder: its --tokenizer, or its --init-from folder "
                                            "if that holds the tokenizer (default: the byte tokenizer)")
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--data", help="the run's --data: a UTF-8 text file or a .jsonl file (default: the pydoc corpus)")
    what.add_argument("--sft", help="the run's --sft: a JSONL file of conversations (needs --seq-len)")
    parser.add_argument("--seq-len", type=int, help="the run's --seq-len (--sft only: an SFT row is seq_len long)")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an input error")
    args = parser.parse_args(argv)
    if args.sft and args.seq_len is None:
        parser.error("--sft needs the run's --seq-len")
    with user_errors(args.debug):
        tokenizer = get_tokenizer(args.tokenizer)
        path = (sft_file(args.sft, tokenizer, args.seq_len, args.checkpoint_dir) if args.sft
                else token_file(args.data, tokenizer, args.checkpoint_dir))
    print(f"{path}: {file_meta(path)['tokens']:,} tokens")


if __name__ == "__main__":
    main()
