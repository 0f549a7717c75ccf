"""dtensor.py: Tables 1 and 2 as DTensor placements, checked against torch_xla SPMD and the unsharded model.

One `torchrun --nproc-per-node 4` launch (gloo, CPU processes) runs every positive check and prints a
JSON line per check (tests/dtensor_run.py). torch_xla's side runs in plain child processes of this test
(CPU_NUM_DEVICES=4): one before the launch (its blocks, training step, Generator tokens and checkpoint),
one after (loading the DTensor launch's checkpoint). A hang fails the test at its timeout.
"""
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from llama_xla_helpers import dtensor
from llama_xla_helpers.configs import get_config
from dtensor_run import TRAIN, reference_model

RUN = str(Path(__file__).with_name("dtensor_run.py"))
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"]
SPMD_ENV = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="4")
# fp32 tolerances, fixed from what was measured (tiny config with 2 layers, torch 2.9, 4 gloo processes):
LOGITS_ATOL = 2e-6   # measured 6.6e-7 on (2, 2), 5.4e-7 on (1, 4), 5.1e-7 for "fsdp"
LOSS_ATOL = 1e-6     # measured at most 4.8e-7 (1 ulp of a loss near 5.6) off both, after 1 and 2 steps
LR = TRAIN.lr        # AdamW's, 1e-3; an update is about lr per weight, and a sign flip of a near-zero gradient 2 lr
WEIGHT_ATOL = 0.1 * LR  # all weights; measured after 2 steps: 3.9e-5 (0.04 lr) off the unsharded model, 1.2e-5 off SPMD
CLOSE, FEW = 1e-3 * LR, 1e-3  # all but FEW of the weights within CLOSE; measured: 5.6e-5 and 4.1e-5 of them beyond it


