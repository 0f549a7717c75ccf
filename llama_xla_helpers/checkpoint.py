"""Sharded checkpoints of a training run (model + optimizer + step), and Hugging Face export.

    save("ckpt", step, model, optimizer, extra=dict(seed=0))  # writes ckpt/step_00000100/
    init_optimizer_state(optimizer)                           # a fresh optimizer has no state to load into
    meta = load("ckpt", model, optimizer)                     # the newest complete checkpoint, in place
    export_hf(model, "hf"); hf = load_hf("hf")                # a plain CPU LlamaForCausalLM

Every process writes only the shards its devices hold (torch.distributed.checkpoint with
torch_xla's SPMD planners) into a hidden temporary folder; process 0 adds meta.json and
renames the folder into place. A crash mid-save leaves the earlier checkpoints as they were.
The directory must be a local or shared (NFS-like) file system where a rename is atomic.
"""
import contextlib
import dataclasses
import json
import os
import re
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.runtime as xr
from torch_xla.experimental.distributed_checkpoint import SPMDLoadPlanner, SPMDSavePlanner, prime_optimizer
from transformers import LlamaForCausalLM

META = "meta.json"
STEP_DIR = re.compile(r"step_(\d{8,})")


class _SavePlanner(SPMDSavePlanner):
    """torch_xla's SPMDSavePlanner, writing each block of a tensor once.

    When several devices of one process hold the same block (a tensor split over part of the
    mesh, e.g. Adafactor's (rows, 1) factor: sharded on 'data', replicated on 'model'),
    torch_xla 2.9 plans one write per device and its dedup then drops every copy: the tensor
    is missing from the checkpoint. Here only replica 0 of each block is planned.
    """

    def create_local_plan(self):
        plan = super().create_local_plan()
        replica = {fqn: [r for r, _ in torch_xla._XLAC._get_local_shard_replica_and_indices([t.global_tensor])[0]]
                   for fqn, t in self.sharded_state_dict.items()}
        items = [i for i in plan.items if i.index.fqn not in replica or replica[i.index.fqn][i.index.index] == 0]
        return dataclasses.replace(plan, items=items)


def _no_dist():
    """DCP's no_dist: one process needs no process group; a pod's hosts share a gloo group."""
    if xr.process_count() == 1:
        return True
    if not dist.is_initialized():
        import torch_xla.distributed.xla_backend  # noqa: F401  registers init_method="xla://"
        dist.init_process_group("gloo", init_method="xla://")
    return False


def _barrier(no_dist):
    """Wait for every host (xm.rendezvous would compile and run an XLA graph, even alone)."""
    if not no_dist:
        dist.barrier()


@contextlib.contextmanager
def _quiet():
    """Silence the UserWarnings DCP and torch_xla raise on every call (single process, deprecated internals)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning, module=r"torch(_xla)?\.distributed\.")
        yield


def _state(model, optimizer):
    state = {"model": model.state_dict()}
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


def checkpoints(directory):
    """The complete checkpoints in `directory` (step_XXXXXXXX folders holding meta.json), oldest first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if STEP_DIR.fullmatch(p.name) and (p / META).is_file()]
    return sorted(found, key=lambda p: int(STEP_DIR.fullmatch(p.name)[1]))


def latest(directory):
    """The newest complete checkpoint in `directory` (a Path), or None."""
    found = checkpoints(directory)
    return found[-1] if found else None


def _remove(path):
    """Delete a folder: first renamed out of sight, so a crash mid-delete leaves no half checkpoint."""
    trash = path.with_name(".trash_" + path.name)
    shutil.rmtree(trash, ignore_errors=True)
    path.replace(trash)
    shutil.rmtree(trash)


