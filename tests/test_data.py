"""data.py: token files read through np.memmap or by byte ranges, the wait for process 0's file on a
pod, JSONL documents and SFT rows (CPU only, but one test that feeds TokenRows to sharded_loader).
The tokenizers' tests are in test_tokenizer.py."""
import json
import os
import pickle
import re
import tempfile
import threading
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset
from transformers import LlamaConfig, LlamaForCausalLM

from llama_xla_helpers import data
from llama_xla_helpers.data import (IGNORE_INDEX, TokenRows, encode_document, file_meta, load_corpus, sft_conversations,
                                    sft_example, sft_file, sft_rows, token_file, token_rows, training_data, write_jsonl)
from llama_xla_helpers.tokenizer import ByteTokenizer, small_tokenizer, tokenizer_and_config

TOKEN_FILE = re.compile(r"tokens-[0-9a-f]{16}\.u32")


@pytest.fixture(scope="module")
def tok():
    return small_tokenizer()


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(load_corpus()[:30_000], encoding="utf-8")
    return path


@pytest.fixture(autouse=True)
def own_temp_dir(tmp_path, monkeypatch):
    """Token files without a directory (and local copies of gs:// ones) go to this test's folder."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "systemp"))
    os.makedirs(tmp_path / "systemp")


def flat(rows):
    return rows[:].flatten().tolist()


# --- Token files ------------------------------------------------------------------------------

def test_token_file_is_written_once_and_its_rows_are_the_encoding(tok, text_file, tmp_path, monkeypatch):
    path = token_file(text_file, tok, tmp_path / "ck")
    assert TOKEN_FILE.fullmatch(path.name) and path.parent == tmp_path / "ck"
    text = text_file.read_text(encoding="utf-8")
    want = tok.encode(text) + [tok.eos_token_id]  # BOS (encode adds it), the text, EOS
    assert want == encode_document(tok, text) and file_meta(path)["tokens"] == len(want)
    train, val = token_rows(path, 32)
    n = len(want) // 32
    assert (len(train), len(val)) == (int(n * 0.9), n - int(n * 0.9)) and train.shape == (len(train), 32)
    assert flat(train) + flat(val) == want[:n * 32]  # read through the memmap
    assert train.dtype == train[0].dtype == torch.int64

    mtime = path.stat().st_mtime_ns

    def no_tokenizing(*args):
        raise AssertionError("tokenized again")
    with monkeypatch.context() as m:
        m.setattr(data, "_encode_plain", no_tokenizing)
        assert token_file(text_file, tok, tmp_path / "ck") == path and path.stat().st_mtime_ns == mtime
    # another tokenizer, another text or a copy of the text elsewhere: the name follows the bytes
    byte_path, byte_ids = token_file(text_file, ByteTokenizer(), tmp_path / "ck"), ByteTokenizer().encode(text, eos=True)
    assert byte_path != path and flat(TokenRows(byte_path, 64)) == byte_ids[:len(byte_ids) // 64 * 64]
    copy = tmp_path / "copy.txt"
    copy.write_bytes(text_file.read_bytes())
    assert token_file(copy, tok, tmp_path / "ck") == path
    copy.write_text(text + "!", encoding="utf-8")
    assert token_file(copy, tok, tmp_path / "ck") != path
    # no directory: a folder of the system's temporary folder
    assert token_file(text_file, tok).parent == tmp_path / "systemp" / data.CACHE_DIR


def test_text_in_pieces_encodes_like_the_whole_text(tok, text_file, tmp_path):
    pieces = list(data._text_pieces(text_file, 1000))
    assert len(pieces) > 25 and "".join(pieces) == text_file.read_text(encoding="utf-8")
    whole, cut = token_file(text_file, tok, tmp_path), token_file(text_file, tok, tmp_path, piece_chars=1000)
    assert whole != cut and whole.read_bytes() == cut.read_bytes()


def test_a_failed_write_leaves_no_token_file(tok, text_file, tmp_path, monkeypatch):
    encode, calls = data._encode_plain, []

    class Crash(BaseException):  # not an Exception: as a Ctrl+C, or the job being stopped, halfway through
        pass

    def crash_on_third_piece(tokenizer, texts):
        calls.append(1)
        if len(calls) == 3:
            raise Crash
        return encode(tokenizer, texts)
    with monkeypatch.context() as m, pytest.raises(Crash):
        m.setattr(data, "_encode_plain", crash_on_third_piece)
        token_file(text_file, tok, tmp_path / "ck", piece_chars=1000)
    assert len(calls) == 3 and list((tmp_path / "ck").iterdir()) == []  # not even the temporary file
    # a process killed mid-write leaves its temporary file, under a name that is never read
    path = token_file(text_file, tok, tmp_path / "good", piece_chars=1000)
    (tmp_path / "ck" / f".{path.name}.12345.deadbeef.tmp").write_bytes(path.read_bytes()[:1000])
    assert token_file(text_file, tok, tmp_path / "ck", piece_chars=1000).read_bytes() == path.read_bytes()
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == sorted(
        [f".{path.name}.12345.deadbeef.tmp", path.name, path.name + ".json"])


def test_hosts_other_than_the_lead_wait_for_the_lead_s_file(tok, text_file, tmp_path, monkeypatch):
    monkeypatch.setattr(data, "POLL_S", 0.05)
    started = time.monotonic()
    with pytest.raises(FileNotFoundError, match="does not exist on this host after 1 s of waiting for process 0 to "
                                                "write it: the token folder must be one that every host sees.*"
                                                "tokenize first, on one host: python -m llama_xla_helpers.data"):
        token_file(text_file, tok, tmp_path / "own-disk", lead=False, wait=1)
    assert time.monotonic() - started >= 1
    # a host that starts waiting before the lead has written the file reads it once it is there
    got = []
    other = threading.Thread(target=lambda: got.append(token_file(text_file, tok, tmp_path / "shared", lead=False,
                                                                   wait=60)))
    other.start()
    time.sleep(0.3)
    assert other.is_alive() and not (tmp_path / "shared").exists()
    path = token_file(text_file, tok, tmp_path / "shared")  # the lead tokenizes
    other.join(10)
    assert got == [path] and not other.is_alive()
    # by default a host waits 30 minutes plus a second per MiB of the data file
    waits = []
    monkeypatch.setattr(data, "_wait_for", lambda there, where, wait: waits.append(wait))
    token_file(text_file, tok, tmp_path / "shared", lead=False)
    token_file(text_file, tok, tmp_path / "shared")
    assert waits == [30 * 60 + text_file.stat().st_size / 2**20, 0] == [data.wait_seconds(text_file), 0]


def range_log(fs, monkeypatch):
    """A list to which every cat_file of `fs` (what cat_ranges calls) adds (path, start, end)."""
    reads, cat_file = [], fs.cat_file

    def logged(path, start=None, end=None, **kwargs):
        reads.append((path, start, end))
        return cat_file(path, start, end, **kwargs)
    monkeypatch.setattr(fs, "cat_file", logged)
    return reads


def test_a_gs_folder_s_token_file_is_read_by_the_byte_ranges_of_each_host_s_rows(tok, text_file, tmp_path,
                                                                                 monkeypatch):
    """A gs:// checkpoint_dir, here fsspec's in-memory file system: the lead uploads the token file,
    every host gets its URL and reads the rows it indexes, consecutive ones as one range, no other
    byte, and no host downloads it."""
    import fsspec
    url = f"memory://{tmp_path.name}/run"
    path = token_file(text_file, tok, url)
    local = token_file(text_file, tok, tmp_path / "local")
    assert path == f"{url}/{local.name}" and file_meta(path) == file_meta(local)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "other-host"))  # another host: nothing local
    os.makedirs(tmp_path / "other-host")
    assert token_file(text_file, tok, url, lead=False, wait=0) == path
    assert list((tmp_path / "other-host").iterdir()) == []
    reads = range_log(fsspec.filesystem("memory"), monkeypatch)  # the instance url_to_fs returns
    rows, want = token_rows(path, 32, val_fraction=0)[0], TokenRows(local, 32)[:]
    assert rows.shape == want.shape and len(rows) > 200
    ranges = [[(7, 8), (3, 5), (150, 151)], [(40, 43)], [(5, 6)]]  # rows start..stop, 128 bytes a row: 32 ids
    for host, mine in enumerate((torch.tensor([7, 3, 4, 150]), slice(40, 43), 5)):  # each host's rows of a batch
        reads.clear()
        assert torch.equal(rows[mine], want[mine]), host
        assert reads == [(f"/{tmp_path.name}/run/{local.name}", a * 128, b * 128) for a, b in ranges[host]], host
    sft = write_jsonl(tmp_path / "chat.jsonl", sft_conversations(12))
    (ids, labels), _ = sft_rows(sft_file(sft, tok, 320, url), 320)  # rows of 640: ids, then labels
    reads.clear()
    assert ids[2].shape == labels[2].shape == (320,)  # each reads its half of row 2, 2560 bytes a row
    assert [(s, e) for _, s, e in reads] == [(2 * 2560, 2 * 2560 + 1280), (2 * 2560 + 1280, 3 * 2560)]
    reads.clear()  # rows 2 and 3 of the labels: one range, over row 3's ids between them
    assert torch.equal(labels[2:4], torch.stack([labels[2], labels[3]]))
    assert [(s, e) for _, s, e in reads][0] == (2 * 2560 + 1280, 4 * 2560)
    assert torch.equal(pickle.loads(pickle.dumps(rows))[5], want[5])  # a DataLoader worker reopens the URL


def test_tokenize_first_on_one_host_then_a_pod_s_hosts_only_read(tok, text_file, tmp_path, monkeypatch, capsys):
    """The command the wait's error gives writes the file that a run with the same flags reads, on
    every host: here train.datasets on a faked second host of two, which would otherwise wait.
    Process 0's part is faked too: what it sends (`checkpoint.lead_value`; two real gloo processes:
    tests/test_train.py), the name of the same data's file and a wait of 0.2 s, and no error."""
    from llama_xla_helpers import checkpoint, train
    tok.save_pretrained(tmp_path / "tok")
    cfg = train.TrainConfig(tokenizer=str(tmp_path / "tok"), data=str(text_file), seq_len=32,
                            checkpoint_dir=str(tmp_path / "ck"))
    name = token_file(text_file, tok, tmp_path / "elsewhere").name
    offered = []
    monkeypatch.setattr(checkpoint, "lead_value", lambda mine: offered.append(mine) or ((name, 0.2), None))
    monkeypatch.setattr(train.xr, "process_index", lambda: 1)
    monkeypatch.setattr(train.xr, "process_count", lambda: 2)
    with pytest.raises(FileNotFoundError, match="tokenize first, on one host"):
        train.datasets(cfg, train.hf_tokenizer(cfg))
    data.main(["--checkpoint-dir", cfg.checkpoint_dir, "--tokenizer", cfg.tokenizer, "--data", cfg.data])
    path = token_file(text_file, train.hf_tokenizer(cfg), tmp_path / "ck")  # there: tokenizes nothing
    assert capsys.readouterr().out == f"{path}: {file_meta(path)['tokens']:,} tokens\n"
    (train_ids,), (val_ids,) = train.datasets(cfg, train.hf_tokenizer(cfg))
    assert (train_ids.path, val_ids.path) == (str(path),) * 2 and len(train_ids) + len(val_ids) == len(
        TokenRows(path, 32))
    assert offered == [None, None]  # host 1 named nothing itself
    with pytest.raises(SystemExit) as stop:
        data.main(["--checkpoint-dir", cfg.checkpoint_dir, "--sft", cfg.data])
    assert stop.value.code == 2 and "error: --sft needs the run's --seq-len" in capsys.readouterr().err