def launch(argv, env=None, timeout=240):
    """Run argv in its own process group; returns (returncode, JSON lines of stdout, stderr). At the
    timeout the whole group (torchrun and its ranks) is killed and the test fails: a rank hung."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(argv[-3:])} did not finish within {timeout} s (a rank hangs?): {err[-3000:]}")
    return proc.returncode, [json.loads(line) for line in out.splitlines() if line.startswith("{")], err


def checks(lines):
    """{(check, mesh, strategy): line}; mesh and strategy None where a check has none."""
    return {(c["check"], tuple(c["mesh"]) if "mesh" in c else None, c.get("strategy")): c for c in lines}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """SPMD child, then the one DTensor launch, then an SPMD child loading its checkpoint."""
    out = tmp_path_factory.mktemp("dtensor")
    code, spmd, err = launch([sys.executable, RUN, "spmd", str(out)], SPMD_ENV)
    assert code == 0, err[-3000:]
    spmd = checks(spmd)
    code, _, err = launch(TORCHRUN + [RUN, "dtensor", str(out), spmd["train", None, None]["checkpoint"]])
    assert code == 0, err[-3000:]
    dt = checks(json.loads(line) for line in (out / "dtensor.jsonl").read_text().splitlines())
    code, _, err = launch([sys.executable, RUN, "spmd-load", str(out), dt["checkpoint", None, None]["saved"]], SPMD_ENV)
    assert code == 0, err[-3000:]
    return dict(spmd=spmd, dtensor=dt, out=out)


pytestmark = pytest.mark.child_process  # the SPMD side opens the XLA device in a child process


@pytest.mark.parametrize("mesh, strategy", [((2, 2), "2d"), ((1, 4), "2d"), ((2, 2), "fsdp")])
def test_sharded_logits_equal_the_unsharded_models(runs, mesh, strategy):
    line = runs["dtensor"]["logits", mesh, strategy]
    assert line["max_abs_diff"] < LOGITS_ATOL
    if strategy == "2d":  # Table 2's lm_head row: (bsz, seqlen, vocab_size) on ('data', None, 'model')
        batch = "Shard(dim=0)" if mesh[0] > 1 else "Replicate()"  # an axis of one device: replicated
        assert line["placements"] == f"({batch}, Shard(dim=2))"


@pytest.mark.parametrize("mesh, strategy", [((2, 2), "2d"), ((1, 4), "2d"), ((2, 2), "fsdp")])
def test_each_rank_holds_the_block_its_xla_device_holds(runs, mesh, strategy):
    """DTensor's blocks (each rank's offsets and local shape) against the shards torch_xla reports."""
    got = runs["dtensor"]["blocks", mesh, strategy]["blocks"]
    want = runs["spmd"]["blocks", mesh, strategy]["blocks"]
    assert got == want
    q = "model.layers.0.self_attn.q_proj.weight"
    assert len({json.dumps(b) for _, b in got[q]}) == 4  # four different blocks: split on both axes (or 4 ways)


def test_two_adamw_steps_give_the_losses_and_weights_of_spmd_and_of_the_unsharded_model(runs):
    dt, spmd = runs["dtensor"]["train", None, None], runs["spmd"]["train", None, None]
    assert dt["losses"] == pytest.approx(dt["unsharded_losses"], abs=LOSS_ATOL)
    assert dt["losses"] == pytest.approx(spmd["losses"], abs=LOSS_ATOL)
    assert dt["losses"][1] < dt["losses"][0]  # it learns
    weights = torch.load(runs["out"] / "dtensor_weights.pt")
    initial = {n: p.detach() for n, p in reference_model().named_parameters()}  # seed 0, as both started
    for other in ("unsharded_weights.pt", "spmd_weights.pt"):
        want = torch.load(runs["out"] / other)
        assert want.keys() == weights.keys()
        diffs = torch.cat([(weights[n] - want[n]).abs().flatten() for n in want])
        assert diffs.max() < WEIGHT_ATOL, other
        assert (diffs > CLOSE).float().mean() < FEW, other
    moved = torch.cat([(weights[n] - initial[n]).abs().flatten() for n in weights])
    assert moved.median() > 0.5 * LR  # the steps moved the weights by about lr: the tolerances are small beside it


def test_a_dcp_checkpoint_goes_from_dtensor_to_spmd_and_back(runs):
    """DTensor saves (dtensor.save) and checkpoint.load reads it into the SPMD model; checkpoint.save's
    SPMD checkpoint loads into a DTensor model (dtensor.load): each model ends with the other's values,
    bit for bit (both loaded into a model initialized with another seed)."""
    out = runs["out"]
    for loaded, saved in (("spmd_loaded.pt", "dtensor_weights.pt"), ("dtensor_loaded.pt", "spmd_weights.pt")):
        got, want = torch.load(out / loaded), torch.load(out / saved)
        assert got.keys() == want.keys()
        assert all(torch.equal(got[n], want[n]) for n in want), (loaded, saved)


@pytest.mark.parametrize("mesh", [(1, 4), (2, 2)])
def test_tensor_parallel_greedy_decode_gives_the_generators_tokens(runs, mesh):
    line = runs["dtensor"]["decode", mesh, None]
    assert line["tokens"] == line["unsharded"] == runs["spmd"]["generator", None, None]["tokens"]
    # No pick is a near-tie that rounding could flip: every top-two gap is over 100x the logits' tolerance
    # (the seed-0 model's closest pick: 6.9e-4, about 1,000x the measured logit differences)
    assert line["min_margin"] > 100 * LOGITS_ATOL
    config = get_config("tiny")
    tp = mesh[1]
    assert line["local_cache"] == [1, 64, config.num_key_value_heads // tp, config.head_dim]  # this rank's heads
    assert line["cache_type"] == "Tensor"  # a local tensor, not a DTensor


def test_placements_from_partition_specs():
    assert dtensor.placements(("model", "data")) == [Shard(1), Shard(0)]
    assert dtensor.placements(("data", None, "model")) == [Shard(0), Shard(2)]
    assert dtensor.placements((None,)) == [Replicate(), Replicate()]
    assert dtensor.placements((("data", "model"), None)) == [Shard(0), Shard(0)]
    with pytest.raises(ValueError, match=r"dim 0 is split over \('model', 'data'\), not in the mesh's order"):
        dtensor.placements((("model", "data"), None))


def test_bad_meshes_are_named_before_any_process_starts():
    config = get_config("tiny", num_hidden_layers=2)
    with pytest.raises(ValueError, match=r"mesh shape \(2, 4\) needs 8 processes but the job has 4 \(WORLD_SIZE\); "
                                         r"launch torchrun --nproc-per-node 8, or use a mesh of 4 processes, "
                                         r"e.g. \(1, 4\)"):
        dtensor.check_mesh((2, 4), config, 4)
    with pytest.raises(ValueError, match=r"num_key_value_heads=2 is not divisible by the 'model' axis of size 4 .* "
                                         r"is 1 or 2, or replicate the KV heads"):
        dtensor.check_mesh((1, 4), get_config("tiny", num_key_value_heads=2), 4)
    with pytest.raises(ValueError, match=r"model.embed_tokens.weight: dim 0 of shape \(262, 128\) is not divisible by "
                                         r"mesh axis 'model' of size 4; use a mesh whose 'model' axis has size 1 or 2"):
        dtensor.check_mesh((1, 4), get_config("tiny", vocab_size=262), 4)


def bad_launch(case):
    """Every rank raises the same one-line error, and the launch ends (no rank waits in a collective)."""
    code, lines, err = launch(TORCHRUN + [RUN, case], timeout=120)
    assert code != 0
    assert sorted(line["rank"] for line in lines) == [0, 1, 2, 3], err[-3000:]
    assert len({line["error"] for line in lines}) == 1
    return lines[0]["error"]


def test_a_world_size_that_does_not_match_the_mesh_is_one_error_on_every_rank():
    assert bad_launch("bad-world").startswith("mesh shape (2, 4) needs 8 processes but the job has 4 (WORLD_SIZE)")


@pytest.mark.variants
def test_a_mesh_that_does_not_divide_the_heads_is_one_error_on_every_rank():
    assert bad_launch("bad-heads").startswith("num_key_value_heads=2 is not divisible by the 'model' axis of size 4")
