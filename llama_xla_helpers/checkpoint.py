"""Sharded checkpoints of a training run (model + optimizer + step), and Hugging Face export.

    save("ckpt", step, model, optimizer, extra=dict(seed=0))  # writes ckpt/step_00000100/
    init_optimizer_state(optimizer)                           # a fresh optimizer has no state to load into
    meta = load("ckpt", model, optimizer)                     # the newest complete checkpoint, in place
    saver = AsyncSaver(); saver.save("ckpt", step, model)     # in the background; saver.close() at the end
    export_hf(model, "hf"); hf = load_hf("hf")                # a plain CPU LlamaForCausalLM
    shard_params(meta_model, mesh, init=hf_reader("hf"))      # or straight into the shards, block by block

Every process writes only the shards its devices hold (torch.distributed.checkpoint with
torch_xla's SPMD planners); process 0 writes meta.json last: a step_ folder is complete when
it holds meta.json, which lists every file's size and sha256. `load` and `latest` verify them
(`verify`): a damaged newest checkpoint is skipped, loudly, for the newest one that verifies.
So on a pod `directory` must be one folder that every host sees:

- a path on a local disk (one host) or a shared file system (NFS, Filestore): the shards go
  into a hidden temporary folder that process 0 renames into place, so a crash mid-save leaves
  the earlier checkpoints as they were. (A GCS FUSE mount renames a folder by copying it, and
  only if mounted with --rename-dir-limit: give it the gs:// URL instead.)
- an fsspec URL, e.g. gs://bucket/run (pip install -e '.[gcs]' adds gcsfs): object stores
  cannot rename, so the shards go straight into step_XXXXXXXX/, then meta.json.

After a save every host checks that it sees the new checkpoint, and `latest` compares the step
each host finds: a folder on each host's own disk gives every host the same clear error, not a
hang or a silent restart from step 0.
"""
import contextlib
import dataclasses
import errno
import hashlib
import json
import os
import pickle
import re
import shutil
import signal
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import fsspec
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.runtime as xr
from safetensors import safe_open
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.metadata import StorageMeta
from torch_xla.experimental.distributed_checkpoint import SPMDLoadPlanner, SPMDSavePlanner, prime_optimizer
from torch_xla.experimental.distributed_checkpoint._helpers import _sharded_cpu_state_dict
from transformers import LlamaForCausalLM
from transformers.utils import logging as hf_logging

from . import lora
from .model import safetensors_files

META = "meta.json"
STEP_DIR = re.compile(r"step_(\d{8,})")
SHARED = ("checkpoint_dir must be one folder that every host sees: put it on a shared file system "
          "(NFS, Filestore) or use a gs:// URL")
VISIBLE_WAIT = 30  # seconds a host keeps looking for a checkpoint just saved (NFS may show new files late)
CRASH_IN_SAVE = "LLAMA_XLA_CRASH_IN_SAVE"  # test hook: a step whose save kills the process halfway
THREADS = 4  # files each host writes at once (DCP's thread_count)


class _SavePlanner(SPMDSavePlanner):
    """torch_xla's SPMDSavePlanner, writing each block of a tensor once.

    When several devices of one process hold the same block (a tensor split over part of the
    mesh, e.g. Adafactor's (rows, 1) factor: sharded on 'data', replicated on 'model'),
    torch_xla 2.9 plans one write per device and its dedup then drops every copy: the tensor
    is missing from the checkpoint. Here only replica 0 of each block is planned. (The state it
    gets is staged in host memory, `_stage`: its sharded tensors are torch_xla's _CpuShards.)
    """

    def create_local_plan(self):
        plan = super().create_local_plan()
        replica = {fqn: [shard.replica_id for shard in t.shards] for fqn, t in self.sharded_state_dict.items()}
        items = [i for i in plan.items if i.index.fqn not in replica or replica[i.index.fqn][i.index.index] == 0]
        return dataclasses.replace(plan, items=items)