def test_token_rows_index_like_a_tensor(tmp_path):
    path = tmp_path / "t.u32"
    np.arange(10 * 8 + 5, dtype="<u4").tofile(path)  # 10 rows of 8, and a tail that fills no row
    whole = torch.arange(80).view(10, 8)
    rows, t = TokenRows(path, 8, start_row=2, n_rows=5), whole[2:7]
    assert rows.shape == t.shape and rows.size(0) == len(rows) == 5 and TokenRows(path, 8).shape == (10, 8)
    batch = torch.tensor([4, 0, 3])
    for index in (0, -1, slice(None), slice(1, 4), slice(None, None, 2), batch, [1, 1], np.array([2]),
                  (slice(None), slice(2, 5)), (batch, 3), (batch[1:], slice(0, 4))):
        assert torch.equal(rows[index], t[index]), index
    assert rows[4:0:-1].tolist() == t.numpy()[4:0:-1].tolist()
    index = (slice(0, 2), slice(4, 8))  # what sharded_loader asks for one device's block
    assert torch.equal(rows[batch[index[0]]][:, index[1]], t[batch[index[0]]][:, index[1]])
    assert torch.equal(rows.rows(1, 3)[:], t[1:3])
    assert torch.equal(pickle.loads(pickle.dumps(rows))[:], t)  # a DataLoader worker reopens the file
    assert torch.equal(TensorDataset(rows)[3][0], t[3])
    with pytest.raises(IndexError, match="out of range for 5 rows"):
        rows[5]
    with pytest.raises(IndexError, match=r"in -5\.\.4"):
        rows[torch.tensor([0, 5])]
    with pytest.raises(ValueError, match="not all in"):
        TokenRows(path, 8, start_row=8, n_rows=3)