def save(directory, step, model, optimizer=None, extra=None, keep=3):
    """Checkpoint `model` (and `optimizer`) at `step` into directory/step_{step:08d}/; returns that Path.

    `extra`: a JSON-able dict stored in meta.json (data position, seed, config, ...).
    Every process of a pod calls this. Afterwards only the newest `keep` checkpoints remain.
    """
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
    final = Path(directory) / f"step_{step:08d}"
    tmp = final.with_name(".tmp_" + final.name)
    no_dist, lead = _no_dist(), xr.process_index() == 0
    if lead:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a save that crashed
        tmp.mkdir(parents=True)
    _barrier(no_dist)
    torch_xla.sync()
    xm.wait_device_ops()
    with _quiet():
        dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp), planner=_SavePlanner(), no_dist=no_dist)
    if lead:
        with open(tmp / META, "w") as f:
            json.dump(meta, f, indent=1)
            f.flush()
            os.fsync(f.fileno())  # on disk before the rename makes the checkpoint visible
        if final.exists():
            _remove(final)
        tmp.replace(final)  # atomic: readers see the checkpoint whole or not at all
        for old in checkpoints(directory)[:-keep]:
            _remove(old)
    _barrier(no_dist)
    return final


def read_meta(path):
    """The meta.json of the checkpoint at `path`: step, extra, contents (model, optimizer), tensors ({name: shape})."""
    file = Path(path) / META
    try:
        with open(file) as f:
            meta = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"{file} is missing, so {path} is not a complete checkpoint; pass another "
                         f"step_ folder, or the parent folder to take the newest complete one") from None
    except ValueError as e:  # truncated or not text
        raise ValueError(f"{file} is corrupt ({e}); delete {path} to fall back to the previous checkpoint") from None
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
    """A checkpoint folder as given, or the newest complete one inside a folder of checkpoints."""
    path = Path(path)
    if STEP_DIR.fullmatch(path.name) or (path / META).exists():
        return path
    found = latest(path)
    if found is None:
        raise ValueError(f"no complete checkpoint in {str(path)!r} (a step_XXXXXXXX folder holding {META}); "
                         f"check the path, or train without resuming")
    return found


def init_optimizer_state(optimizer):
    """Create the optimizer's state (one step with zero gradients) so `load` has tensors to fill.

    Call it on a fresh optimizer before `load`; it leaves the gradients unset. No-op if state exists.
    """
    if not optimizer.state:
        prime_optimizer(optimizer)
        optimizer.zero_grad(set_to_none=True)
    return optimizer


def load(path, model, optimizer=None):
    """Load a checkpoint into the sharded `model` (and `optimizer`) in place, keeping every sharding.

    `path`: a step_XXXXXXXX folder, or a folder of them (the newest complete one is taken).
    Names and shapes are checked against meta.json before any data is read. Returns the meta dict.
    """
    path = _resolve(path)
    meta = read_meta(path)
    state = _state(model, optimizer)
    _check(meta, state, path)
    torch_xla.sync()
    with _quiet():
        dcp.load(state, storage_reader=dcp.FileSystemReader(path), planner=SPMDLoadPlanner(), no_dist=_no_dist())
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])  # param_groups (lr, ...); state tensors stay the same objects
    return meta


def export_hf(model, out_dir):
    """Write `model` (sharded or not) as a Hugging Face folder: config.json + model.safetensors.

    Each weight is gathered to the CPU; process 0 writes. Load it with `load_hf` or from_pretrained.
    """
    torch_xla.sync()
    weights = {n: t.cpu() for n, t in model.state_dict().items()}
    if xr.process_index() == 0:
        model.save_pretrained(out_dir, state_dict=weights, safe_serialization=True)
    return out_dir


def load_hf(path):
    """A LlamaForCausalLM in fp32 on the CPU from a local Hugging Face folder (never downloads)."""
    if not (Path(path) / "config.json").is_file():
        raise ValueError(f"{str(path)!r} has no config.json; pass a local folder written by export_hf or "
                         f"save_pretrained (load_hf never downloads)")
    try:
        return LlamaForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32)
    except OSError as e:
        raise ValueError(f"{str(path)!r} has a config.json but no readable weights ({e}); "
                         f"re-export it with export_hf") from None