def _no_dist():
    """DCP's no_dist: one process needs no process group; a pod's hosts share a gloo group."""
    if xr.process_count() == 1:
        return True
    host_group()
    return False


def host_group():
    """The gloo process group of a pod's hosts (the default group, started once with torch_xla's
    "xla://" rendezvous): the checkpoints' barriers and gathers, and train's stop agreement."""
    if not dist.is_initialized():
        import torch_xla.distributed.xla_backend  # noqa: F401  registers init_method="xla://"
        dist.init_process_group("gloo", init_method="xla://")
    return dist.group.WORLD


_SAVING = threading.local()  # .group: the gloo group of `AsyncSaver`'s thread (None elsewhere: the hosts' group)


def _barrier(no_dist):
    """Wait for every host (xm.rendezvous would compile and run an XLA graph, even alone)."""
    if not no_dist:
        dist.barrier(group=getattr(_SAVING, "group", None))


def _gather(value):
    """Every host's `value` (picklable), in host order: [value] alone, else an all_gather over gloo."""
    if _no_dist():
        return [value]
    values = [None] * xr.process_count()
    dist.all_gather_object(values, value, group=getattr(_SAVING, "group", None))
    return values


def lead_value(value):
    """Process 0's `value` (picklable) on every host: a collective, every host calls it (`_gather`).
    Process 0 alone decides what all must agree on, e.g. the name of the token file (`data.token_file`'s share)."""
    return _gather(value)[0]


def _hosts(values):
    """'host 0: step 2; hosts 1, 3: none': which hosts have which (string) value."""
    groups = {}
    for host, v in enumerate(values):
        groups.setdefault(v, []).append(str(host))
    return "; ".join(f"host{'s' * (len(h) > 1)} {', '.join(h)}: {v}" for v, h in groups.items())


