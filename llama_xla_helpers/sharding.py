"""The partition-spec rules of the Llama 2 post (Tables 1 and 2), applied to the Hugging Face Llama.

A partition spec has one entry per tensor dimension: a mesh axis name (split that dimension over
the axis), a tuple of names (split over several axes), or None (replicate it).

On a multi-slice pod the mesh has a leading 'dcn' axis, one entry per slice (torchprime's
layout): parameters keep the specs below, which do not name 'dcn', so each slice holds a full
sharded copy; only the batch is split across slices, on ('data', 'dcn') (see `batch_axes`), so
only the data-parallel gradient reduction crosses the slow data-center network.
"""
import hashlib
import math
import queue
import re
import threading
from functools import partial

import torch
import torch_xla
import torch_xla.distributed.spmd as xs
from torch_xla.distributed.spmd.xla_sharding import apply_xla_patch_to_nn_linear, wrap_as_sharded_tensor
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask
from transformers.models.llama.modeling_llama import repeat_kv

# Table 1, keyed by the HF module that owns the weight: a 2D training layout that splits
# every weight on both axes. nn.Linear stores (out_features, in_features); the hidden_size dim
# goes on 'data' in every weight except q/k/v/o, whose specs are the transposes of gate/up's and
# down's. (Not the Megatron layout of `parallel`, which uses 'model' only.) Norms are replicated.
PARAM_SPECS = {
    "embed_tokens": ("model", "data"),  # (vocab_size, hidden_size)
    "q_proj": ("data", "model"),        # (num_heads * head_dim, hidden_size)
    "k_proj": ("data", "model"),        # (num_kv_heads * head_dim, hidden_size)
    "v_proj": ("data", "model"),        # (num_kv_heads * head_dim, hidden_size)
    "o_proj": ("model", "data"),        # (hidden_size, num_heads * head_dim)
    "gate_proj": ("model", "data"),     # (intermediate_size, hidden_size)
    "up_proj": ("model", "data"),       # (intermediate_size, hidden_size)
    "down_proj": ("data", "model"),     # (hidden_size, intermediate_size)
    "lm_head": ("model", "data"),       # (vocab_size, hidden_size)
}

# Table 2: batch on 'data', sequence replicated, last dim on 'model'. Keyed by the module
# whose output is annotated ('attn_weights' is inside the attention function). The batch goes
# on `batch_axes(mesh)`: ('data', 'dcn') on a multi-slice mesh (see `batch_spec`).
ACTIVATION_SPECS = {
    "embed_tokens": ("data", None, "model"),      # inputs_embeds (bsz, seqlen, hidden_size)
    "q_proj": ("data", None, "model"),            # query_states (bsz, seqlen, num_heads * head_dim)
    "k_proj": ("data", None, "model"),            # key_states (bsz, seqlen, num_kv_heads * head_dim)
    "v_proj": ("data", None, "model"),            # value_states
    "attn_weights": ("data", "model", None, None),  # (bsz, num_heads, seqlen, seqlen)
    "o_proj": ("data", None, "model"),            # attn_output (bsz, seqlen, hidden_size)
    "gate_proj": ("data", None, "model"),         # (bsz, seqlen, intermediate_size)
    "up_proj": ("data", None, "model"),           # (bsz, seqlen, intermediate_size)
    "down_proj": ("data", None, "model"),         # (bsz, seqlen, hidden_size)
    "lm_head": ("data", None, "model"),           # logits (bsz, seqlen, vocab_size)
}

INPUT_SPEC = ("data", None)  # token batches (bsz, seqlen): batch on 'data' (batch_spec: and 'dcn')
STRATEGIES = ("2d", "fsdp")


def axis_size(mesh, axes):
    """Devices along one mesh axis name, or along several (a tuple of names)."""
    axes = axes if isinstance(axes, tuple) else (axes,)
    for a in axes:
        if a not in mesh.axis_names:
            raise ValueError(f"mesh has no axis {a!r}; its axes are {mesh.axis_names}. "
                             f"Build it with make_mesh(axis_names=('data', 'model'))")
    return math.prod([mesh.shape()[a] for a in axes])


