"""Tensor parallelism for the inference Llama, and KV-head replication for meshes wider than n_kv_heads.

    model = shard_for_inference(Llama.from_hf(hf, max_batch_size=8, max_seq_len=512), mesh)
    model = load_for_inference("llama-dir", mesh, max_batch_size=8, max_seq_len=512)  # a pod: blocks only

Megatron sharding over the mesh's 'model' axis, as fairscale does for Llama (the Llama 3.1 70B post):
q/k/v and gate/up are column-parallel (output features split: each device owns whole heads
and a slice of the MLP), o_proj and down_proj row-parallel (input features split: each
device holds a partial sum that one all-reduce completes), the embedding and the output
projection vocabulary-parallel (the logits stay split: a greedy pick all-gathers only each
shard's best value and index, see `decode_collectives`), and the KV cache split on heads, so
attention runs locally. GSPMD inserts the collectives; `decode_collectives` counts them.

Grouped-query attention caps the 'model' axis at n_kv_heads. `replicate_kv_heads` copies
each key/value head so a wider axis still splits the cache (the Llama 2 post: Llama 2 70B's 8 KV
heads on 16 chips); the CLI does the same to a checkpoint directory:

    python -m llama_xla_helpers.parallel reshard SRC DST --factor 2

Sources: the Llama 3.1 70B post, Subrata Goswami, "Under the Hood of Llama 3.1 70B Distributed
Inference", Medium, September 2024,
https://whatdhack.medium.com/under-the-hood-of-llama-3-1-70b-distributed-inference-8b3c03886f22;
the Llama 2 post, "High-Performance Llama 2 Training and Inference with PyTorch/XLA on Cloud TPUs",
PyTorch blog, https://pytorch.org/blog/high-performance-llama-2/
"""
import dataclasses
import json
import shutil
from pathlib import Path

import torch
import torch_xla
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

from . import hlo
from .cli import ArgumentParser, user_errors
from .checkpoint import hf_reader
from .model import Llama, ModelArgs, rope_tables, safetensors_files
from .sharding import axis_size, check_divisible, to_sharded

SAFETENSORS_INDEX = "model.safetensors.index.json"
COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head")
ROW_PARALLEL = ("o_proj", "down_proj")


def param_spec(name, ndim, tp=1, shape=None):
    """Partition spec of one weight as nn.Linear stores it, (out_features, in_features), or of a
    quantized layer's tensors (quantize.Int8Linear / Int4Linear), named like the weight.
    (`model.Linear` stores the transpose; `shard_for_inference` places it with the reversed spec.)

    - `<layer>.weight`: int8 codes (out, in) or packed int4 codes (out, in // 2): the same rule
      as a float weight. Row-parallel splits the packed dim; byte i holds inputs 2i and 2i+1,
      so each device still gets whole, contiguous inputs (in // 2 must divide by tp).
    - `<layer>.scales` / `.zeros`: (out,) for int8, (out, n_groups) for int4. Column-parallel:
      split on out, like the weight's rows. Row-parallel: each output needs every group, so
      out is never split; the groups are split only when n_groups divides by tp (shape given):
      device d's input slice is then exactly groups d*n_groups/tp ... of its own, and its
      dequantize stays local. Otherwise (e.g. one group of 128 over 8 devices, whose slices are
      16-input pieces of one group) they are replicated: always correct, and they are small
      (2 bytes per group of weights per output).
    """
    module = name.rsplit(".", 2)[-2]
    leaf = name.rsplit(".", 1)[-1]
    if module in COLUMN_PARALLEL:  # output features (or the vocabulary) on 'model'
        return ("model",) + (None,) * (ndim - 1)
    if module in ROW_PARALLEL and ndim >= 2:  # input features (or groups of them) on 'model'
        if leaf in ("scales", "zeros") and (shape is None or shape[1] % tp):
            return (None,) * ndim
        return (None, "model") + (None,) * (ndim - 2)
    return (None,) * ndim  # norms (and 1-D tensors of row-parallel layers, int8 scales): replicated


def cache_spec(mesh):
    """(max_batch_size, max_seq_len, n_kv_heads, head_dim): heads on 'model', batch on 'data' if any."""
    return ("data" if "data" in mesh.axis_names else None, None, "model", None)


def check_tensor_parallel(args, mesh):
    """ValueError, naming the value, the axis size and a fix, if the model does not split evenly."""
    tp = axis_size(mesh, "model")
    if args.n_kv_heads % tp and tp % args.n_kv_heads == 0 and args.n_heads % tp == 0:
        raise ValueError(f"n_kv_heads={args.n_kv_heads} < the 'model' axis of size {tp}, so the KV cache "
                         f"cannot split on heads; replicate them first: "
                         f"model = replicate_kv_heads(model, factor={tp // args.n_kv_heads})")
    for name in ("n_heads", "n_kv_heads", "intermediate_size", "vocab_size"):
        value = getattr(args, name)
        if value % tp:
            fits = [k for k in range(1, tp) if value % k == 0 and tp % k == 0]
            raise ValueError(f"{name}={value} is not divisible by the 'model' axis of size {tp}; use a mesh "
                             f"whose 'model' axis is one of {fits}" +
                             (" or pad the vocabulary to a multiple of it" if name == "vocab_size" else ""))
    if "data" in mesh.axis_names and args.max_batch_size % axis_size(mesh, "data"):
        data = axis_size(mesh, "data")
        raise ValueError(f"max_batch_size={args.max_batch_size} is not divisible by the 'data' axis of size "
                         f"{data}; build the model with a max_batch_size that is a multiple of {data}")