@contextlib.contextmanager
def _quiet():
    """Silence the UserWarnings DCP and torch_xla raise on every call (single process, deprecated internals)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning, module=r"torch(_xla)?\.distributed\.")
        yield


def _state(model, optimizer):
    """What a checkpoint holds: the model's state dict (or `model` itself, a dict of tensors such as
    lora.adapter_state's: a LoRA run saves only its adapters), and the optimizer's."""
    state = {"model": model if isinstance(model, dict) else model.state_dict()}
    if optimizer is not None:
        state["optimizer"] = optimizer.state_dict()
    return state


def _shapes(state, prefix=""):
    """{dotted name: global shape} of every tensor in a nested dict / list, in order."""
    items = state.items() if isinstance(state, dict) else enumerate(state) if isinstance(state, list) else ()
    out = {}
    for k, v in items:
        if isinstance(v, torch.Tensor):
            out[f"{prefix}{k}"] = list(v.shape)
        else:
            out.update(_shapes(v, f"{prefix}{k}."))
    return out


def _is_url(path):
    """An fsspec URL (gs://bucket/run, memory://run), not a local or mounted path."""
    return "://" in str(path)


def _child(path, name):
    """path/name: a Path for a local path, a string for a URL."""
    return f"{str(path).rstrip('/')}/{name}" if _is_url(path) else Path(path) / name


def _name(path):
    return str(path).rstrip("/").rsplit("/", 1)[-1]


def _step(path):
    return int(STEP_DIR.fullmatch(_name(path))[1])


def _fs(path):
    """(fsspec file system, path inside it) of a URL or a local path, with no stale listing of it
    (gcsfs caches listings, and other hosts write there too)."""
    fs, inner = fsspec.core.url_to_fs(str(path))
    fs.invalidate_cache(inner)
    return fs, inner


def _exists(path):
    fs, inner = _fs(path)
    return fs.exists(inner)


class _Hashed:
    """A stream being written, hashed on the way: `size` bytes so far and their `sha256`."""

    def __init__(self, raw):
        self.raw, self.sha256, self.size = raw, hashlib.sha256(), 0

    def write(self, b):
        self.sha256.update(b)
        self.size += memoryview(b).nbytes
        return self.raw.write(b)

    def __getattr__(self, name):  # tell, flush, fileno, close
        return getattr(self.raw, name)


class _HashingFileSystem:
    """A DCP storage writer's file system whose files are hashed as they are written (DCP writes
    each file front to back): `sums` {file name: {"size", "sha256"}} of what this host wrote, so
    no file is read back to hash it (from gs:// that would download the whole checkpoint)."""

    def __init__(self, fs):
        self.fs, self.sums = fs, {}

    def __getattr__(self, name):
        return getattr(self.fs, name)

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        with self.fs.create_stream(path, mode) as raw:
            stream = _Hashed(raw)
            yield stream
        self.sums[_name(path)] = dict(size=stream.size, sha256=stream.sha256.hexdigest())

    def rename(self, path, new_path):  # DCP writes .metadata.tmp, then renames it
        self.fs.rename(path, new_path)
        self.sums[_name(new_path)] = self.sums.pop(_name(path))


def _sha256(fs, file):
    digest = hashlib.sha256()
    with fs.open(file, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):  # 16 MiB at a time
            digest.update(chunk)
    return digest.hexdigest()


def verify(path):
    """Read meta.json and check the files of the checkpoint at `path` against the sizes and
    sha256 sums recorded at save; returns the meta dict. Raises ValueError naming the first
    missing, truncated or altered file, or a meta.json that is missing or not JSON, on every
    host alike.

    Sizes are checked on every host; the sums are split among the hosts of a pod, so the
    checkpoint is read once in all. Checkpoints saved without sums are read for meta.json only.
    """
    try:
        meta, problem = read_meta(path), None
    except ValueError as e:  # still gather below: every host of a pod takes part
        meta, problem = {}, str(e)
    fs, inner = _fs(path)
    for i, (name, want) in enumerate(sorted(meta.get("files", {}).items())):
        file, bad = f"{inner}/{name}", f"{_name(path)} is corrupt: {name}"
        if not fs.exists(file):
            problem = f"{bad} is missing"
        elif fs.size(file) != want["size"]:
            problem = f"{bad} has {fs.size(file)} bytes, {want['size']} were saved"
        elif i % xr.process_count() == xr.process_index() and _sha256(fs, file) != want["sha256"]:
            problem = f"{bad} has another sha256 than the one saved"
        if problem:
            break
    problems = [p for (p,) in _gather((problem,)) if p]
    if problems:
        raise ValueError(problems[0])
    return meta


def checkpoints(directory):
    """The complete checkpoints this host sees in `directory` (step_XXXXXXXX folders holding
    meta.json), oldest first: Paths, or URL strings for a URL."""
    fs, inner = _fs(directory)
    if not fs.isdir(inner):
        return []
    names = [_name(p) for p in fs.ls(inner, detail=False)]
    found = [_child(directory, n) for n in names if STEP_DIR.fullmatch(n) and _exists(_child(directory, f"{n}/{META}"))]
    return sorted(found, key=_step)


def latest(directory):
    """The newest checkpoint in `directory` that is complete and verifies (a Path, a string for a
    URL), or None if there is none.

    A newer checkpoint that does not verify (a truncated or missing shard, a meta.json that is
    not JSON) is skipped with a warning that names it and what is wrong; if checkpoints exist
    but none verifies, ValueError: never a silent restart from step 0. A step_ folder without
    meta.json is a save that never finished, and is not a checkpoint.

    On a pod every host calls it (as `train` does when resuming): the hosts compare each step
    they try, and all raise a ValueError if they differ, e.g. a checkpoint_dir on each host's
    own disk, which only host 0 saved into.
    """
    skipped = []
    for path in [*reversed(checkpoints(directory)), None]:  # newest first; None: none left
        steps = _gather(None if path is None else _step(path))
        if len(set(steps)) > 1:
            seen = _hosts(["none" if s is None else f"step {s}" for s in steps])
            raise ValueError(f"the hosts see different newest checkpoints in {str(directory)!r} ({seen}); {SHARED}")
        if path is None:
            break
        try:
            verify(path)  # every host verifies the same checkpoint: verify gathers too
        except ValueError as e:
            skipped.append(str(e))
            continue
        if skipped:
            warnings.warn(f"skipped {len(skipped)} newer checkpoint(s) in {str(directory)!r} that do not verify "
                          f"({'; '.join(skipped)}); using {_name(path)}", stacklevel=2)
        return path
    if skipped:
        raise ValueError(f"no checkpoint in {str(directory)!r} verifies ({'; '.join(skipped)}); restore one, "
                         f"or move them away to train from step 0")
    return None


def _check_everyone_sees(path, wait=0):
    """Raise the same ValueError on every host if some, not all, cannot see path/meta.json.

    `wait`: seconds to keep looking first (a file another host just wrote can show late on NFS).
    """
    file = _child(path, META)
    deadline = time.monotonic() + wait
    while not _exists(file) and time.monotonic() < deadline:
        time.sleep(1)
    seen = _gather(_exists(file))
    if len(set(seen)) > 1:
        raise ValueError(f"some hosts cannot see {file} ({_hosts(['seen' if s else 'missing' for s in seen])}); "
                         f"{SHARED}")


def _remove(path):
    """Delete a checkpoint so that a crash midway leaves nothing that looks complete: a folder
    is first renamed out of sight; at a URL (no rename) meta.json goes first."""
    if _is_url(path):
        fs, inner = _fs(path)
        if fs.exists(f"{inner}/{META}"):
            fs.rm(f"{inner}/{META}")
        fs.rm(inner, recursive=True)
        return
    trash = path.with_name(".trash_" + path.name)
    shutil.rmtree(trash, ignore_errors=True)
    path.replace(trash)
    shutil.rmtree(trash)


def save(directory, step, model, optimizer=None, extra=None, keep=3):
    """Checkpoint `model` (and `optimizer`) at `step` into directory/step_{step:08d}/; returns that
    Path (a string for a URL). `model`: a module, or a dict of its tensors (`load` takes the same).

    `extra`: a JSON-able dict stored in meta.json (data position, seed, config, ...).
    Every process of a pod calls this; each then checks it sees the checkpoint (a ValueError on
    every host if some cannot). Afterwards only the newest `keep` checkpoints remain.
    At a URL a new save of an existing step deletes the old one first (no rename to wait for).

    meta.json records each file's size and sha256, taken as the file is written (no file is read
    back), which `verify` checks before a load. A full
    disk raises OSError(ENOSPC) saying so, after removing the partial save. Test hook: with
    LLAMA_XLA_CRASH_IN_SAVE=<step> set, the save of that step kills its process (SIGKILL) once
    the shards are written and before meta.json, as a crash at the worst moment would.
    (`AsyncSaver.save` does the same with all but the copy to host memory in the background.)
    """
    return _commit(*_stage(directory, step, model, optimizer, extra, keep))


def _stage(directory, step, model, optimizer, extra, keep):
    """Check `save`'s arguments and copy the state to host memory, each host the shards its devices
    hold (torch_xla's _CpuShards): (directory, step, state, meta, keep), for `_commit`. The only
    part of a save that uses the device."""
    if keep < 1:
        raise ValueError(f"keep={keep} would delete the checkpoint just written; use keep >= 1")
    extra = {} if extra is None else extra
    try:
        json.dumps(extra)
    except (TypeError, ValueError) as e:
        raise TypeError(f"extra must be JSON-able (it goes into {META}): {e}; convert it first, "
                        f"e.g. dataclasses.asdict(cfg) or config.to_dict()") from None
    state = _state(model, optimizer)
    meta = dict(step=int(step), extra=extra, contents=list(state), tensors=_shapes(state))
    torch_xla.sync()
    xm.wait_device_ops()
    return directory, step, _sharded_cpu_state_dict(state), meta, keep


def _commit(directory, step, state, meta, keep):
    """Write a staged state (`_stage`) into directory/step_{step:08d}/ as `save` says; returns its path."""
    url = _is_url(directory)
    final = _child(directory, f"step_{step:08d}")
    tmp = final if url else final.with_name(".tmp_" + final.name)
    no_dist, lead = _no_dist(), xr.process_index() == 0
    if lead and url:
        if _exists(final):  # an older or crashed save of this step
            _remove(final)
    elif lead:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a save that crashed
        tmp.mkdir(parents=True)
    _barrier(no_dist)
    try:
        _write(state, meta, tmp, final, no_dist, lead)
    except BaseException as e:  # DCP wraps each host's error in a CheckpointException, a BaseException
        if not _disk_full(e):
            raise
        if lead and not url:  # free what the failed save took; the previous checkpoints are untouched
            shutil.rmtree(tmp, ignore_errors=True)
        elif lead and _exists(final):
            _remove(final)
        raise OSError(errno.ENOSPC, f"disk full while saving step {step} into {str(directory)!r}; the "
                      f"checkpoints saved before are intact. Free space there, or keep fewer "
                      f"(keep={keep})") from e
    if lead:
        for old in checkpoints(directory)[:-keep]:
            _remove(old)
    _barrier(no_dist)
    _check_everyone_sees(final, VISIBLE_WAIT)
    return final


def _write(state, meta, tmp, final, no_dist, lead):
    """The shards (every host), then their sizes and sums and meta.json (host 0), then, for a
    local folder, the rename that makes the checkpoint visible."""
    url = _is_url(final)
    # sync_files=False at a URL: an object is stored when its upload closes (DCP would call os.sync()).
    # per_thread_copy_ahead=0: DCP's serial loader (the shards are already on the host). Its copy-ahead
    # loader is for an accelerator's streams: with torchax imported (the `scan` extra; mark_sharding
    # imports it) DCP takes torchax's device module for one and fails ("no attribute 'current_stream'").
    writer = (FsspecWriter(tmp, sync_files=False, per_thread_copy_ahead=0, thread_count=THREADS) if url else
              dcp.FileSystemWriter(tmp, per_thread_copy_ahead=0, thread_count=THREADS))
    writer.fs = hashing = _HashingFileSystem(writer.fs)
    with _quiet():
        dcp.save(state, storage_writer=writer, planner=_SavePlanner(), no_dist=no_dist,
                 process_group=getattr(_SAVING, "group", None))
    _barrier(no_dist)  # every host's shards are written
    if os.environ.get(CRASH_IN_SAVE) == str(meta["step"]):
        os.kill(os.getpid(), signal.SIGKILL)  # test hook: die with the shards written, meta.json not
    # Each host hashed what it wrote while writing it; host 0 gathers the sums.
    sums = {name: entry for host_sums in _gather(hashing.sums) for name, entry in host_sums.items()}
    if not lead:
        return
    meta = dict(meta, files=sums)
    if url:
        with fsspec.open(_child(final, META), "w") as f:  # last: the checkpoint is complete
            json.dump(meta, f, indent=1)
        return
    with open(tmp / META, "w") as f:
        json.dump(meta, f, indent=1)
        f.flush()
        os.fsync(f.fileno())  # on disk before the rename makes the checkpoint visible
    if final.exists():
        _remove(final)
    tmp.replace(final)  # atomic: readers see the checkpoint whole or not at all


class AsyncSaver:
    """`save` in the background (torchtitan's async checkpointing, Orbax's async save): `save`
    returns once the state is in host memory; the writing, hashing and commit run on one thread
    of their own, over a gloo group of their own on a pod (the main thread's collectives, such as
    train's stop agreement, keep the hosts' group). One save at a time: the next `save` first waits
    for the last and raises what it raised. The commit is `save`'s, so a crash, kill or full disk
    during a background save leaves the previous checkpoint the newest valid one. Call `wait()`
    (or `close()`) before the process ends: it finishes the save in flight.

        saver = AsyncSaver()                      # every host, at the same point
        saver.save("ckpt", step, model, optimizer)  # the steps go on while it writes
        saver.close()                             # the last save committed (or its error)
    """

    def __init__(self):
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="checkpoint")
        self.group = None if _no_dist() else dist.new_group(backend="gloo")  # a collective: every host
        self.future = None

    def save(self, directory, step, model, optimizer=None, extra=None, keep=3):
        """As `checkpoint.save`; returns a Future of the checkpoint's path, once the state is staged."""
        self.wait()
        staged = _stage(directory, step, model, optimizer, extra, keep)
        self.future = self.pool.submit(self._commit, staged)
        return self.future

    def _commit(self, staged):
        _SAVING.group = self.group
        return _commit(*staged)

    def wait(self):
        """The path of the last save once it has committed (None if there is none in flight); its
        exception if it failed."""
        future, self.future = self.future, None
        return None if future is None else future.result()

    def close(self):
        try:
            return self.wait()
        finally:
            self.pool.shutdown()


