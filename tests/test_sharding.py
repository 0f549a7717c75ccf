import contextlib
import copy
import math
import time

import numpy as np
import pytest
import torch
import torch_xla
import torch_xla.backends
import torch_xla.distributed.spmd as xs
from torch.utils.data import TensorDataset
from torch_xla.distributed.spmd.xla_sharding import wrap_as_sharded_tensor

from llama_xla_helpers.configs import get_config
from llama_xla_helpers.mesh import make_mesh
from llama_xla_helpers.data import TokenRows
from llama_xla_helpers.sharding import (INPUT_SPEC, Constraint, device_blocks, input_sharding, param_spec, prefetched,
                                        shard_activations, shard_params, shard_shape, sharded_loader)
from util import N, eight_devices, hf_model

pytestmark = pytest.mark.fixed_dtype  # no test here reads the default dtype (conftest checks)

MESHES = [(8, 1), (4, 2), (2, 4), (1, 8)]
# Tiny configs: 8 heads so every model axis up to 8 divides them; MHA and GQA.
CONFIGS = {"mha": get_config("tiny", num_hidden_layers=2, num_key_value_heads=8),
           "gqa": get_config("tiny", num_hidden_layers=2, num_key_value_heads=2)}


@pytest.fixture(scope="module")
def reference():
    """Unsharded CPU models and their logits on one batch (8 sequences of 16 tokens)."""
    ids = torch.randint(0, 264, (8, 16), generator=torch.Generator().manual_seed(1))
    out = {}
    for name, cfg in CONFIGS.items():
        model = hf_model(cfg)
        with torch.no_grad():
            out[name] = (model, model(ids).logits)
    return ids, out


@contextlib.contextmanager
def fp32_matmuls():
    """fp32 matmuls inside the block, to compare with the CPU's fp32 reference. On a TPU the default
    precision multiplies fp32 inputs in bf16 (one pass: ~3 significant digits); 'highest' takes six
    passes for about fp32's accuracy. (The CPU computes fp32 in any case.)"""
    before = torch_xla.backends.get_mat_mul_precision()
    torch_xla.backends.set_mat_mul_precision("highest")
    try:
        yield
    finally:
        torch_xla.backends.set_mat_mul_precision(before)


def sharding_of(t, mesh, spec):
    """The XLA sharding string `spec` gives a tensor shaped like `t` on `mesh`, to compare with."""
    reference = torch.zeros(t.shape, device=torch_xla.device())
    xs.mark_sharding(reference, mesh, spec)
    return torch_xla._XLAC._get_xla_sharding_spec(reference)


def sharded_logits(model, ids, mesh, activations, inputs, strategy="2d", compile=False):
    model = copy.deepcopy(model)
    shard_params(model, mesh, strategy)
    if activations:
        shard_activations(model, mesh)
    x = ids.to(torch_xla.device())
    if inputs:
        xs.mark_sharding(x, mesh, INPUT_SPEC)
    forward = torch.compile(model, backend="openxla") if compile else model
    with torch.no_grad():
        return forward(x).logits.cpu()


def table_1_specs(num_layers):
    """Table 1 of the Llama 2 post for every parameter of a Hugging Face Llama, by full name: each
    (vocab | intermediate | heads * head_dim, hidden) weight and its transposes; norms replicated."""
    specs = {"model.embed_tokens.weight": ("model", "data"), "model.norm.weight": (None,),
             "lm_head.weight": ("model", "data")}
    for i in range(num_layers):
        specs.update({f"model.layers.{i}.{name}.weight": spec for name, spec in [
            ("self_attn.q_proj", ("data", "model")), ("self_attn.k_proj", ("data", "model")),
            ("self_attn.v_proj", ("data", "model")), ("self_attn.o_proj", ("model", "data")),
            ("mlp.gate_proj", ("model", "data")), ("mlp.up_proj", ("model", "data")),
            ("mlp.down_proj", ("data", "model")), ("input_layernorm", (None,)),
            ("post_attention_layernorm", (None,))]})
    return specs


