import contextlib
import errno
import hashlib
import json
import os
import pickle
import subprocess
import sys

import fsspec
import pytest
import torch
from safetensors.torch import load_file
from transformers.utils import logging as hf_logging
import torch_xla
import torch_xla.runtime as xr
from util import hf_model

from llama_xla_helpers import checkpoint
from llama_xla_helpers.checkpoint import checkpoints, export_hf, init_optimizer_state, latest, load, load_hf, save
from llama_xla_helpers.configs import get_config
from llama_xla_helpers.mesh import make_mesh
from llama_xla_helpers.sharding import shard_activations, shard_params
from llama_xla_helpers.train import Adafactor

pytestmark = pytest.mark.fixed_dtype  # no test here reads the default dtype (conftest checks)

spec = torch_xla._XLAC._get_xla_sharding_spec


@pytest.fixture(scope="module")
def mesh(runtime):
    return make_mesh((4, 2))


def sharded(mesh, seed=0, **overrides):
    model = hf_model(get_config("tiny", num_hidden_layers=2, **overrides), seed)
    shard_params(model, mesh, "2d")
    return model


def train_step(model, optimizer, seed):
    ids = torch.randint(0, 264, (8, 16), generator=torch.Generator().manual_seed(seed)).to(torch_xla.device())
    loss = model(ids, labels=ids).loss
    loss.backward()
    # Materialize the gradients: torch.optim.Adafactor calls .item() once per parameter, and each
    # would otherwise compile the whole forward + backward again.
    torch_xla.sync()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    torch_xla.sync()
    return loss.item()


def tensors(model, optimizer):
    """Every parameter and optimizer state tensor, by name."""
    out = dict(model.named_parameters())
    for i, p in enumerate(model.parameters()):
        out.update({f"state.{i}.{k}": v for k, v in optimizer.state[p].items()})
    return out


def on_cpu(named):
    return {n: t.detach().cpu().clone() for n, t in named.items()}


def shardings(named):
    return {n: spec(t) for n, t in named.items() if t.device.type == "xla"}


def test_round_trip_restores_model_and_adafactor_state(mesh, tmp_path):
    model = sharded(mesh)
    opt = torch.optim.Adafactor(model.parameters(), lr=1e-2)
    for seed in (1, 2):
        train_step(model, opt, seed)
    path = save(tmp_path, 2, model, opt, extra=dict(seed=0, position=16))
    assert path == latest(tmp_path) == tmp_path / "step_00000002"
    saved = on_cpu(tensors(model, opt))

    fresh = sharded(mesh, seed=1)
    fresh_opt = torch.optim.Adafactor(fresh.parameters(), lr=1e-2)
    with pytest.raises(ValueError, match="init_optimizer_state"):
        load(tmp_path, fresh, fresh_opt)  # no state yet to load into
    init_optimizer_state(fresh_opt)
    before = shardings(tensors(fresh, fresh_opt))
    meta = load(tmp_path, fresh, fresh_opt)

    assert (meta["step"], meta["extra"]) == (2, dict(seed=0, position=16))
    loaded = tensors(fresh, fresh_opt)
    assert loaded.keys() == saved.keys() and len(fresh_opt.state) == len(list(fresh.parameters()))
    for name, t in on_cpu(loaded).items():
        assert torch.equal(t, saved[name]), name
    assert shardings(loaded) == before
    assert train_step(fresh, fresh_opt, 3) == train_step(model, opt, 3)
    # The primed state may be laid out differently from the trained one (the compiler picks the
    # sharding of tensors created inside a step), so the update's float sums may differ in order.
    for name, t in on_cpu(tensors(fresh, fresh_opt)).items():
        torch.testing.assert_close(t, tensors(model, opt)[name].detach().cpu(), rtol=1e-5, atol=1e-7, msg=name)


