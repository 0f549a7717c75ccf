"""LoRA (lora.py): adapters beside the frozen Hugging Face Llama, trained on the mesh, merged and
exported for PEFT. (The optimizer state and memory against the plan: tests/test_plan_training.py.)"""
import dataclasses
import json
import shutil

import pytest
import torch
from peft import PeftModel
from torch.utils.data import DataLoader, TensorDataset
from transformers import LlamaForCausalLM

from llama_xla_helpers import checkpoint, lora, serve
from llama_xla_helpers.configs import get_config
from llama_xla_helpers.data import StepSampler, load_corpus, train_val_split
from llama_xla_helpers.model import Llama, ModelArgs
from llama_xla_helpers.train import ADAPTER_DIR, TrainConfig, lora_config, main, make_optimizer, optimizer_step, train
from util import N, hf_model, preempted, sharded_runs

MICRO = get_config("micro")  # tiny with 2 layers: what these tests check holds at any depth
RANK = 4
IDS = torch.randint(0, MICRO.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A base model's Hugging Face folder: the micro config, random fp32 weights."""
    folder = tmp_path_factory.mktemp("base")
    hf_model(MICRO).save_pretrained(folder)
    return str(folder)


def lora_run(base, **changes):
    """A short LoRA fine-tune of `base` in fp32 (AdamW at 1e-2: the adapters move in 5 steps)."""
    return dataclasses.replace(TrainConfig(steps=5, batch_size=max(8, N), seq_len=32, eval_batches=2, dtype="fp32",
                                           optimizer="adamw", lr=1e-2, init_from=base, lora_rank=RANK), **changes)


def adapted(targets=lora.ATTENTION, seed=0):
    """The micro base model on the CPU with adapters whose B is random (as after training), and the base alone."""
    model, plain = hf_model(MICRO), hf_model(MICRO)
    lora.add(model, lora.LoraConfig(RANK, targets=targets), seed=seed)
    with torch.no_grad():
        for name, p in lora.adapter_state(model).items():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.05)
    return model, plain


def cpu_lora_losses(cfg):
    """The same LoRA fine-tune, unsharded, in plain PyTorch on the CPU."""
    model = checkpoint.load_hf(cfg.init_from).train()
    lora.add(model, lora_config(cfg), seed=cfg.seed)
    optimizer = make_optimizer(cfg, [p for p in model.parameters() if p.requires_grad])
    train_ids, _ = train_val_split(load_corpus(), cfg.seq_len)
    sampler = StepSampler(len(train_ids), cfg.batch_size, cfg.seed, 0, cfg.steps)
    loader = DataLoader(TensorDataset(train_ids), batch_size=cfg.batch_size, sampler=sampler, drop_last=True)
    return {step: optimizer_step(model, optimizer, ids, clip_norm=cfg.clip_norm)[0].item()
            for step, (ids,) in enumerate(loader, 1)}


def test_with_B_zero_the_logits_are_the_base_models_exactly():
    model, plain = hf_model(MICRO), hf_model(MICRO)
    params = lora.add(model, lora.LoraConfig(RANK, targets=lora.TARGETS))
    assert torch.equal(model(IDS).logits, plain(IDS).logits)
    assert len(params) == 2 * 7 * MICRO.num_hidden_layers  # A and B of 7 projections per layer
    assert {n for n, p in model.named_parameters() if p.requires_grad} == set(lora.adapter_state(model))
    a = lora.adapter_state(model)["model.layers.0.self_attn.q_proj.lora_A.weight"]
    assert a.abs().max() <= MICRO.hidden_size ** -0.5 and a.std() > 0.5 * MICRO.hidden_size ** -0.5 / 3 ** 0.5


def test_merged_weights_equal_the_adapters_applied():
    model, plain = adapted()
    plain.load_state_dict(lora.merged_state(model))
    assert not torch.allclose(model(IDS).logits, hf_model(MICRO)(IDS).logits, atol=1e-3)  # the adapters matter
    torch.testing.assert_close(plain(IDS).logits, model(IDS).logits, atol=1e-5, rtol=1e-5)


def test_the_inline_update_is_the_layers():
    """One projection by hand: y = x W^T + (alpha / r) (x A^T) B^T."""
    model, _ = adapted()
    layer = model.model.layers[0].self_attn.q_proj
    x = torch.randn(2, 5, MICRO.hidden_size)
    W, A, B = layer.base_layer.weight, layer.lora_A.weight, layer.lora_B.weight
    torch.testing.assert_close(layer(x), x @ W.T + 2 * (x @ A.T) @ B.T)  # alpha = 2 x rank by default


def test_peft_loads_the_adapter_folder_with_the_same_logits(tmp_path):
    model, plain = adapted(targets=("q_proj", "v_proj", "down_proj"))
    plain.save_pretrained(tmp_path / "base")
    folder = lora.peft_adapter(model, tmp_path / "adapter", base_model=tmp_path / "base")
    config = json.loads((folder / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["target_modules"]) == (RANK, 2 * RANK,
                                                                               ["q_proj", "v_proj", "down_proj"])
    peft = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(tmp_path / "base"), folder).eval()
    torch.testing.assert_close(peft(input_ids=IDS).logits, model(IDS).logits, atol=1e-5, rtol=1e-5)