def batch_axes(mesh):
    """The mesh axes a batch is split over: 'data', and 'dcn' too if the mesh has that axis.

    ('data', 'dcn') rather than slices outermost, ('dcn', 'data'): the same split, 1/(data * dcn)
    of the batch per device, in another order. With the Table 1 weights and 'data' and 'model'
    both of size 2, the SPMD partitioner of torch_xla 2.9's XLA computes wrong values for
    ('dcn', 'data') (tests/test_sharding.py::test_xla_miscompiles_a_batch_on_dcn_then_data).
    """
    axis_size(mesh, "data")
    return ("data", "dcn") if "dcn" in mesh.axis_names else "data"


def batch_spec(spec, mesh):
    """A batch-first spec (INPUT_SPEC, an ACTIVATION_SPECS entry) with its batch on `batch_axes(mesh)`."""
    return (batch_axes(mesh),) + tuple(spec[1:])


def sizes_that_fit(n, mesh):
    """Axis sizes that divide both n and the device count, for error messages."""
    return " or ".join(str(s) for s in range(1, mesh.size() + 1) if mesh.size() % s == 0 and n % s == 0)


def check_divisible(what, shape, spec, mesh):
    """Raise a ValueError naming `what` if a sharded dimension does not split evenly."""
    for dim, axes in enumerate(spec):
        k = 1 if axes is None else axis_size(mesh, axes)
        if shape[dim] % k:
            raise ValueError(f"{what}: dim {dim} of shape {tuple(shape)} is not divisible by mesh axis "
                             f"{axes!r} of size {k}; use a mesh whose {axes!r} axis has size "
                             f"{sizes_that_fit(shape[dim], mesh)}")


def param_spec(name, shape, mesh, strategy="2d"):
    """The partition spec of one parameter: Table 1 for '2d'; for 'fsdp' the largest dim over all
    devices of a slice (the largest that divides evenly, if any does: (264, 128) on 16 devices
    splits the 128). Neither splits a weight over 'dcn': every slice holds a whole copy."""
    if strategy == "2d":
        return PARAM_SPECS.get(name.rsplit(".", 2)[-2], (None,) * len(shape))
    axes = tuple(a for a in mesh.axis_names if a != "dcn")
    n = axis_size(mesh, axes)
    even = [d for d in range(len(shape)) if shape[d] % n == 0] or range(len(shape))
    big = max(even, key=lambda d: shape[d])
    return tuple(axes if d == big else None for d in range(len(shape)))


def shard_params(model, mesh, strategy="2d", init=None):
    """Move `model` to the XLA device with every parameter annotated; returns `sharding_table(model)`.

    Every spec is checked before anything moves. Parameters go one at a time, each device
    receiving only its shard; those still on the meta device are created by
    `init(name, shape)` first (a CPU tensor, or `read(index)` for `to_sharded`, which asks it for
    this host's blocks only), so the full unsharded model never exists.
    nn.Linear layers are swapped for torch_xla's einsum Linear (the post's first caveat:
    matmul flattens sharded dims and hurts sharding propagation).
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; use one of {STRATEGIES}")
    aliases = {}  # parameter -> its names: tied embeddings are one tensor under two names
    for n, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(p, []).append(n)
    specs = {n: param_spec(n, p.shape, mesh, strategy) for p, names in aliases.items() for n in names}
    for n, p in model.named_parameters():
        check_divisible(n, p.shape, specs[n], mesh)
    apply_xla_patch_to_nn_linear(model)
    for p, (n, *tied) in aliases.items():
        data = init(n, tuple(p.shape)) if p.is_meta else p.detach().cpu()
        param = torch.nn.Parameter(to_sharded(data, mesh, specs[n]), requires_grad=p.requires_grad)
        for name in (n, *tied):  # every name keeps pointing at the one (sharded) tensor
            owner, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(owner), leaf, param)
    model.to(torch_xla.device())  # buffers
    model.partition_specs = specs
    return sharding_table(model)


def head_dim(config):
    """A Hugging Face Llama config's head size: its head_dim if set, else hidden_size / heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def keyed_generator(key):
    """A CPU generator seeded from the hash of the string `key`: the same draws on every host,
    whatever mesh splits the tensor they fill."""
    return torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") >> 1)


