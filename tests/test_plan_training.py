"""metrics.plan_training, the training memory planner, against what XLA and the optimizers hold.

- parameters and Adafactor's state: equal to train.profile_step's per-device bytes (fp32, the tiny
  model, 2D and FSDP, with and without gradient checkpointing);
- activations: within 25% of the compiled step's scratch memory (profile_step's temp_bytes; the
  tolerance was fixed before measuring), with eager attention and with blockwise. Scratch also
  holds the gradients and the optimizer's temporaries, which the plan counts apart; the ratios are
  printed. FSDP with checkpointing misses (0.552), and so does blockwise attention (0.66 and 0.67):
  expected failures, see MISSES. make test profiles two of the six configurations (QUICK: both
  strategies, both checkpointing settings), make check-variants the rest;
- the optimizer state in bf16 (optim.AdamW under 2D and FSDP, optim.Adafactor under 2D: fp32 moments and
  master copies): the shard shapes of the state a training step on the sharded tiny model leaves; the
  gradients: the parameters' dtype and shape (the plan's gradient bytes are the parameter bytes).
- the plan for Llama 3 8B / 70B slices and beside the published runs (printed: `pytest -s`).
"""
import json
import math
import os
import subprocess
import sys

import pytest
import torch
import torch_xla

from llama_xla_helpers.configs import get_config
from llama_xla_helpers.metrics import (HBM_BYTES, PUBLISHED_TRAINING, activation_bytes, param_count,
                                       plan_training, published_training, training_table)
from util import N

TINY = get_config("tiny")
TENSORS = 39  # tiny's parameter tensors: embedding, 4 x (7 weights + 2 norms), final norm, lm_head
NORMS = 9     # of them 1-D (norm weights, 128 each)