def shard_for_inference(model, mesh, init=None):
    """Put a CPU `Llama` on the XLA devices, Megatron-sharded over mesh axis 'model'; returns it.

    Quantized models (`quantize.quantize`) too: their integer codes, scales and zeros are
    placed by the same rules as the float weights (see `param_spec`).

    A 1-D ('model',) mesh is pure tensor parallelism; a ('data', 'model') mesh also splits
    the batch (the KV cache's and the inputs', see `Generator`) over 'data'.

    Weights still on the meta device are read by `init(name, shape)`, which returns
    `read(index)` for `to_sharded` (see `load_for_inference`). The KV caches are created
    block by block, so no whole tensor needs to exist on the host.
    """
    check_tensor_parallel(model.args, mesh)
    tp = axis_size(mesh, "model")
    tied = model.lm_head.weight is model.embed_tokens.weight
    # Every persistent tensor: parameters, and the buffers of quantized layers (codes, scales, zeros);
    # the shared weight of tied embeddings is placed once, as embed_tokens, and re-tied below.
    tensors = {name: t for name, t in model.state_dict(keep_vars=True).items()
               if not (tied and name == "lm_head.weight")}
    specs = {name: param_spec(name, t.dim(), tp, t.shape) for name, t in tensors.items()}
    for name, t in tensors.items():  # e.g. packed int4 codes: in_features // 2 must split too
        check_divisible(name, t.shape, specs[name], mesh)
    for name, t in tensors.items():
        owner, _, leaf = name.rpartition(".")
        module = model.get_submodule(owner)
        source = init(name, tuple(t.shape)) if t.is_meta else t.detach().cpu()
        if leaf == "weight" and hasattr(module, "weight_t"):  # model.Linear, quantize.Int4Linear: weight.t() stored
            read = source if callable(source) else source.__getitem__
            sharded = to_sharded(lambda index: read(index[::-1]).t(), mesh, specs[name][::-1], t.shape[::-1])
            param = isinstance(module.weight_t, torch.nn.Parameter)  # Linear's is a parameter, Int4Linear's a buffer
            module.weight_t = torch.nn.Parameter(sharded, requires_grad=False) if param else sharded
            continue
        sharded = to_sharded(source, mesh, specs[name], t.shape)
        if isinstance(t, torch.nn.Parameter):
            sharded = torch.nn.Parameter(sharded, requires_grad=False)
        setattr(module, leaf, sharded)  # a registered buffer stays a buffer
    if tied:
        model.lm_head.weight = model.embed_tokens.weight
    dtype = model.embed_tokens.weight.dtype
    for layer in model.layers:
        cache = layer.self_attn.kv_cache
        cache.k_cache = to_sharded(_zeros(dtype), mesh, cache_spec(mesh), cache.k_cache.shape)
        cache.v_cache = to_sharded(_zeros(dtype), mesh, cache_spec(mesh), cache.v_cache.shape)
    cos, sin = rope_tables(model.args)
    model.rope_cos, model.rope_sin = cos.to(torch_xla.device(), dtype), sin.to(torch_xla.device(), dtype)
    model.mesh = mesh
    return model


def _zeros(dtype):
    """`read(index)` for `to_sharded`: a block of zeros."""
    return lambda index: torch.zeros([s.stop - s.start for s in index], dtype=dtype)


def load_for_inference(path, mesh, max_batch_size, max_seq_len, dtype=None):
    """`shard_for_inference(Llama.from_pretrained(path, ...), mesh)` for a pod: each host reads
    only the blocks of each weight that its own devices hold, one tensor at a time, from the
    local Hugging Face folder's *.safetensors (in the saved dtype, unless `dtype`), so the whole
    model never sits in a host's memory."""
    with torch.device("meta"):
        model = Llama(ModelArgs.from_pretrained(path, max_batch_size, max_seq_len)).eval()
    read = hf_reader(path, dtype)
    return shard_for_inference(model, mesh, lambda name, shape: read(hf_name(name), shape))


def hf_name(name):
    """The Hugging Face name of a `Llama` tensor: 'layers.0.self_attn.q_proj.weight' -> 'model.layers.0...'."""
    return name if name.startswith("lm_head.") else f"model.{name}"


