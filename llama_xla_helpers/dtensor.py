"""Tables 1 and 2 as DTensor placements on a DeviceMesh: the torch.distributed side of the same rules.

    torchrun --nproc-per-node 4 script.py    # gloo on CPU processes here; TorchTPU's launcher on a TPU

    mesh = device_mesh((2, 2), config)                         # ('data', 'model'); checks before any collective
    model = build_model(config, mesh)                          # Table 1 from sharding.PARAM_SPECS, Table 2 hooks
    optimizer = train.make_optimizer(TrainConfig(optimizer="adamw"), model.parameters())
    for (ids,) in local_batches(dataset, batch_size=16, mesh=mesh):  # each rank reads its own rows
        loss = train_step(model, optimizer, ids)

    llama = parallelize_for_decode(Llama.from_hf(hf, max_batch_size=1, max_seq_len=512), mesh)
    tokens = greedy_decode(llama, prompt, max_new_tokens=32)   # parallel.py's Megatron plan, local KV caches

torch_xla's SPMD runs one program over every device; `torch.distributed` runs one process per
device, and a DTensor is each process's local block plus its placements: per mesh dimension,
`Shard(i)` (tensor dim i split over it) or `Replicate()`. A partition spec names, per tensor
dim, the mesh axes that split it; `placements` turns one into the other, so the training
placements here are computed from `sharding.param_spec` (Table 1, or "fsdp"), not written
twice. Rank r holds the block that XLA device r holds under the same spec: both lay a
(data, model) mesh out row-major (tests/test_dtensor.py compares the blocks, parameter by
parameter, with the shards torch_xla reports).

What differs from SPMD:
- GSPMD propagates shardings through the whole graph and inserts collectives; DTensor decides
  op by op, eagerly, redistributing inputs when an op has no rule for their placements. Plain
  tensors (RoPE tables, masks) count as replicated inside `implicit_replication()`.
- Table 2's activation specs become `redistribute` calls, hooks on the same modules
  (`shard_activations`). On XLA they are hints the partitioner may meet another way; here each
  one runs its collective at that point.
- Where torch 2.9's op rules fail rather than redistribute, the code steps around them, and says
  so where it does: attention runs on each rank's own rows and heads (`local_attention`: the
  batched matmul flattens (bsz, heads), split on two mesh axes), and the embedding lookup gathers
  the ids (Table 1) or the table ("fsdp") first (`_MaskPartial` fails for a vocabulary split on a
  2D mesh). The weights stay placed as Table 1 says. FSDP2's `fully_shard` (which gathers each
  layer's weights before use; `shard_placement_fn` picks the dim it splits on 'data') on top of a
  tensor-parallel plan on 'model' is the other way to reach these blocks; it is not used (nor
  tried) here: explicit placements take each spec as it is, in one step.
- What DTensor cannot express with the public API of torch 2.9:
  * a batch on ('data', 'dcn') of a multi-slice mesh ('dcn', 'data', 'model'), i.e. one tensor
    dim split over several mesh axes in an order other than the mesh's (`sharding.batch_axes`
    does that on purpose); it takes the private `_StridedShard`. `placements` raises for it.
  * the loss over vocabulary-sharded logits without gathering them: `loss_parallel()` accepts
    only a 1-D mesh in torch 2.9, so on the 2D mesh the cross-entropy gathers the vocabulary.
  * attention weights with SDPA or flash attention: they are never materialized, so there is no
    (bsz, num_heads, seqlen, seqlen) tensor to place (as under SPMD, which also uses eager attention).
- The KV cache cannot be a DTensor (`index_copy_` has no sharding rule in torch 2.9): each
  rank keeps a local cache of its own KV heads, as gpt-fast's tp.py does.
- The training step here was checked with `optim.AdamW` (what `train.make_optimizer` builds for
  optimizer="adamw"): it steps DTensors as it steps XLA tensors.

Known to run on torch 2.9.0 (the version pinned here; nothing newer is verified in this
repository). It uses the public `torch.distributed.device_mesh`, `torch.distributed.tensor`,
`torch.distributed.tensor.parallel` and `torch.distributed.checkpoint` paths, plus
`torch.distributed.tensor.experimental.implicit_replication` and
`torch.distributed.tensor._utils.compute_local_shape_and_global_offset`, which may move.
Importing it imports torch_xla (through `sharding`) but touches no XLA device, so it runs in
gloo CPU processes; do not call `runtime.init_runtime` or `use_spmd` there.

Sources:
- the Llama 2 post (Tables 1 and 2): "High-Performance Llama 2 Training and Inference with
  PyTorch/XLA on Cloud TPUs", PyTorch blog, https://pytorch.org/blog/high-performance-llama-2/
- "torch.distributed.tensor", PyTorch docs, https://pytorch.org/docs/stable/distributed.tensor.html
- "Tensor Parallelism - torch.distributed.tensor.parallel", PyTorch docs,
  https://pytorch.org/docs/stable/distributed.tensor.parallel.html
- "Large Scale Transformer model training with Tensor Parallel (TP)", PyTorch tutorials,
  https://pytorch.org/tutorials/intermediate/TP_tutorial.html
- Liang et al., "TorchTitan: One-stop PyTorch native solution for production ready LLM
  pre-training", https://arxiv.org/abs/2410.06511
- gpt-fast's tp.py (local KV caches, local head counts), https://github.com/pytorch-labs/gpt-fast
- "Distributed Checkpoint - torch.distributed.checkpoint", PyTorch docs,
  https://pytorch.org/docs/stable/distributed.checkpoint.html
"""
import copy
import dataclasses
import json
import math
import os
import shutil
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.experimental import implicit_replication
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import BatchSampler, SequentialSampler
from transformers import AttentionInterface, LlamaForCausalLM
from transformers.masking_utils import AttentionMaskInterface, eager_mask
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from . import checkpoint, parallel
from .model import KVCache, Linear
from .sharding import (ACTIVATION_SPECS, INPUT_SPEC, STRATEGIES, check_divisible, param_spec, sharded_eager_attention,
                       sizes_that_fit)