def test_parameters_and_optimizer_state_by_hand():
    # FSDP on 8: every tensor split 8 ways along a dim that divides (norms too), fp32.
    plan = plan_training(TINY, (8, 1), "fsdp", batch=8, seq_len=64, dtype="fp32", optimizer="adafactor")
    assert plan.param_bytes == plan.grad_bytes == param_count(TINY) * 4 // 8 == 427_584
    # Adafactor row + column per weight: embedding/lm_head (264/8 + 128), q/o (128/8 + 128), k/v (64 + 128/8),
    # gate/up (384/8 + 128), down (128 + 384/8); norms 128/8; a 0-d step per tensor.
    rows_cols = 2 * (33 + 128) + 4 * (2 * (16 + 128) + 2 * (64 + 16) + 3 * (48 + 128)) + NORMS * 16
    assert plan.optimizer_bytes == 4 * rows_cols + 4 * TENSORS == 17_636
    # 2D on (4, 2): Table 1 splits every weight on both axes, norms replicated (their state on 'model').
    plan = plan_training(TINY, (4, 2), "2d", batch=8, seq_len=64, dtype="fp32", optimizer="adafactor")
    assert plan.param_bytes == (param_count(TINY) - NORMS * 128) * 4 // 8 + NORMS * 128 * 4 == 431_616
    rows_cols = 2 * (132 + 32) + 4 * (2 * (32 + 64) + 2 * (16 + 64) + 3 * (192 + 32)) + NORMS * 64
    assert plan.optimizer_bytes == 4 * rows_cols + 4 * TENSORS
    # bf16 AdamW: 2-byte parameters and gradients; fp32 moments (2 per element) and master copy (1).
    plan = plan_training(TINY, (4, 2), "2d", batch=8, seq_len=64, dtype="bf16", optimizer="adamw")
    weights = (param_count(TINY) - NORMS * 128) // 8
    assert plan.param_bytes == plan.grad_bytes == 2 * (weights + NORMS * 128)
    assert plan.optimizer_bytes == 4 * (2 * (weights + NORMS * 64) + weights + NORMS * 128) + 4 * TENSORS
    no_master = plan_training(TINY, (4, 2), "2d", batch=8, seq_len=64, optimizer="adamw", master_weights=False)
    assert plan.optimizer_bytes - no_master.optimizer_bytes == 4 * (weights + NORMS * 128)
    # Gathered: one decoder layer's weights (196,608 > the lm_head's 33,792) over 'data', split over 'model',
    # and their gradients, bf16.
    assert plan.gathered_bytes == 2 * 2 * (196_608 // 2)
    assert plan.total_bytes == (plan.param_bytes + plan.grad_bytes + plan.optimizer_bytes + plan.activation_bytes
                                + plan.gathered_bytes)
    assert plan_training(TINY, (1, 2), "2d", 8, 64).gathered_bytes == plan_training(TINY, (1, 1), "fsdp", 8, 64).gathered_bytes == 0
    assert plan.fits == {chip: True for chip in HBM_BYTES}


def test_activations_by_hand():
    """The formula of activation_bytes, written out for the tiny model, batch 2 x 8 tokens, fp32, one chip."""
    b, s, d, H, hd, I, V, L, p = 2, 8, 128, 8, 16, 384, 264, 4, 4
    hidden, heads, scores, mlp, vocab = b * s * d, b * s * H * hd, b * H * s * s, b * s * I, b * s * V
    layer = (2 * (4 + 2 * p) * hidden + 2 * 4 * b * s    # 2 norms: fp32 input, normalized, output; 1/rms
             + 4 * p * heads + 4 * scores                  # q, k, v (repeated), attention output; softmax
             + 4 * p * mlp)                                # gate, silu(gate), up, product
    tail = (4 + 2 * p) * hidden + 4 * b * s + 4 * vocab   # final norm, log-softmax of the logits
    # At the loss: the layers' saved tensors, the tail's, the gradients of log-probs and logits (fp32); in
    # the last layer's backward (the tail freed): the layers' and that layer's largest transient gradients.
    assert activation_bytes(TINY, 2, 8, "fp32") == L * layer + max(tail + 8 * vocab, 2 * 4 * scores, 3 * p * mlp)
    assert activation_bytes(TINY, 2, 8, "fp32") == 813_120
    # Checkpointing: 4 layer inputs, then one layer again (its input counted once) or the tail, the larger.
    again = layer - 4 * hidden + max(2 * 4 * scores, 3 * p * mlp)
    assert activation_bytes(TINY, 2, 8, "fp32", remat=True) == L * p * hidden + max(tail + 8 * vocab, again)
    # bf16: the softmax keeps its fp32 output and a bf16 copy; flash attention keeps no s x s matrix.
    assert activation_bytes(TINY, 2, 8, "bf16") < activation_bytes(TINY, 2, 8, "fp32")
    assert activation_bytes(TINY, 2, 512, "fp32", attention="flash") < activation_bytes(TINY, 2, 512, "fp32") / 2
    # blockwise (attention.py): q and the output, k and v not repeated (4 KV heads), one log-sum-exp per row;
    # at the peak of a layer's backward one block pair's fp32 scores, probabilities, their gradient, and ds.
    G, B = 4, 4
    blockwise = layer - 4 * p * heads - 4 * scores + 2 * p * heads + 2 * p * b * s * G * hd + 4 * b * H * s
    transient = max(tail + 8 * vocab, (12 + p) * b * H * B * B, 3 * p * mlp)
    assert activation_bytes(TINY, 2, 8, "fp32", attention="blockwise", block=B) == L * blockwise + transient
    # The batch splits over 'data', Table 2's last dims over 'model'.
    assert activation_bytes(TINY, 8, 64, "fp32", data=4) == activation_bytes(TINY, 2, 64, "fp32")
    assert activation_bytes(TINY, 2, 64, "fp32", model=2) < activation_bytes(TINY, 2, 64, "fp32") / 1.9


@pytest.mark.parametrize("call, words", [
    (lambda: plan_training(TINY, (8, 1), "fsdp", 12, 64), ["batch=12", "'data' axis of size 8", "multiple of 8"]),
    (lambda: plan_training(TINY, (8, 1), "tp", 8, 64), ["strategy='tp'", "2d, fsdp"]),
    (lambda: plan_training(TINY, (8, 1), "fsdp", 8, 64, optimizer="sgd"), ["optimizer='sgd'", "adamw, adafactor"]),
    (lambda: plan_training(TINY, (8, 1), "fsdp", 8, 64, dtype="fp16"), ["dtype='fp16'", "fp32, bf16"]),
    (lambda: plan_training(TINY, (8, 1), "fsdp", 8, 64, attention="sdpa"), ["attention='sdpa'", "eager, blockwise, flash"]),
    (lambda: plan_training(TINY, (8, 1), "fsdp", 0, 64), ["batch=0", "int >= 1"]),
    (lambda: plan_training(TINY, (8, 1), "fsdp", 8, -1), ["seq_len=-1", "int >= 1"]),
    (lambda: plan_training(TINY, (8,), "fsdp", 8, 64), ["mesh_shape=(8,)", "two ints >= 1", "(4, 2)"]),
    (lambda: plan_training(TINY, (1, 3), "2d", 3, 64), ["hidden_size=128", "'model' of size 3", "size 1"]),
    (lambda: plan_training(TINY, (3, 1), "fsdp", 3, 64), ["q_proj.weight", "not divisible", "has size 1"]),
    (lambda: activation_bytes(TINY, 4, 64, data=3), ["batch=4", "size 3", "multiple of 3"]),
])
def test_bad_input_names_value_limit_and_fix(call, words):
    with pytest.raises(ValueError) as err:
        call()
    for word in words:
        assert word in str(err.value)


def test_llama3_tables_for_a_notebook():
    """Llama 3 8B and 70B, FSDP and 2D, on v5e / v6e / v5p slices; and the published runs beside the plan."""
    runs = [("8B fsdp 8 chips", "llama3-8b", (8, 1), "fsdp", 8), ("8B 2d 8 chips", "llama3-8b", (2, 4), "2d", 2),
            ("70B fsdp 64", "llama3.1-70b", (64, 1), "fsdp", 64), ("70B 2d 64", "llama3.1-70b", (16, 4), "2d", 16),
            ("70B fsdp 256", "llama3.1-70b", (256, 1), "fsdp", 256)]
    plans = {label: plan_training(get_config(name), mesh, strategy, batch, 2048, remat=True)
             for label, name, mesh, strategy, batch in runs}
    print(training_table(list(plans.values()), labels=list(plans)))
    # bf16 AdamW with master copies: 2 + 2 + 12 bytes per parameter, split over the chips.
    assert plans["8B fsdp 8 chips"].param_bytes * 8 == pytest.approx(2 * param_count(get_config("llama3-8b")), rel=1e-4)
    assert not plans["70B fsdp 64"].fits["tpu-v5e"] and plans["70B fsdp 256"].fits["tpu-v6e"]
    assert plans["8B 2d 8 chips"].activation_bytes < plans["8B fsdp 8 chips"].activation_bytes  # split over 'model'
    rows = published_training()
    print(training_table([r["plan"] for r in rows], labels=[r["run"] for r in rows]))
    from llama_xla_helpers.plots import table
    print(table(rows, ["run", "chip", "batch_per_chip", "seq", "outcome", "plan_GiB", "no_master_GiB", "plan_HBM"]))
    assert len(rows) == len(PUBLISHED_TRAINING) and all(e["source"] for e in PUBLISHED_TRAINING)
    v5e = {r["seq"]: r["plan"].total_bytes for r in rows if r["chip"] == "v5e x4"}
    assert v5e[1024] < v5e[8192]  # torchprime's fix for v5e (block 1024) lowers the plan too


# profile_step in a child process: XLA:CPU's default scheduler orders a step for concurrency and keeps
# every layer's buffers live with or without checkpointing; its memory-minimizing one (what
# benchmarks/remat.py uses) is closer to a TPU's, which schedules to fit HBM. XLA reads its flags once
# per process, so the child sets it before its runtime starts. Prints one JSON line per configuration.
CHILD = """
import json, sys
from llama_xla_helpers.runtime import init_runtime
init_runtime(cpu_devices=8, hlo_dump_dir=True)
from llama_xla_helpers import attention
from llama_xla_helpers.train import TrainConfig, profile_step
for case in json.loads(sys.argv[1]):
    attention.BLOCK = case.pop("block", attention.BLOCK)
    profile = profile_step(TrainConfig(**case))
    print(json.dumps({k: profile[k] for k in ("param_bytes", "optimizer_bytes", "temp_bytes")}), flush=True)
"""
MEMORY_SCHEDULER = "--xla_cpu_enable_concurrency_optimized_scheduler=false"
PROFILED = [dict(strategy=s, mesh=m, gradient_checkpointing=r, batch_size=8, seq_len=256, dtype="fp32", attention="eager")
            for s, m in (("2d", (4, 2)), ("fsdp", (8, 1))) for r in (False, True)]
PROFILED += [dict(case, attention="blockwise", block=64) for case in PROFILED if not case["gradient_checkpointing"]]


def case_id(case):
    return (f"{case['strategy']}-{'x'.join(map(str, case['mesh']))}-{'remat' if case['gradient_checkpointing'] else 'no_remat'}"
            + ("-blockwise" if case["attention"] == "blockwise" else ""))


# make test profiles two configurations that between them take both strategies and both checkpointing
# settings; the other four (and so the expected misses) run in make check-variants (about 20 s each on 2 cores).
QUICK = ("2d-4x2-remat", "fsdp-8x1-no_remat")


def cases(misses=()):
    """PROFILED as pytest params: marked `variants` outside QUICK, a strict xfail where `misses` names it."""
    params = []
    for c in PROFILED:
        marks = [] if case_id(c) in QUICK else [pytest.mark.variants]
        if case_id(c) in misses:
            marks.append(pytest.mark.xfail(strict=True, reason=misses[case_id(c)]))
        params.append(pytest.param(c, id=case_id(c), marks=marks))
    return params


@pytest.fixture(scope="module")
def profiles(request):
    """profile_step of the PROFILED configurations this session's tests read, from one child process."""
    wanted = {case_id(item.callspec.params["case"]) for item in request.session.items
              if item.module is request.module and "case" in getattr(getattr(item, "callspec", None), "params", {})}
    todo = [c for c in PROFILED if case_id(c) in wanted]
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "CPU_NUM_DEVICES")}
    out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(todo)], capture_output=True, text=True,
                         timeout=600, env={**env, "XLA_FLAGS": MEMORY_SCHEDULER})
    assert out.returncode == 0, out.stderr[-3000:]
    return dict(zip(map(case_id, todo), map(json.loads, out.stdout.splitlines()[-len(todo):])))