def _disk_full(e):
    """Whether `e`, a host's failure that DCP wrapped in it, or an error either was raised while
    handling is ENOSPC ("No space left on device"). torch.save hides a failed write behind the zip
    writer's own RuntimeError ("unexpected pos"), raised while it handles the OSError."""
    errors = [e] + [f[0] if isinstance(f, tuple) else f for f in getattr(e, "failures", {}).values()]
    while errors:
        c = errors.pop()
        if isinstance(c, OSError) and c.errno == errno.ENOSPC:
            return True
        errors += [x for x in (c.__cause__, c.__context__) if x is not None]
    return False


def read_meta(path):
    """The meta.json of the checkpoint at `path`: step, extra, contents (model, optimizer), tensors ({name: shape})."""
    file = _child(path, META)
    try:
        with fsspec.open(str(file), "r") as f:
            meta = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"{file} is missing, so {path} is not a complete checkpoint; pass another "
                         f"step_ folder, or the parent folder to take the newest complete one") from None
    except ValueError as e:  # truncated or not text
        raise ValueError(f"{file} is corrupt ({e})") from None
    if not isinstance(meta, dict) or not {"step", "extra", "contents", "tensors"} <= set(meta):
        raise ValueError(f"{file} lacks step / extra / contents / tensors; it was not written by checkpoint.save")
    return meta