def test_sharded_loader_reads_token_rows(runtime, tmp_path):
    from llama_xla_helpers.mesh import make_mesh
    from llama_xla_helpers.sharding import sharded_loader
    path = tmp_path / "t.u32"
    np.arange(40 * 16, dtype="<u4").tofile(path)
    rows, tensor = TokenRows(path, 16), torch.arange(40 * 16).view(40, 16)
    mesh = make_mesh()  # every device on 'data': each reads its own rows of the batch
    batch = 2 * int(mesh.size())
    sampler = data.StepSampler(40, batch, seed=0, start=0, steps=2)
    got = [ids.cpu() for (ids,) in sharded_loader(TensorDataset(rows), batch, mesh, sampler=sampler)]
    want = [tensor[list(sampler)[i * batch:(i + 1) * batch]] for i in range(2)]
    assert len(got) == 2 and all(torch.equal(a, b) for a, b in zip(got, want))


# --- JSONL ------------------------------------------------------------------------------------

def test_jsonl_documents_are_joined_with_eos(tok, tmp_path):
    docs = ["The first document.", "Grüße, zweites Dokument.\nZwei Zeilen.", "3"]
    path = write_jsonl(tmp_path / "docs.jsonl", [{"text": d, "id": i} for i, d in enumerate(docs)])
    with open(path, "a") as f:
        f.write("\n   \n")  # blank lines are skipped
    want = [i for d in docs for i in tok.encode(d) + [tok.eos_token_id]]
    assert flat(TokenRows(token_file(path, tok, tmp_path), len(want))) == want
    assert data.read_documents(path) == docs
    byte = TokenRows(token_file(path, ByteTokenizer(), tmp_path), 1)
    assert flat(byte) == [i for d in docs for i in ByteTokenizer().encode(d, eos=True)]


