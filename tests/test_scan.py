"""Scan over the decoder layers (TrainConfig.scan_layers): the losses of the unrolled model, each
weight's sharding kept inside the compiled loop, and recompute (gradient checkpointing) inside it."""
import dataclasses
import re

import pytest
import torch_xla

from llama_xla_helpers import train as train_module
from llama_xla_helpers.configs import get_config
from llama_xla_helpers.hlo import BUFFER_ASSIGNMENT, compiled_hlo, instructions, temp_bytes
from llama_xla_helpers.mesh import mesh_shape
from llama_xla_helpers.sharding import shard_shape
from llama_xla_helpers.train import TrainConfig, build_model, first_batch, forward_loss, prepare_layers, setup, train
from test_train import SMALL_FP32, cpu_losses
from util import N

MESH = mesh_shape(N, get_config("tiny"))  # the automatic pick: both axes used where the device count allows


@pytest.mark.devices
@pytest.mark.parametrize("strategy, recompute", [("2d", False), ("fsdp", True)])
def test_scanned_layers_train_like_the_unrolled_model(strategy, recompute):
    cfg = dataclasses.replace(SMALL_FP32, steps=5, strategy=strategy, mesh=MESH if strategy == "2d" else (N, 1),
                              scan_layers=True, gradient_checkpointing=recompute)
    result = train(cfg)
    want = cpu_losses(cfg)  # the unrolled Hugging Face model, unsharded, in plain PyTorch
    assert list(result.losses) == list(want)
    for step in want:
        assert result.losses[step] == pytest.approx(want[step], abs=2e-4), step
    assert type(result.model.model.layers[0]).__name__ == "LlamaDecoderLayer"  # modules and state dict unchanged


def loop_types(hlo):
    """The tuple type of every while loop in an HLO module: what the loop carries from one layer to the next."""
    return [re.match(r"\s*%\S+ = \((.*?)\) while\(", line).group(1) for line in instructions(hlo, "while")]


def compiled_backward(cfg, kind="after_optimizations.txt"):
    """The model of cfg and what XLA compiled (`kind`, see hlo.compiled_hlo) for one forward and backward."""
    cfg, mesh, config = setup(cfg)
    model = build_model(config, mesh, cfg.strategy)
    prepare_layers(model, cfg)
    ids = first_batch(cfg, mesh)
    with compiled_hlo(kind) as modules:
        forward_loss(model, ids).backward()
        torch_xla.sync()
    return model, mesh, "".join(modules)


@pytest.mark.devices
def test_the_loop_carries_each_weight_sharded():
    """The compiled step loops over the stacked weights, each as its own shard: (layers, *shard)."""
    cfg = TrainConfig(seq_len=24, batch_size=max(8, N), mesh=MESH, scan_layers=True)  # seq_len 24: not cached
    model, mesh, hlo = compiled_backward(cfg)
    loops = loop_types(hlo)
    assert len(loops) == 2  # forward and backward: the layers are not unrolled
    layers = model.config.num_hidden_layers
    for name, p in model.model.layers[0].named_parameters():
        if p.dim() == 2:  # the seven projections
            shard = f"f32[{layers},{','.join(map(str, shard_shape(p)))}]"
            assert all(shard in loop for loop in loops), (name, shard, loops)
            if mesh.size() > 1:
                whole = f"f32[{layers},{','.join(map(str, p.shape))}]"
                assert not any(whole in loop for loop in loops), (name, whole)


def test_recompute_inside_the_scan_keeps_fewer_activations():
    cfg = TrainConfig(seq_len=48, batch_size=max(8, N), mesh=MESH, scan_layers=True)
    kept = temp_bytes(compiled_backward(cfg, BUFFER_ASSIGNMENT)[2])
    recomputed = temp_bytes(compiled_backward(dataclasses.replace(cfg, gradient_checkpointing=True),
                                              BUFFER_ASSIGNMENT)[2])  # another graph: compiled, not cached
    print(f"scratch bytes per device: {kept:,} keeping activations, {recomputed:,} recomputing them")
    assert recomputed < kept


def test_without_torchax_the_cli_says_how_to_install_it_before_any_work(monkeypatch, capsys):
    """torch_xla 2.9's wheel overwrites the scan extra's torchax with one that needs flax; the CLI
    then stops with one error line naming the fix, not in the first backward pass."""
    monkeypatch.setattr(train_module.jax_workarounds, "maybe_get_torchax", lambda: None)
    monkeypatch.setattr(train_module, "build_model", lambda *a, **k: pytest.fail("built a model"))
    with pytest.raises(SystemExit) as exit:
        train_module.main(["--steps", "1", "--scan-layers"])
    assert exit.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: scan_layers=True (--scan-layers) under SPMD needs torchax")
    assert "pip install --no-deps --force-reinstall torchax==0.0.7" in err