def tiny_plan(case):
    return plan_training(TINY, case["mesh"], case["strategy"], case["batch_size"], case["seq_len"], "fp32",
                         "adafactor", case["gradient_checkpointing"], attention=case["attention"], block=case.get("block"))


@pytest.mark.child_process
@pytest.mark.parametrize("case", cases())
def test_parameters_and_adafactor_state_equal_profile_step(case, profiles):
    got, plan = profiles[case_id(case)], tiny_plan(case)
    assert plan.param_bytes == got["param_bytes"]
    assert plan.optimizer_bytes == got["optimizer_bytes"] + 4 * TENSORS  # profile_step leaves out the 0-d steps


# Measured when the tolerance was set (plan / XLA): 2d 4x2 0.879, with checkpointing 0.827; fsdp 8x1 0.875,
# with checkpointing 0.552. That one misses. In the buffer assignment's "Live ranges at ... (peak)" XLA:CPU
# holds five score-sized buffers (b x heads x s x s, fp32) where the plan counts three: the recomputed
# layer's softmax output and the two gradients, which is what the 2D run's peak holds. The other two are the
# softmax exponentials of two layers' forward passes, live from the forward to those layers' backward
# (schedule positions 156-1395 and 261-970), which checkpointing should have let go.
# Blockwise (256 tokens in blocks of 64; measured when the cases were added): 2d 0.659, fsdp 0.668. At the peak
# XLA:CPU holds no score block (attention.py chains the blocks), so the attention is as planned; what the plan
# leaves out is the same as eager's (21 MLP-sized buffers where it counts 16, the all-reduces' outputs: 3.2 MiB
# there, under a larger total) plus 2.5 MiB of copies for the blockwise layout (45 and 7 buffers of (b, s, 64)
# and (b, s, 128) floats at the peak, where eager's holds 36 and 2).
LAYOUT = "the same buffers eager's plan leaves out (3.2 MiB) and 2.5 MiB of layout copies, under a smaller total"
MISSES = {"fsdp-8x1-remat": "plan/XLA 0.552: XLA:CPU keeps two layers' forward softmax exponentials live until their "
                            "backward under FSDP + checkpointing (5 score-sized buffers at the peak, the plan 3)",
          "2d-4x2-no_remat-blockwise": f"plan/XLA 0.659: {LAYOUT}",
          "fsdp-8x1-no_remat-blockwise": f"plan/XLA 0.668: {LAYOUT}"}