def test_param_specs_are_table_1(reference):
    mesh = make_mesh((2, 4))  # not square: a spec with 'data' and 'model' swapped splits differently
    model = copy.deepcopy(reference[1]["gqa"][0])
    want = table_1_specs(CONFIGS["gqa"].num_hidden_layers)
    assert {n: param_spec(n, p.shape, mesh) for n, p in model.named_parameters()} == want
    shard_params(model, mesh)
    sizes = {"data": 2, "model": 4, None: 1}
    for name, p in model.named_parameters():
        shard = tuple(n // sizes[axis] for n, axis in zip(p.shape, want[name]))
        assert shard_shape(p) == shard, name
        assert {tuple(s.data.shape) for s in wrap_as_sharded_tensor(p).local_shards} == {shard}, name


@pytest.mark.parametrize("config", ["mha", "gqa"])
@pytest.mark.parametrize("mode", ["params", "params+activations", "params+activations+inputs"])
@pytest.mark.parametrize("shape", MESHES)
def test_sharded_forward_equals_unsharded(reference, shape, mode, config):
    ids, models = reference
    model, want = models[config]
    got = sharded_logits(model, ids, make_mesh(shape), "activations" in mode, "inputs" in mode)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("shape", [(8, 1), (2, 4)])
def test_fsdp_forward_equals_unsharded(reference, shape):
    ids, models = reference
    model, want = models["gqa"]
    got = sharded_logits(model, ids, make_mesh(shape), activations=False, inputs=True, strategy="fsdp")
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_compiled_forward_keeps_activation_annotations(reference):
    ids, models = reference
    model, want = models["gqa"]
    seen = []

    def recording_openxla(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return torch._dynamo.backends.registry.lookup_backend("openxla")(gm, example_inputs)

    mesh = make_mesh((4, 2))
    m = copy.deepcopy(model)
    shard_params(m, mesh)
    shard_activations(m, mesh)
    x = ids.to(torch_xla.device())
    xs.mark_sharding(x, mesh, INPUT_SPEC)
    with torch.no_grad():
        got = torch.compile(m, backend=recording_openxla)(x).logits.cpu()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    # per layer: q, k, v, attn_weights, o, gate, up, down; plus inputs_embeds and logits
    expected = 8 * CONFIGS["gqa"].num_hidden_layers + 2
    assert sum("llama_xla.mark_sharding" in t for t in seen) == expected


@pytest.mark.parametrize("shape", MESHES)
@pytest.mark.parametrize("strategy", ["2d", "fsdp"])
def test_shard_shapes_match_spec_and_device_shards(reference, shape, strategy):
    _, models = reference
    mesh = make_mesh(shape)
    model = copy.deepcopy(models["gqa"][0])
    rows = shard_params(model, mesh, strategy)
    params = dict(model.named_parameters())
    sizes = dict(mesh.shape())
    assert [r["name"] for r in rows] == list(params)
    table_1 = table_1_specs(CONFIGS["gqa"].num_hidden_layers)
    for r in rows:
        if strategy == "2d":
            assert r["spec"] == table_1[r["name"]]
        else:  # largest dim split over every device
            big = max(range(len(r["shape"])), key=lambda d: r["shape"][d])
            assert r["spec"][big] == ("data", "model") and sum(a is not None for a in r["spec"]) == 1
        split = [1 if a is None else math.prod(sizes[x] for x in (a if isinstance(a, tuple) else (a,)))
                 for a in r["spec"]]
        assert r["shard"] == tuple(s // k for s, k in zip(r["shape"], split))
        assert r["bytes_per_device"] == math.prod(r["shard"]) * 4
        held = {tuple(s.data.shape) for s in wrap_as_sharded_tensor(params[r["name"]]).local_shards}
        assert held == {r["shard"]}


@pytest.mark.parametrize("prefetch", [0, 2])
def test_loader_batches_carry_input_sharding(prefetch):
    mesh = make_mesh((4, 2))
    ids = torch.arange(20 * 16).reshape(20, 16) % 264
    batches = list(sharded_loader(TensorDataset(ids), batch_size=8, mesh=mesh, prefetch=prefetch))
    assert len(batches) == 2  # 20 rows in batches of 8: the last 4 are dropped (drop_last)
    reference = torch.zeros(8, 16, dtype=torch.long, device=torch_xla.device())
    xs.mark_sharding(reference, mesh, INPUT_SPEC)
    expected = torch_xla._XLAC._get_xla_sharding_spec(reference)
    assert expected.startswith("{devices=[4,1,2]")
    for (batch,) in batches:
        assert torch_xla._XLAC._get_xla_sharding_spec(batch) == expected
    torch.testing.assert_close(batches[1][0].cpu(), ids[8:16])
    assert input_sharding(mesh).partition_spec == INPUT_SPEC


@pytest.mark.devices
def test_two_models_on_two_meshes_keep_their_own_sharding(reference):
    """Each model's attention function stays bound to its own mesh (HF keeps them by name)."""
    if N < 4 or N % 2:
        pytest.skip(f"two distinct (data, model) meshes with a 'model' axis need an even count >= 4, not {N}")
    ids, models = reference
    model, want = models["mha"]
    meshes = [make_mesh((N // 2, 2)), make_mesh((2, N // 2) if N > 4 else (N, 1))]
    sharded = []
    for mesh in meshes:  # both models alive at once, the second sharded last
        m = copy.deepcopy(model)
        shard_params(m, mesh)
        shard_activations(m, mesh)
        sharded.append(m)
    weights = []  # the first model's attention weights, as annotated inside its attention function
    sharded[0].model.layers[0].self_attn.register_forward_hook(lambda mod, args, out: weights.append(out[1]))
    with fp32_matmuls(), torch.no_grad():
        for m, mesh in zip(sharded, meshes):
            x = ids.to(torch_xla.device())
            xs.mark_sharding(x, mesh, INPUT_SPEC)
            torch.testing.assert_close(m(x).logits.cpu(), want, atol=1e-4, rtol=0)
    [w] = weights  # (bsz, num_heads, seqlen, seqlen)
    spec = ("data", "model", None, None)
    own, other = (sharding_of(w, mesh, spec) for mesh in meshes)
    assert own != other
    assert torch_xla._XLAC._get_xla_sharding_spec(w) == own


@pytest.mark.devices
def test_constraint_builds_its_sharding_once(monkeypatch):
    """torch_xla's xla::aot_mark_sharding parses its mesh string into a new Mesh and OpSharding on
    every call (~0.5 ms of host time each, in a cache that only grows); a Constraint builds them
    when it is made, and a call looks them up."""
    mesh = make_mesh((N, 1))
    spec = ("data", None)
    c = Constraint("test", mesh, spec)
    x = torch.randn(2 * N, 8, device=torch_xla.device(), requires_grad=True)
    want = sharding_of(x, mesh, spec)
    built = []
    init = xs.Mesh.__init__
    monkeypatch.setattr(xs.Mesh, "__init__", lambda self, *args, **kw: built.append(init(self, *args, **kw)))
    before = xs.Mesh.get_op_sharding.cache_info()
    for _ in range(20):
        z = x * 2
        grads = []
        z.register_hook(grads.append)
        y = c(z)
        y.sum().backward()
    after = xs.Mesh.get_op_sharding.cache_info()
    assert built == []  # no Mesh made per call
    assert (after.hits + after.misses, after.currsize) == (before.hits + before.misses, before.currsize)
    assert torch_xla._XLAC._get_xla_sharding_spec(y) == want        # the forward annotation
    assert torch_xla._XLAC._get_xla_sharding_spec(grads[0]) == want  # and its gradient's


def wait_for(condition, seconds=30):
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def test_prefetched_reads_a_bounded_number_ahead_in_order_and_stops_when_closed():
    read = []

    def items(n):
        for i in range(n):
            read.append(i)
            yield i
    it = prefetched(items(10), 2)
    assert next(it) == 0
    assert wait_for(lambda: len(read) == 4)  # the one taken, two in the queue, one waiting to go in
    time.sleep(0.2)
    assert read == [0, 1, 2, 3] and list(it) == list(range(1, 10))
    it = prefetched(items(1000), 2)
    next(it)
    it.close()  # the consumer is gone: the thread stops
    time.sleep(0.5)
    assert len(read) - 10 <= 4


def test_a_read_error_in_the_loader_thread_raises_in_the_loop_naming_the_file_and_rows(tmp_path):
    path = tmp_path / "tokens.u32"
    (np.arange(40 * 16) % 264).astype(np.uint32).tofile(path)
    rows = TokenRows(f"file://{path}", 16)  # a URL: read by byte ranges, as from gs://
    cat_ranges = rows._fs.cat_ranges

    def flaky(paths, starts, *args, **kwargs):
        if starts[0] >= 16 * 16 * 4:  # from row 16 on: the store answers with an error
            raise OSError("503 Service Unavailable")
        return cat_ranges(paths, starts, *args, **kwargs)
    rows._fs.cat_ranges = flaky
    batches = sharded_loader(TensorDataset(rows), batch_size=8, mesh=make_mesh((4, 2)), prefetch=2)
    first, second = next(batches), next(batches)
    torch.testing.assert_close(second[0].cpu(), torch.arange(8 * 16, 16 * 16).view(8, 16) % 264)
    with pytest.raises(OSError, match=rf"reading rows \[16 .* of file://{path}: 503 Service Unavailable"):
        next(batches)


@pytest.mark.devices
@pytest.mark.parametrize("strategy", ["2d", "fsdp"])
def test_multi_slice_mesh_splits_only_the_batch_across_slices(reference, strategy):
    """On a ('dcn', 'data', 'model') mesh of 2 slices every weight is whole in each slice (replicated
    over 'dcn', sharded inside the slice) and the batch is split over 'data' x 'dcn'."""
    if N % 2:
        pytest.skip(f"two slices need an even device count, not {N}")
    ids, models = reference
    model, want = models["gqa"]
    tp = 2 if N % 4 == 0 else 1
    dp = N // 2 // tp
    mesh = make_mesh((1, dp, tp), ("dcn", "data", "model"), dcn_shape=(2, 1, 1))
    grid = mesh.get_logical_mesh()  # (2 slices, dp, tp) device ids
    m = copy.deepcopy(model)
    rows = shard_params(m, mesh, strategy)
    if strategy == "2d":
        shard_activations(m, mesh)
    embeds = []
    m.model.embed_tokens.register_forward_hook(lambda mod, args, out: embeds.append(out))
    [(x,)] = list(sharded_loader(TensorDataset(ids), batch_size=8, mesh=mesh))
    with fp32_matmuls(), torch.no_grad():
        torch.testing.assert_close(m(x).logits.cpu(), want, atol=1e-4, rtol=0)

    sizes = {"data": dp, "model": tp}
    params = dict(m.named_parameters())
    for r in rows:
        assert all("dcn" not in (a if isinstance(a, tuple) else (a,)) for a in r["spec"]), r
        blocks = {d: tuple((i.start, i.stop) for i in index) for d, index in device_blocks(params[r["name"]])}
        slice0 = [blocks[d] for d in grid[0].flatten()]
        assert slice0 == [blocks[d] for d in grid[1].flatten()], r["name"]  # the same blocks in both slices
        split = math.prod(1 if a is None else math.prod(sizes[k] for k in (a if isinstance(a, tuple) else (a,)))
                          for a in r["spec"])
        assert len(set(slice0)) == split, r["name"]  # and as many distinct blocks as the spec splits it in

    where = {int(d): k for k, d in np.ndenumerate(grid)}  # device id -> (slice, data, model) index
    per_device = 8 // (2 * dp)  # rows of the batch on each device
    for device, index in device_blocks(x):
        s, i, _ = where[device]
        start = (i * 2 + s) * per_device  # block i * 2 + s: 'data' major, 'dcn' minor
        assert index == (slice(start, start + per_device, 1), slice(0, ids.shape[1], 1)), device
    assert input_sharding(mesh).partition_spec == (("data", "dcn"), None)
    if strategy == "2d":  # activations too: batch over ('data', 'dcn')
        [e] = embeds
        assert torch_xla._XLAC._get_xla_sharding_spec(e) == sharding_of(e, mesh, (("data", "dcn"), None, "model"))
    with pytest.raises(ValueError, match=rf"batch_size {2 * dp + 1} is not divisible by the \('data', 'dcn'\) "
                                         rf"axis of size {2 * dp}"):
        sharded_loader(TensorDataset(ids), batch_size=2 * dp + 1, mesh=mesh)


@eight_devices
@pytest.mark.xfail(strict=True, raises=AssertionError, reason="XLA's SPMD partitioner (torch_xla 2.9) "
                   "miscompiles this; once it passes, batch_axes can put the slices outermost")
def test_xla_miscompiles_a_batch_on_dcn_then_data():
    """Why batch_axes is ('data', 'dcn'): with the batch on ('dcn', 'data') of a (2, 2, 2) mesh, two
    residual Linear layers with Table 1 weights compute wrong rows (those of devices 2 to 5).
    The multi-slice test above checks that ('data', 'dcn') computes the right ones."""
    mesh = make_mesh((1, 2, 2), ("dcn", "data", "model"), dcn_shape=(2, 1, 1))
    x, b, c = torch.randn(8, 16, 128), torch.randn(128, 128) / 10, torch.randn(128, 128) / 10

    def f(x, b, c):  # the einsum of shard_params' Linear layers
        y = x + torch.einsum("...n,mn->...m", x, b)
        return y + torch.einsum("...n,mn->...m", y, c)

    args = [t.to(torch_xla.device()) for t in (x, b, c)]
    for t, spec in zip(args, [(("dcn", "data"), None, None), ("model", "data"), ("data", "model")]):
        xs.mark_sharding(t, mesh, spec)
    torch.testing.assert_close(f(*args).cpu(), f(x, b, c), atol=1e-4, rtol=0)


# --- bad input: a clear ValueError before anything is sharded ---------------------------------

def test_heads_not_divisible_by_model_axis():
    model = hf_model(get_config("tiny", num_hidden_layers=1, hidden_size=96, num_attention_heads=6,
                                num_key_value_heads=6, intermediate_size=256))
    with pytest.raises(ValueError, match=r"num_attention_heads=6 is not divisible by mesh axis 'model' of size 4.*size 1 or 2"):
        shard_activations(model, make_mesh((2, 4)))


def test_param_dim_not_divisible_raises_before_sharding():
    model = hf_model(get_config("tiny", num_hidden_layers=1, intermediate_size=90))
    with pytest.raises(ValueError, match=r"gate_proj.weight: dim 0 of shape \(90, 128\).*'model' of size 4"):
        shard_params(model, make_mesh((2, 4)))
    assert all(p.device.type == "cpu" for p in model.parameters())  # nothing moved or sharded


def test_batch_not_divisible_by_data_axis(reference):
    ids, models = reference
    with pytest.raises(ValueError, match=r"embed_tokens output: dim 0 of shape \(6, 16, 128\).*'data' of size 4"):
        sharded_logits(models["gqa"][0], ids[:6], make_mesh((4, 2)), activations=True, inputs=False)
    with pytest.raises(ValueError, match="batch_size 6 is not divisible by the 'data' axis of size 4"):
        sharded_loader(TensorDataset(ids), batch_size=6, mesh=make_mesh((4, 2)))


def test_unknown_strategy_and_axis():
    model = hf_model(get_config("tiny", num_hidden_layers=1))
    with pytest.raises(ValueError, match="unknown strategy 'zero3'.*'2d', 'fsdp'"):
        shard_params(model, make_mesh((4, 2)), strategy="zero3")
    with pytest.raises(ValueError, match="mesh has no axis 'model'; its axes are \\('x', 'y'\\)"):
        shard_params(model, make_mesh((4, 2), axis_names=("x", "y")))
    with pytest.raises(ValueError, match="no axis 'data'"):
        input_sharding(make_mesh(axis_names=("fsdp",)))