AXES = ("data", "model")


class MeshShape:
    """A mesh's axis names and sizes, read the way `sharding` reads a torch_xla Mesh (`axis_names`,
    `shape()`, `size()`), so its rules and checks apply unchanged, before any process group exists."""

    def __init__(self, sizes, axis_names=AXES):
        self.axis_names, self.sizes = tuple(axis_names), tuple(sizes)

    def shape(self):
        return dict(zip(self.axis_names, self.sizes))

    def size(self):
        return math.prod(self.sizes)


def check_mesh(shape, config, world_size, strategy="2d"):
    """ValueError naming the value, the limit and the fix, if `shape` (data, model) does not fit the
    job's `world_size` processes or does not split `config`'s model evenly.

    Pure arithmetic on arguments every rank has alike, so every rank raises the same error before
    any collective, and none waits for the others."""
    if len(shape) != 2 or not all(isinstance(k, int) and not isinstance(k, bool) and k >= 1 for k in shape):
        raise ValueError(f"mesh shape {shape!r} must be two ints >= 1, (data, model) processes, e.g. (2, 2)")
    if math.prod(shape) != world_size:
        raise ValueError(f"mesh shape {tuple(shape)} needs {math.prod(shape)} processes but the job has "
                         f"{world_size} (WORLD_SIZE); launch torchrun --nproc-per-node {math.prod(shape)}, or use "
                         f"a mesh of {world_size} processes, e.g. ({world_size // math.gcd(world_size, shape[1])}, "
                         f"{math.gcd(world_size, shape[1])})")
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; use one of {STRATEGIES}")
    tp = shape[1]
    for name in ("num_attention_heads", "num_key_value_heads"):  # Table 2 splits the heads on 'model'
        value = getattr(config, name)
        if value % tp:
            raise ValueError(f"{name}={value} is not divisible by the 'model' axis of size {tp} of mesh "
                             f"{tuple(shape)}: each process computes whole heads; use a mesh whose 'model' axis "
                             f"is {sizes_that_fit(value, MeshShape(shape))}" +
                             (", or replicate the KV heads (parallel.replicate_kv_heads)"
                              if name == "num_key_value_heads" else ""))
    mesh = MeshShape(shape)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    for name, p in model.named_parameters():
        check_divisible(name, p.shape, param_spec(name, p.shape, mesh, strategy), mesh)