@pytest.mark.child_process
@pytest.mark.parametrize("case", cases(MISSES))
def test_activations_within_25_percent_of_xla_scratch(case, profiles):
    got, plan = profiles[case_id(case)], tiny_plan(case)
    ratio = plan.activation_bytes / got["temp_bytes"]
    everything = (plan.activation_bytes + plan.gathered_bytes + plan.grad_bytes) / got["temp_bytes"]
    print(f"{case_id(case)}: activations plan / XLA scratch = {plan.activation_bytes / 2**20:.2f} / "
          f"{got['temp_bytes'] / 2**20:.2f} MiB = {ratio:.3f}; with gathered weights and gradients {everything:.3f}")
    assert 0.75 <= ratio <= 1.25


def step_state(strategy, optimizer_class, lora_config=None):
    """One bf16 training step of the sharded tiny model, as train_step runs it (backward and optimizer in
    one graph): the gradients' dtypes and shapes (traced, before the step), and the bytes per device of the
    parameters (with LoRA: and the int8 codes and scales of the frozen projections) and of the optimizer
    state the step created (every tensor, 0-d steps too)."""
    from llama_xla_helpers.sharding import shard_shape
    from llama_xla_helpers.train import TrainConfig, build_model, first_batch, forward_loss, setup

    cfg = TrainConfig(strategy=strategy, mesh=(N, 1) if strategy == "fsdp" else None, batch_size=max(8, N),
                      seq_len=24, dtype="bf16")
    cfg, mesh, config = setup(cfg)
    model = build_model(config, mesh, strategy, dtype=torch.bfloat16, lora_config=lora_config)
    model.train()
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = optimizer_class(trained)
    forward_loss(model, first_batch(cfg, mesh)).backward()
    grads = {(p.grad.dtype, p.grad.shape == p.shape) for p in trained}
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    torch_xla.sync()  # one graph: the gradients stay inside it, as in training
    nbytes = lambda t: math.prod(shard_shape(t)) * t.element_size()
    params = sum(nbytes(p) for p in model.parameters()) + sum(nbytes(t) for n, t in model.named_buffers()
                                                              if ".base_layer." in n)
    return cfg, grads, params, sum(nbytes(t) for s in optimizer.state.values() for t in s.values())