def test_load_keeps_the_fp32_optimizer_state_of_bf16_parameters(mesh, tmp_path):
    """torch's Optimizer.load_state_dict casts state to the parameter's dtype: loading must not."""
    def bf16_model(seed):
        model = hf_model(get_config("tiny", num_hidden_layers=2), seed).to(torch.bfloat16)
        shard_params(model, mesh, "2d")
        return model

    model = bf16_model(0)
    opt = Adafactor(model.parameters(), lr=1e-2)  # fp32 factors and fp32 master weights
    for seed in (1, 2):
        train_step(model, opt, seed)
    save(tmp_path, 2, model, opt)
    saved = on_cpu(tensors(model, opt))
    state = {name.rsplit(".", 1)[1]: t.dtype for name, t in saved.items() if name.startswith("state.")}
    assert state["row"] == state["master"] == torch.float32

    fresh = bf16_model(1)
    fresh_opt = init_optimizer_state(Adafactor(fresh.parameters(), lr=1e-2))
    load(tmp_path, fresh, fresh_opt)
    for name, t in on_cpu(tensors(fresh, fresh_opt)).items():
        assert t.dtype == saved[name].dtype and torch.equal(t, saved[name]), name


def test_load_into_another_config_names_the_tensor_and_changes_nothing(mesh, tmp_path):
    save(tmp_path, 1, sharded(mesh))
    other = sharded(mesh, intermediate_size=256)
    before = on_cpu(dict(other.named_parameters()))
    with pytest.raises(ValueError, match=r"model\.model\.layers\.0\.mlp\.gate_proj\.weight.*\(384, 128\).*"
                                         r"\(256, 128\).*different model config"):
        load(tmp_path, other)
    for name, t in on_cpu(dict(other.named_parameters())).items():
        assert torch.equal(t, before[name]), name
    with pytest.raises(ValueError, match="holds no optimizer state"):
        load(tmp_path, other, torch.optim.Adafactor(other.parameters()))


def test_failed_save_keeps_previous_checkpoint(mesh, tmp_path, monkeypatch):
    model = sharded(mesh)
    first = save(tmp_path, 1, model)
    real_save = checkpoint.dcp.save

    def crash(*args, **kwargs):  # every shard written, then killed before meta.json and the rename
        real_save(*args, **kwargs)
        raise RuntimeError("killed mid-save")

    monkeypatch.setattr(checkpoint.dcp, "save", crash)
    with pytest.raises(RuntimeError, match="killed"):
        save(tmp_path, 2, model)
    assert latest(tmp_path) == first
    assert [n for n in os.listdir(tmp_path) if n.startswith("step_")] == ["step_00000001"]
    assert load(tmp_path, sharded(mesh, seed=1))["step"] == 1
    monkeypatch.undo()
    second = save(tmp_path, 2, model)
    assert latest(tmp_path) == second
    assert sorted(os.listdir(tmp_path)) == ["step_00000001", "step_00000002"]  # the leftover folder is gone