def device_mesh(shape, config, strategy="2d", device_type="cpu"):
    """The ('data', 'model') DeviceMesh of `shape`, after `check_mesh` (world size from the process
    group, or torchrun's WORLD_SIZE before one exists). Starts the default process group if needed
    (gloo for "cpu")."""
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))
    check_mesh(tuple(shape), config, world, strategy)
    return init_device_mesh(device_type, tuple(shape), mesh_dim_names=AXES)


def placements(spec, mesh_axes=AXES):
    """A partition spec -> DTensor placements, one per mesh axis: Shard(i) on the axis that entry i
    names, Replicate() on an axis no entry names.

        ('model', 'data') on ('data', 'model') -> [Shard(1), Shard(0)]    (vocab_size, hidden_size)
        (('data', 'model'), None)              -> [Shard(0), Shard(0)]    dim 0 over both, data-major
    """
    out = [Replicate()] * len(mesh_axes)
    for dim, axes in enumerate(spec):
        axes = () if axes is None else axes if isinstance(axes, tuple) else (axes,)
        if list(axes) != sorted(axes, key=mesh_axes.index):
            raise ValueError(f"spec {spec}: dim {dim} is split over {axes}, not in the mesh's order {mesh_axes}; "
                             f"DTensor's public placements split a dim over several axes in mesh order only")
        for a in axes:
            out[mesh_axes.index(a)] = Shard(dim)
    return out


def mesh_placements(spec, mesh):
    """`placements(spec)` on the DeviceMesh `mesh`, with Replicate() on its axes of size 1. The blocks
    are the same; torch 2.9's DTensor fails on some redistributions from a Shard over one device
    (a (1, 1) mesh's backward: "redistribute from S(2) to P not supported yet")."""
    return [Replicate() if mesh.size(i) == 1 else p for i, p in enumerate(placements(spec, mesh.mesh_dim_names))]


def local_block(shape, mesh, placements):
    """This rank's block of a tensor of global `shape` under `placements`: a tuple of slices, one per dim."""
    sizes, offsets = compute_local_shape_and_global_offset(shape, mesh, placements)
    return tuple(slice(o, o + n) for o, n in zip(offsets, sizes))


def to_dtensor(source, mesh, placements, shape=None):
    """A DTensor from each rank's own block: `source` is a CPU tensor every rank holds, or a function
    `read(index)` returning the block at `index` (as `sharding.to_sharded` takes; e.g.
    `train.init_weights`), so no rank needs the whole tensor."""
    shape = tuple(source.shape if shape is None else shape)
    read = source if callable(source) else source.__getitem__
    block = read(local_block(shape, mesh, placements)).contiguous()
    return DTensor.from_local(block, mesh, placements, shape=torch.Size(shape),
                              stride=torch.empty(shape, device="meta").stride())


def shard_params(model, mesh, strategy="2d", init=None):
    """Make every parameter of the HF `model` a DTensor placed by `sharding.param_spec` (Table 1 for
    '2d'); returns {name: placements}. Parameters on the meta device come from `init(name, shape)`, a
    `read(index)` function, as for `sharding.shard_params`; tied ones stay one tensor."""
    shape = MeshShape(mesh.shape, mesh.mesh_dim_names)
    aliases = {}  # parameter -> its names
    for n, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(p, []).append(n)
    table = {}
    for p, (n, *tied) in aliases.items():
        spec = param_spec(n, p.shape, shape, strategy)
        check_divisible(n, p.shape, spec, shape)
        table.update(dict.fromkeys((n, *tied), mesh_placements(spec, mesh)))
        source = init(n, tuple(p.shape)) if p.is_meta else p.detach()
        param = nn.Parameter(to_dtensor(source, mesh, table[n], p.shape), requires_grad=p.requires_grad)
        for name in (n, *tied):
            owner, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(owner), leaf, param)
    return table


