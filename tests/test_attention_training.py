"""Training with blockwise attention follows eager attention: 5 steps' losses under FSDP with gradient
checkpointing and scan together (make test, and at 1, 4 and 16 devices), and under 2D, FSDP,
checkpointing, scan and bf16 one at a time (marked `variants`: make check-variants at 8 devices), and the
gradients under 2D and FSDP. Apart from
test_attention.py because these compile the most (a process of their own in make test: Makefile, TESTS_OWN)."""
import dataclasses

import pytest
import torch
import torch_xla

from llama_xla_helpers import attention
from llama_xla_helpers.attention import use
from llama_xla_helpers.train import build_model, first_batch, forward_loss, setup, train
from test_attention import GRAD_TOL, LOSS_TOL, SMALL

LOSS_TOL_BF16 = 2e-2  # LOSS_TOL in bf16 (8-bit mantissas: about 4e-3 relative per rounding)

TRAINING = {  # name -> what differs from SMALL
    "fsdp+checkpointing+scan": {"strategy": "fsdp", "gradient_checkpointing": True, "scan_layers": True},
    "2d": {},
    "fsdp": {"strategy": "fsdp"},
    "checkpointing": {"gradient_checkpointing": True},
    "scan": {"scan_layers": True},
    "bf16": {"dtype": "bf16"},
}
# The combined configuration runs in make test and at every device count (`devices`); each option alone
# runs at 8 devices in make check-variants (`variants`): one process compiling all six at 4 devices passed
# vm.max_map_count (conftest.py stopped it).
COMBINED = "fsdp+checkpointing+scan"


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.devices if c == COMBINED else pytest.mark.variants)
                                  for c in TRAINING])
def test_training_with_blockwise_attention_follows_eager(case, monkeypatch):
    monkeypatch.setattr(attention, "BLOCK", 8)  # 4 x 4 blocks of a 32-token row
    cfg = dataclasses.replace(SMALL, **TRAINING[case])
    eager_run = train(dataclasses.replace(cfg, attention="eager"))
    blockwise_run = train(dataclasses.replace(cfg, attention="blockwise"))
    tol = LOSS_TOL_BF16 if cfg.dtype == "bf16" else LOSS_TOL
    assert blockwise_run.train_compiles == 2
    assert list(blockwise_run.losses) == [1, 2, 3, 4, 5]
    for step, loss in eager_run.losses.items():
        assert blockwise_run.losses[step] == pytest.approx(loss, abs=tol), step
    assert blockwise_run.losses[5] < blockwise_run.losses[1]


@pytest.mark.devices
@pytest.mark.parametrize("strategy", ["2d", "fsdp"])
def test_blockwise_gradients_equal_eager(strategy):
    cfg, mesh, config = setup(dataclasses.replace(SMALL, strategy=strategy))
    ids = first_batch(cfg, mesh)
    grads = {}
    for implementation in ("eager", "blockwise"):
        model = build_model(config, mesh, strategy, cfg.seed, dtype=torch.float32)
        use(model, mesh, implementation, block=8)
        forward_loss(model, ids).backward()
        torch_xla.sync()  # one graph for all the gradients, not one per .cpu()
        grads[implementation] = {n: p.grad.cpu() for n, p in model.named_parameters()}
    for name, want in grads["eager"].items():
        assert (grads["blockwise"][name] - want).abs().max() <= GRAD_TOL * want.abs().max(), name
