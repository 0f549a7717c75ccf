"""bf16 training (what a TPU runs by default): it follows fp32, fp32 master weights keep the updates bf16
parameters lose, and a bf16 run resumes bit for bit. (Apart from test_train.py: XLA:CPU keeps every
compiled program mapped, and one process compiling both files' graphs crosses the kernel's limit.)"""
import dataclasses

import pytest
import torch
import torch_xla
from torch.utils.data import TensorDataset

from llama_xla_helpers import checkpoint
from llama_xla_helpers.data import StepSampler, load_corpus, train_val_split
from llama_xla_helpers.hlo import dot_dtypes
from llama_xla_helpers.sharding import sharded_loader
from llama_xla_helpers.train import (DTYPES, Adafactor, build_model, first_batch, forward_loss, setup, train,
                                     train_step)
from test_train import SMALL
from util import preempted


def step_dots(model, cfg, mesh):
    """{dtype: count} of the matmuls of a training step's forward and backward, traced, not run."""
    forward_loss(model, first_batch(cfg, mesh)).backward()
    dots = dot_dtypes([p.grad for p in model.parameters()])
    model.zero_grad(set_to_none=True)
    return dots


@pytest.mark.devices
def test_bf16_training_follows_fp32():
    """bf16 parameters and matmuls (fp32 norms, softmax, loss, optimizer math and master weights):
    the losses follow fp32's."""
    fp32 = train(dataclasses.replace(SMALL, steps=3, dtype="fp32"))
    bf16 = train(dataclasses.replace(SMALL, steps=3, dtype="bf16"))
    assert {p.dtype for p in bf16.model.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in fp32.model.parameters()} == {torch.float32}
    cfg, mesh, _ = setup(SMALL)
    assert set(step_dots(bf16.model, cfg, mesh)) == {"bf16"} and set(step_dots(fp32.model, cfg, mesh)) == {"f32"}
    for step, loss in fp32.losses.items():
        assert bf16.losses[step] == pytest.approx(loss, abs=0.05), step  # bf16 keeps ~3 significant digits
    assert bf16.losses[3] < bf16.losses[1]


def weight_changes(dtype, master_weights, steps=10, lr=1e-4):
    """Train `steps` steps at a fine-tuning learning rate; after each, the change of every weight since
    the start, in fp32: the fp32 master copy where the optimizer keeps one, else the parameter."""
    cfg, mesh, config = setup(dataclasses.replace(SMALL, dtype=dtype, lr=lr))
    model = build_model(config, mesh, dtype=DTYPES[dtype])
    optimizer = Adafactor(model.parameters(), lr=lr, master_weights=master_weights)
    start = [p.detach().float().cpu() for p in model.parameters()]
    train_ids, _ = train_val_split(load_corpus(), cfg.seq_len)
    loader = sharded_loader(TensorDataset(train_ids), cfg.batch_size, mesh,
                            sampler=StepSampler(len(train_ids), cfg.batch_size, cfg.seed, 0, steps))
    changes = []
    for (ids,) in loader:
        train_step(model, optimizer, ids)
        torch_xla.sync()
        weights = [optimizer.state[p].get("master", p) for p in model.parameters()]
        changes.append(torch.cat([(w.detach().float().cpu() - w0).flatten() for w, w0 in zip(weights, start)]))
    assert set(step_dots(model, cfg, mesh)) == {"f32" if dtype == "fp32" else "bf16"}
    return changes


@pytest.mark.devices
def test_bf16_master_weights_keep_the_updates_that_bf16_parameters_lose():
    """At lr 1e-4 most of Adafactor's updates (about 1e-4 of a weight) are below bf16's resolution
    (2^-9 of a weight). With fp32 master weights the bf16 run's weights move as fp32's do: after every
    one of 10 steps, the change since the start is within 25% of fp32's (relative L2 norm; the
    tolerance was fixed before measuring, over 20 steps: the first 10 are the same steps, a run's batch
    s depends on the seed and s only). Plain bf16 parameters lose most updates and miss it."""
    fp32 = weight_changes("fp32", master_weights=True)
    master = weight_changes("bf16", master_weights=True)
    plain = weight_changes("bf16", master_weights=False)
    error = lambda run: [((d - f).norm() / f.norm()).item() for d, f in zip(run, fp32)]
    print("master weights:", [f"{e:.3f}" for e in error(master)])
    print("plain bf16:    ", [f"{e:.3f}" for e in error(plain)])
    assert max(error(master)) < 0.25
    assert min(error(plain)) > 0.25


@pytest.mark.parametrize("options", [{}], ids=["adafactor"])  # test_loop.py: with OPTIONS
def test_a_bf16_run_resumes_as_if_never_interrupted(tmp_path, monkeypatch, options):
    """bf16 by default (LLAMA_XLA_DEFAULT_DTYPE, as on a TPU): the fp32 optimizer state and master
    weights come back fp32, and the resumed losses equal the uninterrupted run's, bit for bit."""
    monkeypatch.setenv("LLAMA_XLA_DEFAULT_DTYPE", "bf16")
    run = dataclasses.replace(SMALL, steps=6, checkpoint_every=3, checkpoint_dir=str(tmp_path / "ck"), **options)
    whole = train(dataclasses.replace(run, checkpoint_dir=str(tmp_path / "whole")))
    assert {p.dtype for p in whole.model.parameters()} == {torch.bfloat16}
    preempted(run, 3, monkeypatch)
    resumed = train(dataclasses.replace(run, resume=True))
    assert resumed.losses == {step: whole.losses[step] for step in (4, 5, 6)}
    state = {k: v.dtype for s in resumed.optimizer.state.values() for k, v in s.items() if v.dim()}
    assert set(state.values()) == {torch.float32} and "master" in state
    meta = checkpoint.read_meta(checkpoint.latest(run.checkpoint_dir))
    assert meta["extra"]["dtypes"] == dict(parameters="bf16", compute="bf16", master_weights="fp32")
    assert meta["extra"]["attention"] == resumed.attention == "blockwise"  # what ran (on a TPU: flash, or its padding)
    cfg, mesh, _ = setup(SMALL)
    assert set(step_dots(resumed.model, cfg, mesh)) == {"bf16"}