@pytest.mark.parametrize("line, error", [
    ('{"text": "fine"', r"line 2: not valid JSON \(Expecting ',' delimiter at column 16\)"),
    ('{"body": "no text", "id": 3}', r"line 2: no field 'text' \(its fields: 'body', 'id'\)"),
    ('{"text": ["a", "list"]}', "line 2: 'text' is a JSON list, not a string"),
    ('["text"]', "line 2: a JSON list, not an object"),
])
def test_jsonl_errors_name_the_line(tok, tmp_path, line, error):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "a good line"}\n' + line + "\n")
    with pytest.raises(ValueError, match=error):
        token_file(path, tok, tmp_path / "ck")
    assert list((tmp_path / "ck").iterdir()) == []


def test_missing_and_non_utf8_data_files(tok, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist; pass a UTF-8 text file or a JSONL file"):
        token_file(tmp_path / "missing.txt", tok, tmp_path)
    path = tmp_path / "latin1.txt"
    path.write_bytes("Grüße".encode("utf-8") * 400 + "Grüße".encode("latin-1"))
    with pytest.raises(ValueError, match="is not UTF-8 text: byte 2802 is 0xfc"):
        token_file(path, tok, tmp_path / "ck", piece_chars=1000)


# --- SFT --------------------------------------------------------------------------------------

def test_sft_labels_are_the_assistant_tokens_only(tok):
    conversations = sft_conversations(12)
    assert any(c["messages"][0]["role"] == "system" for c in conversations)
    assert any(sum(m["role"] == "assistant" for m in c["messages"]) == 2 for c in conversations)
    for c in conversations:
        ids, labels = sft_example(tok, c["messages"])
        assert ids.tolist() == tok.apply_chat_template(c["messages"], return_dict=False)
        kept = labels != IGNORE_INDEX
        assert (labels[kept] == ids[kept]).all()
        replies = "".join(m["content"].strip() + "<|eot_id|>" for m in c["messages"] if m["role"] == "assistant")
        assert tok.decode(ids[kept]) == replies
        masked = tok.decode(ids[~kept])  # everything else: BOS, headers, system and user turns
        assert masked.startswith("<|begin_of_text|><|start_header_id|>") and "assistant<|end_header_id|>" in masked
        assert all(m["content"] in masked for m in c["messages"] if m["role"] != "assistant")


def test_sft_rows_pad_drop_and_hold_out(tok, tmp_path):
    path = write_jsonl(tmp_path / "chat.jsonl", sft_conversations(40))
    lengths = [len(sft_example(tok, c["messages"])[0]) for c in sft_conversations(40)]
    seq_len = sorted(lengths)[30]  # about 9 are longer than this
    kept = [c for c, n in zip(sft_conversations(40), lengths) if n <= seq_len]
    long = 40 - len(kept)
    with pytest.warns(UserWarning, match=f"dropped {long} of 40 conversations longer than seq_len={seq_len}"):
        file = sft_file(path, tok, seq_len, tmp_path / "ck")
    assert re.fullmatch(r"sft-[0-9a-f]{16}\.u32", file.name) and long > 0
    assert {k: file_meta(file)[k] for k in ("conversations", "rows", "dropped_too_long")} == dict(
        conversations=40, rows=len(kept), dropped_too_long=long)
    (ids, labels), (val_ids, val_labels) = sft_rows(file, seq_len)
    train = int(len(kept) * 0.9)
    assert (len(ids), len(val_ids)) == (train, len(kept) - train) and ids.shape == labels.shape == (train, seq_len)
    assert torch.equal(val_ids[0], sft_rows(file, seq_len, val_fraction=0)[0][0][train])
    for row in range(train):
        want_ids, want_labels = sft_example(tok, kept[row]["messages"])
        n = len(want_ids)
        assert ids[row][:n].tolist() == want_ids.tolist() and labels[row][:n].tolist() == want_labels.tolist()
        assert (ids[row][n:] == tok.pad_token_id).all() and (labels[row][n:] == IGNORE_INDEX).all()
    assert sft_file(path, tok, seq_len, tmp_path / "ck") == file  # written once
    with pytest.warns(UserWarning, match=f"truncated {long} of 40 conversations"):
        cut = sft_file(path, tok, seq_len, tmp_path / "ck", long="truncate")
    assert file_meta(cut)["truncated"] == long and file_meta(cut)["rows"] == 40
    with pytest.raises(ValueError, match="none of its 40 conversations fits in seq_len=8"):
        sft_file(path, tok, 8, tmp_path / "short")
    assert list((tmp_path / "short").iterdir()) == []


def test_packed_sft_rows_hold_every_conversation_in_order_apart(tok, tmp_path):
    path = write_jsonl(tmp_path / "chat.jsonl", sft_conversations(40))
    examples = [sft_example(tok, c["messages"]) for c in sft_conversations(40)]
    seq_len = max(len(ids) for ids, _ in examples)
    packed = sft_file(path, tok, seq_len, tmp_path, packed=True)
    assert packed != sft_file(path, tok, seq_len, tmp_path)  # the two layouts are two files
    (ids, labels, segments, positions), _ = sft_rows(packed, seq_len, val_fraction=0)
    assert file_meta(packed)["rows"] == len(ids) < 40 and file_meta(packed)["conversation_tokens"] == sum(len(i) for i, _ in examples)
    got, rows = [], []  # the conversations read back, segment by segment; their lengths, row by row
    for row in range(len(ids)):
        assert (torch.diff(segments[row]) >= 0).all()  # each segment is contiguous
        rows.append([])
        for seg in range(int(segments[row].max()) + 1):
            where = segments[row] == seg
            assert positions[row][where].tolist() == list(range(int(where.sum())))  # positions restart at 0
            if len(got) == len(examples) or len(rows[-1]) and sum(rows[-1]) + len(examples[len(got)][0]) > seq_len:
                assert (ids[row][where] == tok.pad_token_id).all() and (labels[row][where] == IGNORE_INDEX).all()
                continue  # the padding: a segment of its own
            got.append((ids[row][where].tolist(), labels[row][where].tolist()))
            rows[-1].append(len(got[-1][0]))
    assert got == [(i.tolist(), lab.tolist()) for i, lab in examples]  # every conversation, in order, whole
    assert all(sum(r) <= seq_len for r in rows)
    assert all(sum(r) + nxt[0] > seq_len for r, nxt in zip(rows, rows[1:]))  # next-fit: the next one did not fit


@pytest.mark.parametrize("record, error", [
    ({"conversation": []}, "line 1: no field 'messages'"),
    ({"messages": [{"role": "user"}]}, "line 1: message 0 must be an object with string 'role' and 'content'"),
    ({"messages": []}, "line 1: 'messages' must be a non-empty list"),
    ({"messages": [{"role": "assistant", "content": "hi"}]}, "line 1: message 0 is the assistant's"),
])
def test_sft_errors_name_the_line(tok, tmp_path, record, error):
    with pytest.raises(ValueError, match=error):
        sft_file(write_jsonl(tmp_path / "bad.jsonl", [record]), tok, 64, tmp_path)
    with pytest.raises(ValueError, match="the tokenizer has no chat template"):
        sft_example(ByteTokenizer(), [{"role": "user", "content": "hi"}])


def test_hf_loss_with_sft_labels_is_the_mean_over_assistant_tokens(tok, tmp_path):
    seq_len = 320
    path = write_jsonl(tmp_path / "chat.jsonl", sft_conversations(6))
    (ids, labels), _ = sft_rows(sft_file(path, tok, seq_len, tmp_path), seq_len, val_fraction=0)
    ids, labels = ids[:4], labels[:4]
    _, config = tokenizer_and_config(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                 num_attention_heads=2, num_key_value_heads=2), tok)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    out = model(input_ids=ids, labels=labels)
    out.logits.retain_grad()
    out.loss.backward()
    scored = labels[:, 1:] != IGNORE_INDEX  # position t predicts token t + 1
    per_token = F.cross_entropy(out.logits[:, :-1].reshape(-1, config.vocab_size).float(), ids[:, 1:].reshape(-1),
                                reduction="none").view(scored.shape)
    torch.testing.assert_close(out.loss, per_token[scored].mean())
    assert scored.any() and (~scored).any()
    grad = out.logits.grad.abs().sum(-1)  # (bsz, seqlen): d loss / d logits at each position
    assert (grad[:, :-1][~scored] == 0).all() and (grad[:, -1] == 0).all()
    assert (grad[:, :-1][scored] > 0).all()


