"""Shared test helpers."""
import pytest
import torch
from transformers import LlamaForCausalLM

import torch_xla.runtime as xr

N = xr.global_runtime_device_count()  # devices of this test run (CPU_NUM_DEVICES, default 8)
# Expected values written out for the default 8-device stand-in; other counts skip these.
eight_devices = pytest.mark.skipif(N != 8, reason=f"expected values are written for 8 devices, this run has {N}")


def hf_model(config, seed=0):
    """A Hugging Face Llama with random fp32 weights, in eval mode, on the CPU."""
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def tp_size(limit=8):
    """The widest 'model' axis up to `limit` that divides the device count (tiny's vocab, 264, splits up to 8)."""
    return max(k for k in range(1, limit + 1) if N % k == 0 and limit % k == 0)


def sharded_runs():
    """(strategy, mesh) params of a sharded-equals-unsharded test on N devices: 2D on the automatic pick
    and FSDP; then 2D all on 'data' and on the widest 'model' axis the tiny model allows, marked
    `variants` (make check-variants runs them, and all four at 1, 4 and 16 devices)."""
    from llama_xla_helpers.configs import get_config
    from llama_xla_helpers.mesh import mesh_shape
    auto = mesh_shape(N, get_config("tiny"))
    others = [s for s in dict.fromkeys([(N, 1), (N // tp_size(4), tp_size(4))]) if s != auto]
    return [("2d", auto), ("fsdp", (N, 1))] + [pytest.param("2d", s, marks=pytest.mark.variants) for s in others]


def teacher_forced_agreement(reference, other, tokens, generated_from):
    """Fraction of the generated positions where `other` predicts the same next token as `reference`
    (argmax), both fed the same tokens (bsz, seqlen): prompts, then the reference's own greedy tokens
    from index `generated_from` on (teacher forcing: a near-tie that flips one token does not derail
    the rest). Also returns the dtypes of `other`'s matmuls, traced: bf16 must multiply in bf16."""
    from llama_xla_helpers.hlo import dot_dtypes

    device = other.embed_tokens.weight.device
    pos = torch.arange(tokens.shape[1], device=device)
    want = reference(tokens.to(reference.embed_tokens.weight.device), pos.to(reference.embed_tokens.weight.device))
    logits = other(tokens.to(device), pos)  # (bsz, seqlen, vocab_size)
    dots = set(dot_dtypes([logits])) if device.type == "xla" else None
    same = want.argmax(-1).cpu() == logits.argmax(-1).cpu()  # position i predicts token i + 1
    return same[:, generated_from - 1:-1].float().mean().item(), dots


def preempted(run, step, monkeypatch):
    """Train `run` as if a stop signal came during `step`: it checkpoints that step and stops. (Not
    `steps=step`: the learning-rate schedule depends on the run's length.)"""
    from llama_xla_helpers import train
    with monkeypatch.context() as m:
        m.setattr(train, "should_stop", lambda s, *_: s == step)
        assert train.train(run).stopped_early