def to_sharded(source, mesh, spec, shape=None):
    """Upload a tensor straight into its shards: each device of this host receives only its block.

    `source`: a CPU tensor, or a function `read(index)` returning the block at `index` (a tuple
    of slices, one per dim) as a CPU tensor, e.g. from a file (`checkpoint.hf_reader`), so the
    whole tensor never exists on this host. A function needs the global `shape` (the argument,
    else its `shape` attribute). Each distinct block is read once, even if several devices
    hold it. (`cpu.to(device)` then `mark_sharding` would first put a full copy on every device.)
    """
    shape = tuple(source.shape if shape is None else shape)
    read = source if callable(source) else source.__getitem__
    blocks = {}  # ((start, stop) per dim) -> block
    shards = []
    for index in local_blocks(mesh, spec, shape):
        key = tuple((s.start, s.stop) for s in index)
        if key not in blocks:
            blocks[key] = read(index).contiguous()
            if blocks[key].shape != tuple(b - a for a, b in key):
                raise ValueError(f"read({index}) returned shape {tuple(blocks[key].shape)}, not the block's "
                                 f"{tuple(b - a for a, b in key)}; return the block of the whole {shape} tensor")
        shards.append(blocks[key])
    return torch_xla._XLAC._global_tensor_from_cpu_shards(shards, mesh.get_op_sharding(spec), list(shape))


# (str(mesh), spec, shape) -> local_blocks' answer
_LOCAL_BLOCKS = {}


def local_blocks(mesh, spec, shape):
    """The block (a tuple of slices, one per dim) that each of this host's devices holds of a
    tensor of `shape` sharded by `spec`, in the order of the devices.

    Asked of torch_xla once per (mesh, spec, shape), on a placeholder: making its data compiles
    and runs one small graph, which a training loop should not do for every batch.
    """
    key = (str(mesh), tuple(spec), tuple(shape))
    if key not in _LOCAL_BLOCKS:
        placeholder = torch.empty(shape, device=torch_xla.device())
        xs.mark_sharding(placeholder, mesh, spec)
        _LOCAL_BLOCKS[key] = [tuple(slice(0, n) for n in shape) if index is Ellipsis else tuple(index)  # ...: whole
                              for _, index in torch_xla._XLAC._get_local_shard_replica_and_indices([placeholder])[0]]
    return _LOCAL_BLOCKS[key]