def test_sft_conversations_are_deterministic(tmp_path):
    a, b = sft_conversations(200), sft_conversations(200)
    assert a == b and len({json.dumps(c) for c in a}) == 200
    for c in a:
        for m in c["messages"]:
            assert m["content"] and "::=" not in m["content"] and "\n" not in m["content"]
    path = write_jsonl(tmp_path / "c.jsonl", a[:3])
    assert [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()] == a[:3]


def test_training_data_for_pretraining_and_sft(tok, text_file, tmp_path):
    train, val = training_data(32, tok, data=text_file, directory=tmp_path)
    assert len(train.tensors) == 1 and isinstance(train.tensors[0], TokenRows) and len(val) > 0
    chat = write_jsonl(tmp_path / "chat.jsonl", sft_conversations(20))
    train, val = training_data(320, tok, sft=chat, directory=tmp_path)
    assert [t.shape for t in train.tensors] == [(18, 320)] * 2 and len(val) == 2
    ids, labels = train[0]
    assert ids.shape == labels.shape == (320,) and (labels == IGNORE_INDEX).any()
    byte_train, _ = training_data(64, None, directory=tmp_path)  # the byte tokenizer on the pydoc corpus
    assert byte_train.tensors[0][0][:4].tolist() == ByteTokenizer().encode(load_corpus()[:3])
    with pytest.raises(ValueError, match="not both"):
        training_data(32, tok, data=text_file, sft=chat)
