"""LoRA: small trainable adapters beside the frozen weights of the Hugging Face Llama, on the 2D mesh.

    model = train.build_model(config, mesh, init_from="base_hf")   # sharded, as training builds it
    lora.add(model, LoraConfig(rank=8), mesh)                       # freeze it, wrap q/k/v/o_proj
    ... train: only the adapters have gradients and optimizer state ...
    lora.peft_adapter(model, cfg, "adapter")                        # PEFT's folder
    checkpoint.export_hf(model, "merged")                           # a plain HF folder, adapters folded in

Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models" (https://arxiv.org/abs/2106.09685):
a projection y = x W^T keeps its weight W (out, in) frozen and learns two small matrices, A (r, in)
and B (out, r):

    y = x W^T + (alpha / r) * (x A^T) B^T

B starts at zero, so the adapted model starts as the base model; A starts as nn.Linear's weights
do (PEFT's default). Only A and B have gradients and optimizer state: r (in + out) numbers per
projection instead of in x out. With `int8=True` the frozen W is stored in int8 (`quantize.py`'s
per-channel int8: QLoRA's idea, with int8 for its NF4) and multiplied in the compute dtype. It is
quantized from the loaded weights, so loading still holds the base in its dtype once: int8 lowers
the memory of training, not the peak of loading.

On the mesh, MaxText's rule: A keeps W's partition spec on its input dimension and replicates the
rank, B keeps W's spec on its output dimension and replicates the rank: A (None, spec[1]),
B (spec[0], None). So x A^T splits its contraction as x W^T does, the rank-r activations are
small and whole on 'model', and B's output lands where W's does; a replicated W gives replicated
adapters. The rank is never split, so any rank works on any mesh.

Names follow PEFT's (`q_proj.base_layer.weight`, `q_proj.lora_A.weight`, `q_proj.lora_B.weight`),
so `peft_adapter` writes PEFT's folder and `merged_state` a plain Hugging Face state dict.

Sources: PEFT's LoRA layer, https://github.com/huggingface/peft (src/peft/tuners/lora/layer.py);
MaxText's LoRA sharding, https://github.com/AI-Hypercomputer/maxtext.
"""
import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch_xla.distributed.spmd as xs
from safetensors.torch import save_file

from .quantize import Int8Linear, quantize_int8
from .sharding import head_dim, keyed_generator, to_sharded

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")  # the default targets
MLP = ("gate_proj", "up_proj", "down_proj")
TARGETS = ATTENTION + MLP
SITE = re.compile(r"layers\.\d+\.(self_attn|mlp)\.(\w+)$")  # a decoder layer's projection


@dataclass
class LoraConfig:
    rank: int = 8
    alpha: float = None           # None: 2 x rank (a scaling of 2)
    targets: tuple = ATTENTION    # projection names, from TARGETS
    dropout: float = 0.0          # on the adapters' input only
    int8: bool = False            # store the frozen projections in int8

    @property
    def scaling(self):
        return (2 * self.rank if self.alpha is None else self.alpha) / self.rank


def check(cfg, model_config=None):
    """ValueError naming the value, the limit and a fix, before any work."""
    if not isinstance(cfg.rank, int) or isinstance(cfg.rank, bool) or cfg.rank < 1:
        raise ValueError(f"lora rank={cfg.rank!r} must be an int >= 1 (e.g. 8 or 16)")
    if cfg.alpha is not None and (isinstance(cfg.alpha, bool) or not isinstance(cfg.alpha, (int, float)) or
                                  not 0 < cfg.alpha < math.inf):
        raise ValueError(f"lora alpha={cfg.alpha!r} must be a finite number > 0 (e.g. 2 x rank), or None for 2 x rank")
    unknown = [t for t in cfg.targets if t not in TARGETS]
    if unknown or not cfg.targets or isinstance(cfg.targets, str):
        raise ValueError(f"lora targets {cfg.targets!r} must be a non-empty list of {', '.join(TARGETS)}; "
                         f"unknown: {', '.join(map(str, unknown)) or 'none'}")
    if isinstance(cfg.dropout, bool) or not isinstance(cfg.dropout, (int, float)) or not 0 <= cfg.dropout < 1:
        raise ValueError(f"lora dropout={cfg.dropout!r} must be a number in [0, 1)")
    if model_config is not None:
        smallest = min(min(shape) for name, shape in projection_shapes(model_config).items() if name in cfg.targets)
        if cfg.rank > smallest:
            raise ValueError(f"lora rank={cfg.rank} is larger than the smallest dimension ({smallest}) of the "
                             f"projections it adapts, so B A is not low-rank; use a rank of at most {smallest}")