def shard_shape(t):
    """The per-device shard shape of an XLA tensor, read from its XLA sharding."""
    m = re.search(r"devices=\[([\d,]+)\]", torch_xla._XLAC._get_xla_sharding_spec(t))
    tiles = [int(k) for k in m.group(1).split(",")][:t.dim()] if m else [1] * t.dim()
    return tuple(-(-s // k) for s, k in zip(t.shape, tiles))


def sharding_table(model):
    """One row per parameter: name, global shape, partition spec, shard shape and bytes per device."""
    specs = getattr(model, "partition_specs", {})
    rows = []
    for n, p in model.named_parameters():
        shard = shard_shape(p) if p.device.type == "xla" else tuple(p.shape)
        rows.append(dict(name=n, shape=tuple(p.shape), spec=specs.get(n), shard=shard,
                         bytes_per_device=math.prod(shard) * p.element_size()))
    return rows


# (str(mesh), str(spec)) -> torch_xla OpSharding, built once by each Constraint.
_OP_SHARDINGS = {}


@torch.library.custom_op("llama_xla::mark_sharding", mutates_args=())
def _mark_sharding(t: torch.Tensor, mesh: str, spec: str) -> torch.Tensor:
    """A copy of `t` annotated with the sharding a Constraint built for these strings.

    Strings, not a Mesh, so that dynamo can trace it. torch_xla's xla::aot_mark_sharding takes
    the same strings but on every call parses them into a new Mesh, computes its OpSharding anew
    (cached per Mesh object, so that cache only grows) and, without jax installed, retries
    importing it: ~0.5 ms of host time per annotation. Here it is one dict lookup.
    """
    out = t.clone()  # a custom op may not return its input
    torch_xla._XLAC._xla_mark_sharding(out, _OP_SHARDINGS[mesh, spec])
    return out


@_mark_sharding.register_fake
def _(t, mesh, spec):
    return torch.empty_like(t)


def _keep_strings(ctx, inputs, output):
    ctx.strs = inputs[1:]


def _mark_grad(ctx, grad):  # the gradient gets the same sharding
    return _mark_sharding(grad, *ctx.strs), None, None


_mark_sharding.register_autograd(_mark_grad, setup_context=_keep_strings)


class Constraint:
    """Shard an intermediate tensor (JAX's with_sharding_constraint), eagerly or under torch.compile.

    `Constraint("q_proj output", mesh, spec)(t)` checks the split is even and returns `t`
    annotated; its gradient gets the same sharding in the backward pass. The sharding is
    built here, once: a call only looks it up.
    """

    def __init__(self, name, mesh, spec):
        self.name, self.mesh, self.spec = name, mesh, tuple(spec)
        self.strs = (str(mesh), str(self.spec))
        self.splits = [1 if a is None else axis_size(mesh, a) for a in self.spec]
        _OP_SHARDINGS[self.strs] = mesh.get_op_sharding(self.spec)

    def __call__(self, t):
        if t.dim() != len(self.spec):
            raise ValueError(f"{self.name}: spec {self.spec} has {len(self.spec)} entries but the tensor has "
                             f"shape {tuple(t.shape)}; give one entry per dimension")
        for size, k in zip(t.shape, self.splits):
            if size % k:
                check_divisible(self.name, t.shape, self.spec, self.mesh)  # raises, naming the dim
        return _mark_sharding(t, *self.strs)


def sharded_eager_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, *,
                            constrain_weights, **kwargs):
    """HF's eager attention written with einsum, with attn_weights annotated as in Table 2."""
    key = repeat_kv(key, module.num_key_value_groups)      # (bsz, num_heads, seqlen, head_dim)
    value = repeat_kv(value, module.num_key_value_groups)
    scores = torch.einsum("bhqd,bhkd->bhqk", query, key) * scaling
    if attention_mask is not None:
        scores = scores + attention_mask[:, :, :, :key.shape[-2]]
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = constrain_weights(weights)                   # (bsz, num_heads, seqlen, seqlen)
    weights = torch.nn.functional.dropout(weights, p=dropout, training=module.training)
    return torch.einsum("bhqk,bhkd->bqhd", weights, value), weights  # (bsz, seqlen, num_heads, head_dim)


_ATTENTION_NAMES = {}  # str(mesh) -> the name its attention function is registered under


def shard_activations(model, mesh):
    """Annotate, inside the graph, the activations of Table 2 without editing the HF source.

    Forward hooks shard the outputs of the embedding, every Linear and lm_head (the logits);
    an attention function registered for this mesh shards the attention weights. Returns the
    hook handles.
    """
    cfg = model.config
    for what, size in [("hidden_size", cfg.hidden_size), ("num_attention_heads", cfg.num_attention_heads),
                       ("num_key_value_heads * head_dim", cfg.num_key_value_heads * head_dim(cfg)),
                       ("intermediate_size", cfg.intermediate_size), ("vocab_size", cfg.vocab_size)]:
        if size % axis_size(mesh, "model"):
            raise ValueError(f"{what}={size} is not divisible by mesh axis 'model' of size "
                             f"{axis_size(mesh, 'model')}, which splits it in Table 2; use a mesh whose "
                             f"'model' axis has size {sizes_that_fit(size, mesh)}")
    constraints = {n: Constraint(f"{n} output", mesh, batch_spec(spec, mesh))
                   for n, spec in ACTIVATION_SPECS.items()}
    # Transformers looks the attention function up by name in a process-wide registry: one name
    # per mesh, so that sharding another model on another mesh leaves this one's alone.
    name = _ATTENTION_NAMES.setdefault(str(mesh), f"xla_sharded_{len(_ATTENTION_NAMES)}")
    AttentionInterface.register(name, partial(sharded_eager_attention, constrain_weights=constraints["attn_weights"]))
    AttentionMaskInterface.register(name, eager_mask)
    model.set_attn_implementation(name)
    return [m.register_forward_hook(lambda mod, args, out, c=constraints[n.rsplit(".", 1)[-1]]: c(out))
            for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in constraints]


def input_sharding(mesh):
    """The ShardingSpec for token batches: batch on `batch_axes(mesh)`, sequence replicated."""
    return xs.ShardingSpec(mesh, batch_spec(INPUT_SPEC, mesh))


def sharded_loader(dataset, batch_size, mesh, sampler=None, prefetch=0):
    """Batches of a TensorDataset of (n, seqlen) tensors as XLA tensors sharded by `input_sharding(mesh)`.

    Yields a tuple per batch, as a DataLoader would. Each host reads only the rows its own
    devices hold (`to_sharded`): on a pod, its slice of the global batch, never all of it.
    (MpDeviceLoader with `input_sharding`, the post's lines, gives the same tensors, but every
    host reads the whole batch first.) `sampler` orders the rows; a short last batch is dropped
    (the post's caveat: it cannot be split on 'data'). `prefetch`: batches read and put on the
    devices that far ahead, on a background thread (`prefetched`); 0: each when it is asked for.
    """
    axes = batch_axes(mesh)
    k = axis_size(mesh, axes)
    if batch_size % k:
        raise ValueError(f"batch_size {batch_size} is not divisible by the {axes!r} axis of size {k}; "
                         f"use a multiple of {k}")
    for t in dataset.tensors:  # here, not at the first batch (a training loop counts its compiles)
        local_blocks(mesh, batch_spec(INPUT_SPEC, mesh), (batch_size, t.shape[1]))
    order = torch.utils.data.SequentialSampler(dataset) if sampler is None else sampler
    batches = _sharded_batches(dataset.tensors, torch.utils.data.BatchSampler(order, batch_size, drop_last=True), mesh)
    return prefetched(batches, prefetch) if prefetch else batches


def prefetched(items, depth):
    """Iterate `items` on a background thread, at most `depth` of them ahead (bounded memory), as
    MpDeviceLoader does: a training loop gets its next batch already read and on the devices. An
    exception in the thread raises here, where its item would have come; closing the iterator
    (or dropping it) lets the thread go."""
    ready, stop, end = queue.Queue(depth), threading.Event(), object()

    def offer(item):  # False once the consumer has gone
        while not stop.is_set():
            try:
                ready.put(item, timeout=0.1)
                return True
            except queue.Full:
                pass
        return False

    def fill():
        try:
            for item in items:
                if not offer(item):
                    return
        except BaseException as e:  # noqa: BLE001  raised in the consumer's thread
            offer(_Failed(e))
            return
        offer(end)

    threading.Thread(target=fill, name="prefetch", daemon=True).start()
    try:
        while (item := ready.get()) is not end:
            if isinstance(item, _Failed):
                raise item.error
            yield item
    finally:
        stop.set()


class _Failed:
    def __init__(self, error):
        self.error = error


def _sharded_batches(tensors, batches, mesh):
    spec = batch_spec(INPUT_SPEC, mesh)
    for rows in map(torch.tensor, batches):
        yield tuple(to_sharded(_rows_reader(t, rows, mesh, spec), mesh, spec, (len(rows), t.shape[1])) for t in tensors)


def _rows_reader(t, rows, mesh, spec):
    """read(index) for to_sharded: a device block of the batch `rows` of `t`, cut from one read of the
    rows this host's devices hold (lo..hi of the batch; a token file at a URL: one request, not one
    per device), and no others."""
    blocks = local_blocks(mesh, spec, (len(rows), t.shape[1]))
    lo, hi = min(index[0].start for index in blocks), max(index[0].stop for index in blocks)
    mine = t[rows[lo:hi]]  # (hi - lo, seq_len)
    return lambda index: mine[index[0].start - lo:index[0].stop - lo, index[1]]


def device_blocks(t):
    """Which device holds which block of an XLA tensor: [(device_id, index slices)] from its shards."""
    shards = wrap_as_sharded_tensor(t).local_shards
    whole = tuple(slice(0, n) for n in t.shape)  # a replicated shard's indices are `...`
    return [(int(s.shard_device.split(":")[-1]), whole if s.indices is Ellipsis else tuple(s.indices))
            for s in shards]