def _check(meta, state, path):
    """Raise a ValueError at the first part, tensor name or shape that differs between checkpoint and `state`."""
    def fix(name):
        if name.startswith("optimizer"):
            return ("the optimizer differs from the saved one: another class, or no state yet "
                    "(call init_optimizer_state(optimizer) before load), or pass optimizer=None")
        return "this checkpoint is for a different model config (meta.json's extra may hold it); build that model"
    for part in state:
        if part not in meta["contents"]:
            raise ValueError(f"{path} holds no {part} state (only {', '.join(meta['contents'])}); pass {part}=None")
    saved = {n: s for n, s in meta["tensors"].items() if n.split(".", 1)[0] in state}
    current = _shapes(state)
    for name, shape in current.items():
        if name not in saved:
            raise ValueError(f"{path} has no tensor {name!r}; {fix(name)}")
        if saved[name] != shape:
            raise ValueError(f"{name} has shape {tuple(saved[name])} in the checkpoint {path} but {tuple(shape)} "
                             f"here; {fix(name)}")
    for name in saved:
        if name not in current:
            raise ValueError(f"{path} holds {name!r}, which the model / optimizer lacks; {fix(name)}")


def _resolve(path):
    """(a checkpoint folder as given, False), or (the newest one inside a folder of checkpoints
    that verifies, True)."""
    path = path if _is_url(path) else Path(path)
    if STEP_DIR.fullmatch(_name(path)) or _exists(_child(path, META)):
        return path, False
    found = latest(path)
    if found is None:
        raise ValueError(f"no complete checkpoint in {str(path)!r} (a step_XXXXXXXX folder holding {META}); "
                         f"check the path, or train without resuming")
    return found, True