_ATTENTION_NAMES = {}  # str(mesh) -> the name its attention function is registered under


def shard_activations(model, mesh):
    """Table 2 (`sharding.ACTIVATION_SPECS`) as redistributions: a forward hook moves the output of
    the embedding, every Linear and lm_head to its placements (the attention weights' row is
    `local_attention`'s). Returns the hook handles."""
    table = {n: mesh_placements(spec, mesh) for n, spec in ACTIVATION_SPECS.items() if n != "attn_weights"}
    return [m.register_forward_hook(lambda mod, args, out, p=table[n.rsplit(".", 1)[-1]]: out.redistribute(mesh, p))
            for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in table]


def local_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, *, mesh, **kwargs):
    """HF's attention with Table 2's attention weights, (bsz, num_heads, seqlen, seqlen) on ('data',
    'model'): query, key and value (bsz, heads, seqlen, head_dim) are placed the same way, and each
    rank computes `sharding.sharded_eager_attention` for its own rows and heads, locally.

    Not op by op: its batched matmul flattens (bsz, heads), and torch 2.9 has no rule for
    flattening two dims sharded on different mesh axes (it fails instead of redistributing)."""
    heads = mesh_placements(ACTIVATION_SPECS["attn_weights"], mesh)  # [Shard(0), Shard(1)]
    rows = mesh_placements(("data", None, None, None), mesh)
    q, k, v = (t.redistribute(mesh, heads).to_local() for t in (query, key, value))
    if attention_mask is not None and attention_mask.shape[0] > 1:  # plain (bsz, 1, seqlen, kv_len): our rows
        attention_mask = attention_mask[local_block(attention_mask.shape, mesh, rows)]
    out, weights = sharded_eager_attention(module, q, k, v, attention_mask, scaling, dropout,
                                           constrain_weights=lambda w: w)  # already placed
    rows_heads = mesh_placements(("data", None, "model", None), mesh)  # out: (bsz, seqlen, heads, head_dim)
    return DTensor.from_local(out, mesh, rows_heads), DTensor.from_local(weights, mesh, heads)


def use_local_attention(model, mesh):
    """Make the HF `model` call `local_attention` on `mesh`. Transformers looks attention functions up
    by name in a process-wide registry: one name per mesh, as `sharding.shard_activations` does."""
    name = _ATTENTION_NAMES.setdefault(str(mesh), f"dtensor_local_{len(_ATTENTION_NAMES)}")
    AttentionInterface.register(name, partial(local_attention, mesh=mesh))
    AttentionMaskInterface.register(name, eager_mask)
    model.set_attn_implementation(name)


def _replicate_ids(module, args):
    """Token ids (bsz, seqlen) replicated before the embedding lookup. torch 2.9's embedding rule
    fails for batch-sharded ids and a vocabulary-sharded weight on a 2D mesh (IndexError in
    _MaskPartial.apply_mask); gathering the ids, a few bytes per token, avoids it."""
    ids = args[0]
    return (ids.redistribute(ids.device_mesh, [Replicate()] * ids.device_mesh.ndim),)


def _gathered_lookup(embedding, ids):
    """The embedding lookup with the whole table, as FSDP gathers a weight before its use. (torch 2.9's
    embedding rule fails for a vocabulary split over both mesh axes: "MaskBuffer has been materialized
    with conflicting data".)"""
    weight = embedding.weight  # (vocab_size, hidden_size)
    return F.embedding(ids, weight.redistribute(weight.device_mesh, [Replicate()] * weight.device_mesh.ndim))


def build_model(config, mesh, strategy="2d", seed=0, init_from=None):
    """`train.build_model` for a DeviceMesh: a LlamaForCausalLM built on the meta device, each rank
    creating only its blocks (`train.init_weights(config, seed)`, the same numbers as the SPMD
    model, or the blocks of the local HF folder `init_from`), with Table 2 for '2d'."""
    from .train import init_weights  # train imports the XLA training loop; only this is needed
    with torch.device("meta"):
        model = LlamaForCausalLM(copy.deepcopy(config))  # its own: the attention function is set in it
    model.model.rotary_emb = LlamaRotaryEmbedding(config=config)  # its buffer, computed on the CPU
    init = checkpoint.hf_reader(init_from) if init_from else init_weights(config, seed)
    shard_params(model, mesh, strategy, init=init)
    use_local_attention(model, mesh)
    if strategy == "2d":
        model.model.embed_tokens.register_forward_pre_hook(_replicate_ids)
        shard_activations(model, mesh)
    else:
        model.model.embed_tokens.forward = partial(_gathered_lookup, model.model.embed_tokens)
    return model