def decode_collectives(model, batch_size=1):
    """Collectives of one compiled decode step (one token per row in, greedy next token out).

    Returns hlo.collectives' ({op: count}, {op: bytes per device}). Needs the HLO dump of
    `init_runtime(hlo_dump_dir=...)` and a graph not compiled before (see `hlo.compiled_hlo`).
    The Llama 3.1 70B post predicts one all-reduce for the vocabulary-parallel embedding, one after each
    row-parallel layer (o_proj, down_proj: 2 per block), and an all-gather of the
    vocabulary-parallel logits; for argmax GSPMD gathers only each shard's best (value, index).
    """
    device = torch_xla.device()
    tokens = torch.zeros(batch_size, 1, dtype=torch.long).to(device)
    with hlo.compiled_hlo() as modules:
        logits = model(tokens, torch.zeros(1, dtype=torch.long).to(device))  # (bsz, 1, vocab_size)
        nxt = logits[:, -1].argmax(dim=-1)  # (bsz,)
        torch_xla.sync()  # nxt is live, so the graph ends with the pick over the whole vocabulary
    return hlo.collectives("".join(modules))


# --- KV-head replication ----------------------------------------------------------------------

def replicate_heads(weight, factor, head_dim):
    """(n_kv_heads * head_dim, dim) -> (n_kv_heads * factor * head_dim, dim): head i becomes copies
    i*factor ... i*factor + factor-1, so query head h still reads a copy of its old KV head."""
    dim = weight.shape[-1]
    return weight.view(-1, head_dim, dim).repeat_interleave(factor, dim=0).reshape(-1, dim)


def replicate_kv_heads(model_or_state, factor, head_dim=None):
    """Duplicate every key/value head `factor` times; outputs are unchanged.

    model_or_state: a `Llama` (returns a new CPU Llama with n_kv_heads * factor) or a Hugging
    Face / Llama state dict (returns a new dict; pass head_dim). The cache grows by `factor`,
    which is what lets it split over a 'model' axis factor times wider.
    """
    if isinstance(model_or_state, Llama):
        args = model_or_state.args
        check_factor(factor, args.n_heads, args.n_kv_heads)
        state = {k: v.detach().cpu() for k, v in model_or_state.state_dict().items()}
        new_args = dataclasses.replace(args, n_kv_heads=args.n_kv_heads * factor)
        return Llama.from_state_dict(new_args, replicate_kv_heads(state, factor, args.head_dim))
    check_factor(factor)
    if head_dim is None:
        raise ValueError("replicating a state dict needs head_dim (hidden_size // num_attention_heads)")
    return {name: replicate_heads(t, factor, head_dim) if name.endswith(("k_proj.weight", "v_proj.weight")) else t
            for name, t in model_or_state.items()}


def check_factor(factor, n_heads=None, n_kv_heads=None):
    if not isinstance(factor, int) or factor < 1:
        raise ValueError(f"factor={factor!r} must be an int >= 1")
    if n_heads is not None and n_heads % (n_kv_heads * factor):
        raise ValueError(f"factor={factor} gives {n_kv_heads * factor} KV heads, which do not divide "
                         f"n_heads={n_heads}; use a factor that divides {n_heads // n_kv_heads}")


def reshard_checkpoint(src, dst, factor):
    """Write a copy of the local HF checkpoint `src` to `dst` with each KV head replicated factor times.

    The weights go into one model.safetensors; other files (tokenizer, generation config)
    are copied. Everything is written next to dst first and renamed at the end, so a crash
    never leaves a half-written checkpoint at dst.
    """
    src, dst = Path(src), Path(dst)
    if dst.exists() and any(dst.iterdir()):
        raise ValueError(f"{dst} exists and is not empty; choose a new directory for the resharded checkpoint")
    if not (src / "config.json").is_file():
        raise FileNotFoundError(f"{src} has no config.json: expected a local Hugging Face checkpoint directory")
    config = json.loads((src / "config.json").read_text())
    hf = LlamaConfig.from_dict(config)
    check_factor(factor, hf.num_attention_heads, hf.num_key_value_heads)
    state = {}
    for file in safetensors_files(src):
        state.update(load_file(file))
    state = replicate_kv_heads(state, factor, head_dim=hf.head_dim)

    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in src.iterdir():  # tokenizer, generation config, ...: unchanged
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", SAFETENSORS_INDEX):
            shutil.copy2(f, tmp / f.name)
    config["num_key_value_heads"] = hf.num_key_value_heads * factor
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file({k: v.contiguous() for k, v in state.items()}, tmp / "model.safetensors", metadata={"format": "pt"})
    if dst.exists():
        dst.rmdir()
    tmp.rename(dst)
    return dst


def main(argv=None):
    parser = ArgumentParser(prog="python -m llama_xla_helpers.parallel")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=ArgumentParser)
    reshard = commands.add_parser("reshard", help="replicate the KV heads of a local HF Llama checkpoint")
    reshard.add_argument("src", help="checkpoint directory (config.json + *.safetensors)")
    reshard.add_argument("dst", help="new directory to write")
    reshard.add_argument("--factor", type=int, required=True, help="copies of each KV head")
    reshard.add_argument("--debug", action="store_true", help="show the traceback of an input error")
    args = parser.parse_args(argv)
    with user_errors(args.debug):
        out = reshard_checkpoint(args.src, args.dst, args.factor)
    print(f"wrote {out} with {args.factor}x KV heads")


if __name__ == "__main__":
    main()