class _MetadataUnpickler(pickle.Unpickler):
    """Builds the classes a DCP .metadata holds (torch 2.9), torch dtypes and nothing else.

    A pickle can call any function it names; here it may name only these classes (exact names:
    a dotted one such as 'os.system', reached through a module's imports, is refused too).
    """

    ALLOWED = {("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "ChunkStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING")} | {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
        ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("collections", "OrderedDict")}

    def find_class(self, module, name):
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if dtype or (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"a checkpoint's .metadata may not hold {module}.{name} (only DCP's metadata "
                                     f"classes are unpickled); it was not written by checkpoint.save")


class _SafeMetadata:
    """DCP's `read_metadata` (torch 2.9) with `_MetadataUnpickler` instead of pickle.load."""

    def read_metadata(self, *args, **kwargs):
        with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _SafeFileSystemReader(_SafeMetadata, dcp.FileSystemReader):
    pass


class _SafeFsspecReader(_SafeMetadata, FsspecReader):
    pass


def init_optimizer_state(optimizer):
    """Create the optimizer's state (one step with zero gradients) so `load` has tensors to fill.

    Call it on a fresh optimizer before `load`; it leaves the gradients unset. No-op if state exists.
    """
    if not optimizer.state:
        prime_optimizer(optimizer)
        optimizer.zero_grad(set_to_none=True)
    return optimizer


def load(path, model, optimizer=None, verified=False):
    """Load a checkpoint into the sharded `model` (and `optimizer`) in place, keeping every sharding.

    `path`: a step_XXXXXXXX folder, or a folder of them (the newest that verifies is taken), or
    their URL. Before any tensor is read, the files are checked against the sizes and sums in
    meta.json (`verify`) and names and shapes against the model. Every host of a pod calls
    this; all raise if some cannot see the checkpoint. Returns the meta dict. `verified=True`
    skips the second read of every file when the caller has just verified `path` (as `latest` does).

    Loading runs no pickled code from the checkpoint. meta.json is JSON. DCP's .metadata is a
    pickle (DCP's own reader would run whatever it names): its sha256 must match meta.json's
    (if saved with sums), and `_MetadataUnpickler` reads it, building DCP's metadata classes
    and refusing any other. The .distcp files hold torch.save archives: tensors are read with
    torch.load(weights_only=True), the optimizer's param_groups (plain numbers and strings)
    with torch.load's default, also weights_only=True since torch 2.6 (unless the environment
    sets TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD).
    """
    path, found = _resolve(path)
    _check_everyone_sees(path)
    meta = read_meta(path) if verified or found else verify(path)
    state = _state(model, optimizer)
    _check(meta, state, path)
    torch_xla.sync()
    with _quiet():
        reader = _SafeFsspecReader(path) if _is_url(path) else _SafeFileSystemReader(path)
        reader.read_metadata()  # here, as dcp.load would swallow its error and fail later, less clearly
        dcp.load(state, storage_reader=reader, planner=SPMDLoadPlanner(), no_dist=_no_dist())
    if optimizer is not None:  # DCP filled the state tensors in place, in their own dtype; now the hyperparameters
        load_param_groups(optimizer, state["optimizer"]["param_groups"])
    return meta


def load_param_groups(optimizer, saved):
    """Set each param group's hyperparameters (lr, ...) to `saved`'s. Not `optimizer.load_state_dict`:
    it casts every state tensor to its parameter's dtype, which would turn a bf16 model's fp32
    optimizer state (second moments, master weights) into bf16."""
    if len(saved) != len(optimizer.param_groups):
        raise ValueError(f"the checkpoint's optimizer has {len(saved)} param groups, this one "
                         f"{len(optimizer.param_groups)}; build the optimizer as the saved run did")
    for group, values in zip(optimizer.param_groups, saved):
        group.update({k: v for k, v in values.items() if k != "params"})


def export_hf(model, out_dir, dtype=None):
    """Write `model` (sharded or not) as a Hugging Face folder: config.json + model.safetensors.

    Each weight is gathered to the CPU, cast to `dtype` if given (torch.float32: the same folder
    whatever the run trained in); process 0 writes. Load it with `load_hf` or from_pretrained.
    A model with LoRA adapters is written merged (`lora.merged_state`): a plain Llama.
    """
    torch_xla.sync()
    state = lora.merged_state(model) if lora.config_of(model) else model.state_dict()
    weights = {n: t.cpu().to(dtype or t.dtype) for n, t in state.items()}
    if xr.process_index() == 0:
        with _no_progress_bar():
            model.save_pretrained(out_dir, state_dict=weights, safe_serialization=True)
        if dtype is not None:  # config.json names the model's dtype: say what the weights are
            file = Path(out_dir) / "config.json"
            config = json.loads(file.read_text())
            file.write_text(json.dumps(dict(config, dtype=str(dtype).removeprefix("torch.")), indent=2) + "\n")
    return out_dir


def load_hf(path):
    """A LlamaForCausalLM in fp32 on the CPU from a local Hugging Face folder (never downloads)."""
    if not (Path(path) / "config.json").is_file():
        raise ValueError(f"{str(path)!r} has no config.json; pass a local folder written by export_hf or "
                         f"save_pretrained (load_hf never downloads)")
    try:
        with _no_progress_bar():
            return LlamaForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32)
    except OSError as e:
        raise ValueError(f"{str(path)!r} has a config.json but no readable weights ({e}); "
                         f"re-export it with export_hf") from None