def test_corrupt_or_missing_meta_raises(mesh, tmp_path):
    model = sharded(mesh)
    path = save(tmp_path, 1, model)
    meta_file = path / "meta.json"
    text = open(meta_file).read()
    assert json.loads(text)["tensors"]["model.lm_head.weight"] == [264, 128]
    with open(meta_file, "w") as f:
        f.write(text[: len(text) // 2])
    with pytest.raises(ValueError, match=r"meta\.json is corrupt"):
        load(tmp_path, model)
    os.remove(meta_file)
    assert latest(tmp_path) is None
    with pytest.raises(ValueError, match=r"meta\.json is missing"):
        load(path, model)
    with pytest.raises(ValueError, match="no complete checkpoint"):
        load(tmp_path, model)


def test_keep_deletes_all_but_the_newest(mesh, tmp_path):
    model = sharded(mesh)
    for step in (10, 20, 30, 40):
        save(tmp_path, step, model, keep=2)
    assert sorted(os.listdir(tmp_path)) == ["step_00000030", "step_00000040"]
    with pytest.raises(TypeError, match="JSON-able"):
        save(tmp_path, 50, model, extra=dict(mesh=mesh))


def test_export_hf_matches_sharded_logits(mesh, tmp_path, capfd):
    model = sharded(mesh)
    shard_activations(model, mesh)
    ids = torch.randint(0, 264, (8, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(ids.to(torch_xla.device())).logits.cpu()
    capfd.readouterr()
    export_hf(model, tmp_path / "hf")
    hf = load_hf(tmp_path / "hf")
    assert hf.dtype == torch.float32 and next(hf.parameters()).device.type == "cpu"
    assert "it/s]" not in capfd.readouterr().err  # no progress bar, writing or loading (a widget in a notebook)
    assert hf_logging.is_progress_bar_enabled()  # and the setting is left as it was
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, expected, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="no config.json"):
        load_hf(tmp_path)


def test_export_hf_of_a_bf16_model_in_fp32(mesh, tmp_path):
    """Notebook 03's export for 04-06b: fp32 whatever the run trained in (a TPU trains in bf16)."""
    model = hf_model(get_config("tiny", num_hidden_layers=2)).to(torch.bfloat16)
    shard_params(model, mesh, "2d")
    export_hf(model, tmp_path / "hf", dtype=torch.float32)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "float32"
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    for name, p in model.named_parameters():
        assert exported[name].dtype == torch.float32 and torch.equal(exported[name], p.detach().cpu().float()), name


@pytest.fixture(params=["memory", "file"])
def url(request, tmp_path):
    """A folder given as an fsspec URL: in fsspec's in-memory file system, or file:// on disk."""
    if request.param == "file":
        yield f"file://{tmp_path}/run"
        return
    root = f"memory://{tmp_path.name}/run"  # the memory file system is one per process: a folder per test
    yield root
    fsspec.filesystem("memory").rm(f"/{tmp_path.name}", recursive=True)


def test_url_save_load_keep_and_a_crashed_save(mesh, url, monkeypatch):
    model = sharded(mesh)
    first = save(url, 1, model, keep=2)
    assert first == latest(url) == f"{url}/step_00000001"
    real_save = checkpoint.dcp.save

    def crash(*args, **kwargs):  # every shard written into step_00000002/, then killed before meta.json
        real_save(*args, **kwargs)
        raise RuntimeError("killed mid-save")

    monkeypatch.setattr(checkpoint.dcp, "save", crash)
    with pytest.raises(RuntimeError, match="killed"):
        save(url, 2, model, keep=2)
    fs, root = fsspec.core.url_to_fs(url)
    assert fs.exists(f"{root}/step_00000002/.metadata")  # the shards are there, in place ...
    assert checkpoints(url) == [first] and latest(url) == first  # ... but without meta.json it is not a checkpoint
    monkeypatch.undo()

    for step in (2, 3):
        save(url, step, model, keep=2)
    assert checkpoints(url) == [f"{url}/step_00000002", f"{url}/step_00000003"]
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)) == ["step_00000002", "step_00000003"]
    fresh = sharded(mesh, seed=1)
    assert load(url, fresh)["step"] == 3
    for (name, a), b in zip(on_cpu(dict(fresh.named_parameters())).items(), model.parameters()):
        assert torch.equal(a, b.detach().cpu()), name


def as_host(monkeypatch, index, others):
    """Pretend to be host `index` of a pod; `others` (host -> value) plays the other hosts in each gather
    (but verify's (problem,) tuples and save's file sums (dicts): the other hosts find what this one finds)."""
    n = len(others) + 1
    monkeypatch.setattr(xr, "process_index", lambda: index)
    monkeypatch.setattr(xr, "process_count", lambda: n)
    monkeypatch.setattr(checkpoint, "_gather", lambda value: [value if isinstance(value, (tuple, dict)) else
                                                            others.get(h, value) for h in range(n)])


def test_each_host_hashes_its_files_as_it_writes_them_and_host_0_records_them_all(mesh, tmp_path, monkeypatch):
    read_back = []
    monkeypatch.setattr(checkpoint, "_sha256", lambda fs, file: read_back.append(file))  # verify's hash: not in a save
    host_1 = {f"__1_{i}.distcp": dict(size=8, sha256="ab") for i in range(checkpoint.THREADS)}  # what host 1 hashed
    monkeypatch.setattr(xr, "process_count", lambda: 2)
    monkeypatch.setattr(checkpoint, "_no_dist", lambda: True)  # DCP as one process: this host writes __0_*
    monkeypatch.setattr(checkpoint, "_gather", lambda value: [value, host_1 if isinstance(value, dict) else value])
    path = save(tmp_path, 1, sharded(mesh))
    mine = {".metadata"} | {f"__0_{i}.distcp" for i in range(checkpoint.THREADS)}
    assert read_back == [] and set(os.listdir(path)) == mine | {"meta.json"}
    files = json.loads((path / "meta.json").read_text())["files"]
    assert files.keys() == mine | host_1.keys()
    for name in mine:  # the sums taken while writing are the files' own
        data = (path / name).read_bytes()
        assert files[name] == dict(size=len(data), sha256=hashlib.sha256(data).hexdigest()), name


def test_hosts_agree_on_the_resume_step_or_all_raise(mesh, tmp_path, monkeypatch):
    model = sharded(mesh)
    for step in (1, 2):
        save(tmp_path, step, model)
    as_host(monkeypatch, 1, {0: 2})  # host 0 sees step 2, as this host does
    assert latest(tmp_path) == tmp_path / "step_00000002"
    as_host(monkeypatch, 1, {0: 3})  # host 0 saved step 3, which this host does not see
    with pytest.raises(ValueError, match=r"hosts see different newest checkpoints in .*\(host 0: step 3; host 1: "
                                         r"step 2\); checkpoint_dir must be one folder that every host sees.*gs://"):
        latest(tmp_path)
    as_host(monkeypatch, 2, {0: 2, 1: 2})  # hosts 0 and 1 see step 2; this one's own disk has none
    with pytest.raises(ValueError, match=r"\(hosts 0, 1: step 2; host 2: none\).*shared file system"):
        latest(tmp_path / "elsewhere")


def test_a_host_that_cannot_see_what_host_0_saved_raises(mesh, tmp_path, monkeypatch):
    model = sharded(mesh)
    # This is host 1 of 2; its checkpoint_dir is on its own disk, so host 0's meta.json and rename
    # never show here. DCP runs as one process (no gloo group in a test); the gather is faked.
    as_host(monkeypatch, 1, {0: True})
    monkeypatch.setattr(checkpoint, "_no_dist", lambda: True)
    monkeypatch.setattr(checkpoint, "VISIBLE_WAIT", 0)
    message = r"some hosts cannot see .*step_00000001/meta\.json \(host 0: seen; host 1: missing\); checkpoint_dir"
    with pytest.raises(ValueError, match=message):
        save(tmp_path, 1, model)
    assert os.listdir(tmp_path) == [".tmp_step_00000001"]  # host 1 wrote only its shards
    with pytest.raises(ValueError, match=message):  # and a load of host 0's checkpoint by its path
        load(tmp_path / "step_00000001", model)


def two_checkpoints(mesh, tmp_path):
    """Steps 1 and 2 of two differently seeded models; returns their paths and step 1's weights."""
    first_model = sharded(mesh, seed=1)
    first = save(tmp_path, 1, first_model)
    second = save(tmp_path, 2, sharded(mesh, seed=2))
    return first, second, on_cpu(dict(first_model.named_parameters()))


def shard_file(path):
    """The first of the shard files host 0 wrote (checkpoint.THREADS of them)."""
    return path / "__0_0.distcp"


@pytest.mark.parametrize("damage, reason", [
    ("truncate", r"__0_0\.distcp has \d+ bytes, \d+ were saved"),
    ("flip", r"__0_0\.distcp has another sha256 than the one saved"),
    ("remove", r"__0_0\.distcp is missing"),
    ("garbage meta", r"step_00000002/meta\.json is corrupt"),
])
def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous_loudly(mesh, tmp_path, monkeypatch, damage, reason):
    first, second, weights = two_checkpoints(mesh, tmp_path)
    meta = json.loads((second / "meta.json").read_text())
    assert set(meta["files"]) == {".metadata"} | {f"__0_{i}.distcp" for i in range(checkpoint.THREADS)}
    assert meta["files"]["__0_0.distcp"]["size"] == shard_file(second).stat().st_size
    file = shard_file(second)
    if damage == "truncate":
        os.truncate(file, file.stat().st_size // 2)
    elif damage == "flip":
        data = bytearray(file.read_bytes())
        data[len(data) // 2] ^= 1
        file.write_bytes(bytes(data))
    elif damage == "remove":
        os.remove(file)
    else:
        (second / "meta.json").write_text("{not json")
    (tmp_path / "step_00000003").mkdir()  # a save that never finished (no meta.json): not a checkpoint
    with pytest.warns(UserWarning, match=r"skipped 1 newer checkpoint.*(step_00000002 is corrupt: )?" + reason +
                      r".*using step_00000001"):
        assert latest(tmp_path) == first
    fresh = sharded(mesh, seed=3)
    with monkeypatch.context() as m:
        m.setattr(checkpoint.dcp, "load", lambda *args, **kwargs: pytest.fail("read a tensor"))
        with pytest.raises(ValueError, match=reason):
            load(second, fresh)  # named, before any tensor is read
    with pytest.warns(UserWarning, match="using step_00000001"):
        assert load(tmp_path, fresh)["step"] == 1
    assert all(torch.equal(t, weights[n]) for n, t in on_cpu(dict(fresh.named_parameters())).items())


def test_loading_the_newest_checkpoint_reads_each_file_once_for_its_sum(mesh, tmp_path, monkeypatch):
    first, second, _ = two_checkpoints(mesh, tmp_path)
    hashed, real = [], checkpoint._sha256
    monkeypatch.setattr(checkpoint, "_sha256", lambda fs, file: hashed.append(file) or real(fs, file))
    assert load(tmp_path, sharded(mesh, seed=3))["step"] == 2  # latest() verifies step 2, load does not again
    assert sorted(map(os.path.basename, hashed)) == sorted(json.loads((second / "meta.json").read_text())["files"])
    hashed.clear()
    load(second, sharded(mesh, seed=3))  # a step folder: load verifies it itself
    assert len(hashed) == 1 + checkpoint.THREADS  # .metadata and the shard files
    hashed.clear()
    load(second, sharded(mesh, seed=3), verified=True)  # the caller has verified it
    assert hashed == []


def test_no_verifying_checkpoint_is_an_error_not_a_fresh_start(mesh, tmp_path):
    first, second, _ = two_checkpoints(mesh, tmp_path)
    os.truncate(shard_file(first), 10)
    (second / "meta.json").write_text("")
    with pytest.raises(ValueError, match=r"no checkpoint in .* verifies \(.*step_00000002/meta\.json is corrupt.*; "
                                         r"step_00000001 is corrupt: __0_0\.distcp has 10 bytes"):
        latest(tmp_path)


def calls(module, name):
    """A pickle (protocol 4) that calls module.name() when loaded; `name` may be dotted."""
    text = lambda s: b"\x8c" + bytes([len(s)]) + s.encode()  # SHORT_BINUNICODE
    return b"\x80\x04" + text(module) + text(name) + b"\x93)R."  # STACK_GLOBAL, (), REDUCE, STOP


@pytest.mark.parametrize("module, name", [("posix", "getpid"),
                                          ("torch.distributed.checkpoint.filesystem", "os.getpid")])
def test_loading_runs_no_code_from_a_pickled_metadata_file(mesh, tmp_path, module, name):
    payload = calls(module, name)
    assert pickle.loads(payload) == os.getpid()  # what pickle.load, as DCP's reader calls it, would run
    path = save(tmp_path, 1, sharded(mesh))
    (path / ".metadata").write_bytes(payload)
    meta = json.loads((path / "meta.json").read_text())
    meta["files"][".metadata"] = dict(size=len(payload), sha256=hashlib.sha256(payload).hexdigest())  # only the
    # unpickler stops it
    (path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(pickle.UnpicklingError, match=rf"may not hold {module}\.{name}"):
        load(path, sharded(mesh))


def test_a_checkpoint_saved_without_sums_still_loads(mesh, tmp_path):
    model = sharded(mesh, seed=1)
    path = save(tmp_path, 1, model)
    meta = json.loads((path / "meta.json").read_text())
    del meta["files"]  # as saved before sums were recorded
    (path / "meta.json").write_text(json.dumps(meta))
    assert checkpoint.verify(path) == meta and latest(tmp_path) == path
    fresh = sharded(mesh, seed=2)
    assert load(tmp_path, fresh)["step"] == 1
    for (name, a), b in zip(on_cpu(dict(fresh.named_parameters())).items(), model.parameters()):
        assert torch.equal(a, b.detach().cpu()), name


# Two hosts over gloo: the saving thread gathers on the saver's group while the main thread all-reduces
# on the hosts' group (as train's stop agreement does); each host prints what both saw.
HOSTS = """
import json, sys
import torch, torch.distributed as dist
from llama_xla_helpers import checkpoint
rank, store = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=2)
checkpoint.xr.process_count, checkpoint.xr.process_index = lambda: 2, lambda: rank
saver = checkpoint.AsyncSaver()
def gathers():
    checkpoint._SAVING.group = saver.group
    return [checkpoint._gather(f"{rank}.{i}") for i in range(200)]
future = saver.pool.submit(gathers)
sums = []
for i in range(200):
    t = torch.tensor([rank + i])
    dist.all_reduce(t)
    sums.append(int(t))
print(json.dumps([sums, future.result()]))
saver.close()
dist.destroy_process_group()
"""


def test_the_saving_thread_keeps_to_its_own_group_while_the_loop_uses_the_hosts_one(tmp_path):
    hosts = [subprocess.Popen([sys.executable, "-c", HOSTS, str(rank), str(tmp_path / "store")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    outs = [host.communicate(timeout=300) for host in hosts]
    assert [host.returncode for host in hosts] == [0, 0], [err[-2000:] for _, err in outs]
    want = [[2 * i + 1 for i in range(200)], [[f"0.{i}", f"1.{i}"] for i in range(200)]]
    assert [json.loads(out.splitlines()[-1]) for out, _ in outs] == [want, want]


def save_in(mode, *args, **kwargs):
    """`save`, or the same through an `AsyncSaver` (whose error `close` raises)."""
    if mode == "sync":
        return save(*args, **kwargs)
    saver = checkpoint.AsyncSaver()
    saver.save(*args, **kwargs)
    return saver.close()


def test_an_async_save_holds_its_steps_state_while_training_goes_on(mesh, tmp_path):
    """The state a background save writes is the one at its call: the next steps change the model
    and optimizer on the device meanwhile. The next save waits for the last; each loads back whole."""
    model = sharded(mesh)
    optimizer = Adafactor(model.parameters(), lr=1e-2)
    train_step(model, optimizer, 0)
    saver, states = checkpoint.AsyncSaver(), {}
    for step in (1, 2):
        states[step] = on_cpu(tensors(model, optimizer))
        future = saver.save(tmp_path, step, model, optimizer, keep=2)
        train_step(model, optimizer, step)  # while the save writes
    assert saver.close() == future.result() == tmp_path / "step_00000002" and saver.wait() is None
    assert [p.name for p in checkpoints(tmp_path)] == ["step_00000001", "step_00000002"]
    for step, want in states.items():
        fresh = sharded(mesh, seed=3)
        opt = Adafactor(fresh.parameters(), lr=1e-2)
        init_optimizer_state(opt)
        load(tmp_path / f"step_{step:08d}", fresh, opt)
        got = on_cpu(tensors(fresh, opt))
        assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want), step


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("room", [0, 100])
def test_disk_full_during_a_save_keeps_the_previous_checkpoint(mesh, tmp_path, monkeypatch, room, mode):
    # room=0: a file's first write fails and torch.save raises the OSError; room=100: a write inside
    # the zip's records fails and torch.save raises its own RuntimeError while handling the OSError.
    first, _, weights = two_checkpoints(mesh, tmp_path)
    checkpoint._remove(tmp_path / "step_00000002")
    failed = []

    class FillsUp:  # each file takes `room` bytes, then the disk is full
        def __init__(self, stream):
            self.stream, self.written = stream, 0

        def write(self, data):
            self.written += len(data)
            if self.written > room:
                failed.append(self.written)
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.stream.write(data)

        def __getattr__(self, name):
            return getattr(self.stream, name)

    class FullDiskWriter(checkpoint.dcp.FileSystemWriter):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            create_stream = self.fs.create_stream

            @contextlib.contextmanager
            def filling(path, mode):
                with create_stream(path, mode) as stream:
                    yield FillsUp(stream)
            self.fs.create_stream = filling

    monkeypatch.setattr(checkpoint.dcp, "FileSystemWriter", FullDiskWriter)
    with pytest.raises(OSError, match=r"disk full while saving step 2 into .*; the checkpoints saved before are "
                                      r"intact\. Free space there, or keep fewer") as e:
        save_in(mode, tmp_path, 2, sharded(mesh, seed=2))
    host_error = next(iter(e.value.__cause__.failures.values()))[0]  # DCP's CheckpointException
    assert e.value.errno == errno.ENOSPC and failed
    assert type(host_error) is (OSError if room == 0 else RuntimeError), host_error
    assert sorted(os.listdir(tmp_path)) == ["step_00000001"]  # the partial save is gone
    monkeypatch.undo()
    assert latest(tmp_path) == first
    fresh = sharded(mesh, seed=3)
    load(tmp_path, fresh)
    assert all(torch.equal(t, weights[n]) for n, t in on_cpu(dict(fresh.named_parameters())).items())