def input_placements(mesh):
    """Token batches (bsz, seqlen): batch on 'data', sequence replicated (`sharding.INPUT_SPEC`)."""
    return mesh_placements(INPUT_SPEC, mesh)


def local_batches(dataset, batch_size, mesh, sampler=None):
    """`sharding.sharded_loader` for a DeviceMesh: batches of a TensorDataset of (n, seqlen) tensors,
    each yielded as a tuple of DTensors placed by `input_placements`, of which this rank reads only
    its own rows: the same contiguous block of each batch as the XLA devices at its mesh position.

    (DistributedSampler(dataset, num_replicas=data, rank=mesh.get_local_rank("data")) gives each
    rank the same number of rows, but interleaved: a batch of other rows in another order.)"""
    data = mesh.size(mesh.mesh_dim_names.index("data"))
    if batch_size % data:
        raise ValueError(f"batch_size {batch_size} is not divisible by the 'data' axis of size {data}; "
                         f"use a multiple of {data}")
    rows, mine = batch_size // data, mesh.get_local_rank("data")
    order = SequentialSampler(dataset) if sampler is None else sampler
    for batch in BatchSampler(order, batch_size, drop_last=True):
        index = torch.tensor(batch[mine * rows:(mine + 1) * rows])
        yield tuple(DTensor.from_local(t[index], mesh, input_placements(mesh), shape=(batch_size, t.shape[1]),
                                       stride=(t.shape[1], 1)) for t in dataset.tensors)


def forward(model, ids):
    """Logits (bsz, seqlen, vocab_size) of ids (bsz, seqlen), DTensors (placed as Table 2 says, for '2d')."""
    with implicit_replication():  # RoPE tables and the causal mask are plain tensors: replicated
        hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state  # (bsz, seqlen, hidden_size)
        return model.lm_head(hidden)  # LlamaForCausalLM.forward, without its no-op slice (no DTensor rule for alias)


def forward_loss(model, ids):
    """Mean next-token loss of ids (bsz, seqlen), a DTensor, over every token (`train.forward_loss`)."""
    logits = forward(model, ids)  # (bsz, seqlen, vocab_size)
    with implicit_replication():
        return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


def train_step(model, optimizer, ids):
    """Forward, backward and one optimizer step on ids (bsz, seqlen); returns the loss (a replicated DTensor)."""
    loss = forward_loss(model, ids)
    with implicit_replication():
        loss.backward()
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


# --- Tensor-parallel decoding of the inference Llama ---------------------------------------------

def decode_plan(model):
    """parallel.py's Megatron plan as ParallelStyles: {module name: ColwiseParallel | RowwiseParallel}.

    `parallel.param_spec` puts 'model' on one dim of each weight as nn.Linear stores it (out, in):
    dim 0 is column-parallel (whole heads, a slice of the MLP; output stays sharded, Shard(-1)),
    dim 1 row-parallel (partial sums, all-reduced: Replicate). nn.Embedding's weight is
    (vocab_size, dim): its dim 0 (vocabulary-parallel) is RowwiseParallel with replicated ids. The
    logits are all-gathered (Replicate) for the greedy pick; GSPMD gathers only each shard's best.
    """
    plan = {}
    for name, module in model.named_modules():
        if not isinstance(module, (nn.Linear, nn.Embedding)):
            continue
        spec = parallel.param_spec(f"{name}.weight", 2)
        if "model" not in spec:
            continue
        column = spec.index("model") == (0 if isinstance(module, nn.Linear) else 1)
        if column:
            plan[name] = ColwiseParallel(output_layouts=Replicate() if name == "lm_head" else Shard(-1))
        else:
            plan[name] = RowwiseParallel(input_layouts=Replicate() if isinstance(module, nn.Embedding) else Shard(-1))
    return plan