@contextlib.contextmanager
def _no_progress_bar():
    """Transformers' "Loading weights" / "Writing model shards" bars off inside the block (a widget in a
    notebook, noise in a log), then as they were."""
    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


def hf_reader(path, dtype=torch.float32):
    """`init(name, shape)` for `sharding.shard_params` that reads a local Hugging Face folder's weights.

    `init` returns `read(index)`: the block at `index` (one slice per dim) of that tensor, read
    from its *.safetensors file and cast to `dtype` (None: as saved), which `to_sharded` calls for the blocks of
    this host's devices only. So a pod's hosts each read only their share, one tensor at a time,
    and the whole model never sits in a host's memory (`load_hf` holds all of it).
    """
    path = Path(path)
    if not any(path.glob("*.safetensors")):
        raise ValueError(f"{str(path)!r} has no *.safetensors file (only those can be read block by block); convert "
                         f"it once: LlamaForCausalLM.from_pretrained(path).save_pretrained(new_path)")
    files = {}  # tensor name -> the .safetensors file holding it
    for file in safetensors_files(path):
        with safe_open(file, "pt") as f:
            files.update(dict.fromkeys(f.keys(), file))

    def init(name, shape):
        if name not in files:
            raise ValueError(f"{path} has no tensor {name!r} (the model expects shape {tuple(shape)}); pass a "
                             f"folder written by export_hf or save_pretrained for this model")
        with safe_open(files[name], "pt") as f:
            saved = tuple(f.get_slice(name).get_shape())
        if saved != tuple(shape):
            raise ValueError(f"{name} has shape {saved} in {files[name]} but the model expects {tuple(shape)}; "
                             f"build the model from {path / 'config.json'}")

        def read(index):
            with safe_open(files[name], "pt") as f:
                block = f.get_slice(name)[index]
                return block if dtype is None else block.to(dtype)
        read.shape = saved
        return read
    return init