def test_int8_base_weights_pass_gradients_to_the_adapters_below():
    """quantize.Int8Linear's XLA op has no backward; FrozenInt8Linear dequantizes in the graph instead."""
    model = hf_model(MICRO)
    lora.add(model, lora.LoraConfig(RANK, int8=True))
    layer = model.model.layers[0].self_attn.q_proj.base_layer
    assert layer.weight.dtype == torch.int8 and not any(p.requires_grad for p in layer.parameters())
    x = torch.randn(3, MICRO.hidden_size, requires_grad=True)
    layer(x).sum().backward()
    w = layer.weight.float() * layer.scales[:, None]
    torch.testing.assert_close(x.grad, w.sum(0).expand(3, -1))
    model(IDS).logits.sum().backward()  # B = 0: A's gradient is zero, B's is not
    q = model.model.layers[0].self_attn.q_proj
    assert q.lora_A.weight.grad.abs().max() == 0 and q.lora_B.weight.grad.abs().max() > 0


@pytest.mark.parametrize("bad, words", [
    (dict(rank=0), ["rank=0", "int >= 1"]),
    (dict(rank=200), ["rank=200", "smallest dimension (64)", "at most 64"]),
    (dict(alpha=-1.0), ["alpha=-1.0", "finite number > 0"]),
    (dict(targets=("q_proj", "qkv")), ["unknown: qkv", "q_proj, k_proj"]),
    (dict(dropout=1.0), ["dropout=1.0", "[0, 1)"]),
])
def test_bad_adapter_settings_name_the_value_and_the_fix(bad, words):
    with pytest.raises(ValueError) as e:
        lora.add(hf_model(MICRO), dataclasses.replace(lora.LoraConfig(RANK), **bad))
    assert all(w in str(e.value) for w in words), str(e.value)


def test_the_cli_refuses_lora_without_a_base_or_with_unknown_targets(capsys, base):
    for argv, words in ((["--lora-rank", "8"], "init_from is not set; pass the base model's Hugging Face folder "
                                               "(--init-from DIR)"),
                        (["--lora-rank", "8", "--init-from", base, "--lora-targets", "q_proj,wq"], "unknown: wq"),
                        (["--lora-int8"], "lora_rank is 0 (full training)")):
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and err.count("\n") == 0 and err.startswith("error: ") and words in err, err


@pytest.mark.devices
@pytest.mark.parametrize("strategy, mesh", sharded_runs())
def test_sharded_lora_training_matches_unsharded(strategy, mesh, base):
    cfg = lora_run(base, strategy=strategy, mesh=mesh)
    want = cpu_lora_losses(cfg)
    result = train(cfg)
    assert list(result.losses) == list(want)
    for step in want:
        assert result.losses[step] == pytest.approx(want[step], abs=2e-4), step
    assert want[5] < want[1] - 0.05  # the adapters learn
    assert result.train_compiles == 2
    frozen = checkpoint.load_hf(base).state_dict()
    for name, t in result.model.state_dict().items():  # every base weight as it was
        if ".lora_" not in name:
            assert torch.equal(t.cpu(), frozen[name.replace(".base_layer", "")]), name


def test_gradient_checkpointing_gives_a_lora_run_the_same_losses(base):
    cfg = lora_run(base, steps=3)
    want = train(cfg).losses
    assert train(dataclasses.replace(cfg, gradient_checkpointing=True)).losses == pytest.approx(want, abs=1e-5)


def test_a_bf16_lora_run_checkpoints_its_adapters_and_resumes_exactly(tmp_path, monkeypatch, base):
    """bf16 (as on a TPU): bf16 adapters with fp32 optimizer state and master copies; a checkpoint
    holds the adapters and their state only, and names its base; the resumed losses equal the
    uninterrupted run's; the run's end writes PEFT's folder; serve reads the checkpoint merged."""
    monkeypatch.setenv("LLAMA_XLA_DEFAULT_DTYPE", "bf16")
    run = lora_run(base, dtype=None, steps=6, checkpoint_every=3, checkpoint_dir=str(tmp_path / "ck"))
    whole = train(dataclasses.replace(run, checkpoint_dir=str(tmp_path / "whole")))
    assert whole.train_compiles == 2
    assert {p.dtype for p in whole.model.parameters()} == {torch.bfloat16}
    state = {k: v.dtype for s in whole.optimizer.state.values() for k, v in s.items() if v.dim()}
    assert set(state.values()) == {torch.float32} and "master" in state
    assert len(whole.optimizer.state) == 2 * 4 * MICRO.num_hidden_layers  # A and B of q, k, v, o in each layer
    preempted(run, 3, monkeypatch)
    resumed = train(dataclasses.replace(run, resume=True))
    assert resumed.losses == {step: whole.losses[step] for step in (4, 5, 6)}

    meta = checkpoint.read_meta(checkpoint.latest(run.checkpoint_dir))
    names = [n.removeprefix("model.") for n in meta["tensors"] if n.startswith("model.")]
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
    assert meta["extra"]["lora_base"] == dict(folder=base, sha256=lora.folder_sha256(base))
    other = tmp_path / "other"
    shutil.copytree(base, other)
    (other / "config.json").write_text((other / "config.json").read_text() + "\n")
    with pytest.raises(ValueError, match="trained on the base model in .* holds other weights; resume with that base"):
        train(dataclasses.replace(run, init_from=str(other), resume=True))

    adapter = json.loads((tmp_path / "whole" / ADAPTER_DIR / "adapter_config.json").read_text())
    assert (adapter["r"], adapter["base_model_name_or_path"]) == (RANK, base)
    checkpoint.export_hf(resumed.model, tmp_path / "merged")
    config, step = serve.read_config(run.checkpoint_dir)
    args = ModelArgs.from_hf_config(config, 1, 64)
    served = serve.read_weights(run.checkpoint_dir, step, config, args).state_dict()
    merged = Llama.from_pretrained(tmp_path / "merged", 1, 64).state_dict()
    assert served.keys() == merged.keys() and all(torch.equal(served[k], merged[k]) for k in merged)