def _nn_linear(module):
    """The nn.Linear holding a `model.Linear`'s weight as (out, in): the layer Colwise/RowwiseParallel take."""
    linear = nn.Linear(module.in_features, module.out_features, bias=False, device="meta")
    linear.weight = nn.Parameter(module.weight.detach().contiguous(), requires_grad=False)  # weight_t.t()
    return linear


def parallelize_for_decode(model, mesh):
    """Shard a CPU `Llama` over the 'model' axis of `mesh` (a DeviceMesh with a 'model' dim): the plan
    of `shard_for_inference`, as DTensors; returns the model.

    Each rank keeps its n_heads / tp query heads and n_kv_heads / tp KV heads, and a local KV cache
    of those heads (bsz, max_seq_len, n_kv_heads / tp, head_dim). Every activation between the
    sharded layers is a local tensor: the Attention and FeedForward code runs unchanged, on local
    heads. The ranks of one 'data' row hold the same model (the batch is not split).
    """
    tp_mesh = mesh["model"] if mesh.ndim > 1 else mesh
    tp = tp_mesh.size()
    parallel.check_tensor_parallel(model.args, MeshShape((tp,), ("model",)))
    for name, module in list(model.named_modules()):
        if isinstance(module, Linear):  # stores (in, out); DTensor's styles take nn.Linear
            owner, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(owner), leaf, _nn_linear(module))
    parallelize_module(model, tp_mesh, decode_plan(model))
    args = model.args
    local = dataclasses.replace(args, n_heads=args.n_heads // tp, n_kv_heads=args.n_kv_heads // tp)
    dtype = model.norm.weight.dtype
    for layer in model.layers:
        layer.self_attn.n_heads, layer.self_attn.n_kv_heads = local.n_heads, local.n_kv_heads
        layer.self_attn.kv_cache = KVCache(local, dtype, model.rope_cos.device)  # a plain, local tensor
    return model


@torch.no_grad()
def greedy_decode(model, prompt, max_new_tokens):
    """Greedy tokens after `prompt` (a list of ids): one prefill at cache slots 0..n-1, then one
    token per step at the next slot, as `Generator` does without buckets (eagerly, on the CPU)."""
    tokens = torch.tensor([prompt])  # (1, n)
    logits = model(tokens, torch.arange(len(prompt)))  # (1, n, vocab_size)
    out = [int(logits[0, -1].argmax())]
    for pos in range(len(prompt), len(prompt) + max_new_tokens - 1):
        logits = model(torch.tensor([[out[-1]]]), torch.tensor([pos]))  # (1, 1, vocab_size)
        out.append(int(logits[0, -1].argmax()))
    return out


# --- Checkpoints: DCP is the format both stacks read -----------------------------------------------

def save(directory, step, model):
    """Save the DTensor `model` as `checkpoint.save` lays a checkpoint out, so `checkpoint.load` reads
    it into the SPMD model: directory/step_XXXXXXXX/ with each rank's blocks (DCP) and meta.json.
    Written under a temporary name that rank 0 renames when complete. Returns the folder's Path."""
    final = Path(directory) / f"step_{step:08d}"
    tmp = final.with_name(".tmp_" + final.name)
    lead = dist.get_rank() == 0
    if lead:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    state = {"model": model.state_dict()}
    dcp.save(state, checkpoint_id=tmp)
    if lead:
        meta = dict(step=int(step), extra={}, contents=["model"],
                    tensors={f"model.{n}": list(t.shape) for n, t in state["model"].items()})  # global shapes
        (tmp / checkpoint.META).write_text(json.dumps(meta, indent=1))
        if final.exists():
            shutil.rmtree(final)
        tmp.replace(final)
    dist.barrier()
    return final


def load(path, model):
    """Load the model part of a checkpoint (`checkpoint.save`'s or `save`'s) into the DTensor `model`
    in place: DCP reads, on each rank, the bytes of its own blocks whatever layout wrote them."""
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=Path(path))
    return model