def projection_shapes(config):
    """{target: (out_features, in_features)} of a decoder layer's projections."""
    h, q, kv, m = (config.hidden_size, config.num_attention_heads * head_dim(config),
                   config.num_key_value_heads * head_dim(config), config.intermediate_size)
    return dict(q_proj=(q, h), k_proj=(kv, h), v_proj=(kv, h), o_proj=(h, q), gate_proj=(m, h), up_proj=(m, h),
                down_proj=(h, m))


class FrozenInt8Linear(Int8Linear):
    """quantize.Int8Linear with a backward pass for its input: torch.ops.xla.quantized_matmul has
    no autograd kernel (a backward through it leaves the input's gradient None, with a warning),
    so the int8 codes are dequantized in the compute dtype inside the graph and multiplied by
    einsum. The weight stays int8 in memory; no gradient reaches it."""

    def forward(self, x):  # (..., in) -> (..., out)
        w = self.weight.to(x.dtype) * self.scales.to(x.dtype)[:, None]  # (out, in)
        return torch.einsum("...i,oi->...o", x, w)


class LoraLinear(nn.Module):
    """base_layer(x) + scaling * lora_B(lora_A(dropout(x))): a frozen projection and its adapters."""

    def __init__(self, base_layer, lora_A, lora_B, scaling, dropout=0.0):
        super().__init__()
        self.base_layer, self.lora_A, self.lora_B = base_layer, lora_A, lora_B
        self.scaling = scaling
        self.dropout = nn.Dropout(dropout) if dropout else nn.Identity()

    def forward(self, x):  # (bsz, seqlen, in) -> (bsz, seqlen, out)
        return self.base_layer(x) + self.lora_B(self.lora_A(self.dropout(x))) * self.scaling


def init_A(seed, name, rank, in_features):
    """A's first values (rank, in) in fp32: nn.Linear's init, uniform in +-1/sqrt(in) (PEFT's
    default), from a generator keyed by (seed, name), so every mesh and host starts alike."""
    bound = 1 / math.sqrt(in_features)
    return torch.empty(rank, in_features).uniform_(-bound, bound, generator=keyed_generator(f"{seed}/{name}/lora_A"))


def linear_of(cls, weight):
    """A bias-free `cls` (nn.Linear, or torch_xla's EinsumLinear as shard_params makes them) whose
    trainable weight is `weight` (out, in)."""
    with torch.device("meta"):
        layer = cls(weight.shape[1], weight.shape[0], bias=False)
    layer.weight = nn.Parameter(weight)
    return layer


def sites(model, targets):
    """[(module name, its parent module, attribute)] of every projection to adapt, in order."""
    found = []
    for name, _ in model.named_modules():
        m = SITE.search(name)
        if m and m.group(2) in targets:
            parent, _, leaf = name.rpartition(".")
            found.append((name, model.get_submodule(parent), leaf))
    return found


def add(model, cfg, mesh=None, seed=0):
    """Freeze every weight of `model` (a Hugging Face LlamaForCausalLM: on the CPU with mesh None, or
    sharded on `mesh` by `sharding.shard_params`) and wrap cfg.targets in LoraLinear; returns the
    adapters' parameters, the only ones left trainable.

    Call it after shard_params and before shard_activations (train.build_model does), so Table 2's
    hooks annotate the LoraLinear's output, the sum. The adapters take the base weight's dtype and
    MaxText's specs (module docstring); model.partition_specs names them."""
    check(cfg, model.config)
    model.requires_grad_(False)
    specs = getattr(model, "partition_specs", {})
    params = []
    for name, parent, leaf in sites(model, cfg.targets):
        base = getattr(parent, leaf)
        w = base.weight  # (out, in)
        spec = specs.pop(f"{name}.weight", (None, None))
        a_spec, b_spec = (None, spec[1]), (spec[0], None)

        def place(t, s):
            return to_sharded(t.to(w.dtype), mesh, s) if mesh is not None else t.to(w.device, w.dtype)
        A = linear_of(type(base), place(init_A(seed, name, cfg.rank, w.shape[1]), a_spec))  # (rank, in)
        B = linear_of(type(base), place(torch.zeros(w.shape[0], cfg.rank), b_spec))         # (out, rank)
        if cfg.int8:
            base = FrozenInt8Linear(*quantize_int8(w.detach()))  # codes (out, in), scales (out,)
            if mesh is not None:  # computed on the devices: give the results the weight's split
                xs.mark_sharding(base.weight, mesh, spec)
                xs.mark_sharding(base.scales, mesh, spec[:1])
        setattr(parent, leaf, LoraLinear(base, A, B, cfg.scaling, cfg.dropout))
        specs.update({f"{name}.base_layer.weight": spec, f"{name}.lora_A.weight": a_spec,
                      f"{name}.lora_B.weight": b_spec})
        params += [A.weight, B.weight]
    return params