@pytest.mark.devices
@pytest.mark.parametrize("strategy, optimizer", [("2d", "adamw"), ("fsdp", "adamw"), ("2d", "adafactor")])
def test_bf16_optimizer_state_and_gradients_match_the_plan(strategy, optimizer):
    """The optimizer state, counted by the plan from PARAM_SPECS (or param_spec for FSDP) without a device,
    equals the shards a bf16 step leaves: AdamW's two fp32 moments, or Adafactor's factored ones, an fp32
    master copy per parameter and a 0-d step each; a norm's moments split over 'model' under 2D (XLA gives
    them its gradient's split), its master copy replicated like the norm. Gradients: the parameters' dtype
    and shape, so the plan's gradient bytes are the parameter bytes."""
    from llama_xla_helpers.optim import Adafactor, AdamW

    cfg, grads, params, state = step_state(strategy, AdamW if optimizer == "adamw" else Adafactor)
    plan = plan_training(TINY, cfg.mesh, strategy, cfg.batch_size, cfg.seq_len, "bf16", optimizer)
    print(f"{strategy} {cfg.mesh}: {optimizer} state {state} bytes per device (plan {plan.optimizer_bytes}), "
          f"parameters {params} (plan {plan.param_bytes})")
    assert state == plan.optimizer_bytes
    assert params == plan.param_bytes == plan.grad_bytes
    assert grads == {(torch.bfloat16, True)}


@pytest.mark.devices
@pytest.mark.parametrize("strategy, int8", [("2d", False), ("fsdp", False), ("2d", True)])
def test_lora_state_and_weights_match_the_plan_and_are_a_fraction_of_full_fine_tuning(strategy, int8):
    """LoRA (rank 4 on q, k, v, o): the optimizer state a bf16 AdamW step leaves, for the adapters only,
    and the frozen weights (int8 codes and scales with int8=True) equal the plan's bytes per device;
    the state is printed beside full fine-tuning's, measured the same way. Unsplit (one device) it is
    under a tenth of full fine-tuning's; per device the fraction grows with the device count, since
    the tiny model's rank-4 adapters split less far than its weights (16 devices, FSDP: 12.5%)."""
    from llama_xla_helpers.lora import LoraConfig
    from llama_xla_helpers.optim import AdamW

    lora = LoraConfig(4, int8=int8)
    cfg, grads, params, state = step_state(strategy, AdamW, lora)
    plan = plan_training(TINY, cfg.mesh, strategy, cfg.batch_size, cfg.seq_len, "bf16", "adamw", lora=lora)
    *_, full_params, full_state = step_state(strategy, AdamW)
    print(f"{strategy} {cfg.mesh} LoRA{' int8' if int8 else ''}: AdamW state {state} bytes per device, full "
          f"fine-tuning {full_state} ({state / full_state:.1%}); weights {params} (full {full_params})")
    assert state == plan.optimizer_bytes
    assert params == plan.param_bytes
    assert grads == {(torch.bfloat16, True)}
    one_device = [plan_training(TINY, (1, 1), strategy, cfg.batch_size, cfg.seq_len, "bf16", "adamw", lora=adapters)
                  for adapters in (lora, None)]
    assert state < full_state and one_device[0].optimizer_bytes < one_device[1].optimizer_bytes / 10