def config_of(model):
    """The LoraConfig `add` gave `model` (read from its LoraLinear modules), or None."""
    layers = {n: m for n, m in model.named_modules() if isinstance(m, LoraLinear)}
    if not layers:
        return None
    first = next(iter(layers.values()))
    rank = first.lora_A.weight.shape[0]
    dropout = first.dropout.p if isinstance(first.dropout, nn.Dropout) else 0.0
    targets = tuple(t for t in TARGETS if any(n.endswith(f".{t}") for n in layers))
    return LoraConfig(rank, first.scaling * rank, targets, dropout, isinstance(first.base_layer, FrozenInt8Linear))


def adapter_state(model):
    """{name: tensor} of every adapter weight, PEFT's names inside the model: what a LoRA
    checkpoint holds (`checkpoint.save` and `load` take this dict in place of the model)."""
    return {n: t for n, t in model.state_dict().items() if ".lora_A." in n or ".lora_B." in n}


def merged_state(model):
    """The model's weights as a plain Hugging Face Llama's, on the CPU: each adapted projection
    becomes W + scaling * B A (computed in fp32, int8 codes dequantized first; cast back to the
    model's dtype), every other tensor as it is."""
    state, wrapped = {}, []
    for name, module in model.named_modules():
        if isinstance(module, LoraLinear):
            base = module.base_layer
            w = base.weight.cpu().float()
            if isinstance(base, FrozenInt8Linear):
                w = w * base.scales.cpu().float()[:, None]
            delta = module.lora_B.weight.cpu().float() @ module.lora_A.weight.cpu().float()  # (out, in)
            state[f"{name}.weight"] = (w + module.scaling * delta).to(module.lora_A.weight.dtype)
            wrapped.append(f"{name}.")
    for n, t in model.state_dict().items():
        if not n.startswith(tuple(wrapped)):
            state[n] = t.cpu()
    return state


def peft_adapter(model, out_dir, base_model=None):
    """Write PEFT's adapter folder (adapter_config.json + adapter_model.safetensors) of a model
    `add` adapted, which `peft.PeftModel.from_pretrained(base, out_dir)` loads onto the base model.
    base_model: what adapter_config.json names as the base (a folder or a hub id), or None."""
    cfg = config_of(model)
    if cfg is None:
        raise ValueError("the model has no LoRA adapters; add them with lora.add(model, LoraConfig(...))")
    if cfg.int8:
        raise ValueError("the adapters were trained on int8 base weights, which PEFT's folder cannot name; "
                         "export the merged model instead (checkpoint.export_hf)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    weights = {f"base_model.model.{n}": t.cpu().contiguous() for n, t in adapter_state(model).items()}
    save_file(weights, out / "adapter_model.safetensors", metadata={"format": "pt"})
    config = dict(peft_type="LORA", task_type="CAUSAL_LM", r=cfg.rank, lora_alpha=cfg.scaling * cfg.rank,
                  lora_dropout=cfg.dropout, target_modules=list(cfg.targets), bias="none", fan_in_fan_out=False,
                  use_rslora=False, use_dora=False, init_lora_weights=True, inference_mode=True,
                  base_model_name_or_path=None if base_model is None else str(base_model))
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def folder_sha256(path):
    """sha256 of a Hugging Face folder's config.json and *.safetensors files, in name order: what a
    LoRA checkpoint records of its base, so a resume or a serve cannot pair it with another."""
    if not (Path(path) / "config.json").is_file():
        raise FileNotFoundError(f"the base model folder {str(path)!r} has no config.json; a LoRA checkpoint holds "
                                f"only adapters, so its base must stay where training read it (restore it there)")
    digest = hashlib.sha256()
    for file in sorted(Path(path).glob("*.safetensors")) + [Path(path) / "config.json"]:
        digest.update(file.name.encode())
        with open(file, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 24), b""):
                digest.update(chunk)
    return digest.hexdigest()
