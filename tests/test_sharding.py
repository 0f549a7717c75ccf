import copy
import math

import pytest
import torch
import torch_xla
import torch_xla.distributed.spmd as xs
from torch.utils.data import TensorDataset
from torch_xla.distributed.spmd.xla_sharding import wrap_as_sharded_tensor

from llama_xla_helpers.configs import get_config
from llama_xla_helpers.hlo import collectives, compiled_hlo
from llama_xla_helpers.mesh import make_mesh
from llama_xla_helpers.sharding import (INPUT_SPEC, PARAM_SPECS, input_sharding, shard_activations,
                                        shard_params, sharded_loader)
from util import hf_model

MESHES = [(8, 1), (4, 2), (2, 4), (1, 8)]
# Tiny configs: 8 heads so every model axis up to 8 divides them; MHA and GQA.
CONFIGS = {"mha": get_config("tiny", num_hidden_layers=2, num_key_value_heads=8),
           "gqa": get_config("tiny", num_hidden_layers=2, num_key_value_heads=2)}
# Table 1 of the Llama 2 post, typed in again here so a change to PARAM_SPECS shows up.
TABLE_1 = {"embed_tokens": ("model", "data"), "q_proj": ("data", "model"), "k_proj": ("data", "model"),
           "v_proj": ("data", "model"), "o_proj": ("model", "data"), "gate_proj": ("model", "data"),
           "up_proj": ("model", "data"), "down_proj": ("data", "model"), "lm_head": ("model", "data")}


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


def test_param_specs_are_table_1():
    assert PARAM_SPECS == TABLE_1


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
    assert sum("aot_mark_sharding" in t for t in seen) == expected


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
    for r in rows:
        leaf = r["name"].rsplit(".", 2)[-2]
        if strategy == "2d":
            assert r["spec"] == TABLE_1.get(leaf, (None,) * len(r["shape"]))
        else:  # largest dim split over every device
            big = max(range(len(r["shape"])), key=lambda d: r["shape"][d])
            assert r["spec"][big] == ("data", "model") and sum(a is not None for a in r["spec"]) == 1
        split = [1 if a is None else math.prod(sizes[x] for x in (a if isinstance(a, tuple) else (a,)))
                 for a in r["spec"]]
        assert r["shard"] == tuple(s // k for s, k in zip(r["shape"], split))
        assert r["bytes_per_device"] == math.prod(r["shard"]) * 4
        held = {tuple(s.data.shape) for s in wrap_as_sharded_tensor(params[r["name"]]).local_shards}
        assert held == {r["shard"]}


def test_loader_batches_carry_input_sharding():
    mesh = make_mesh((4, 2))
    ids = torch.arange(20 * 16).reshape(20, 16) % 264
    batches = list(sharded_loader(TensorDataset(ids), batch_size=8, mesh=mesh))
    assert len(batches) == 2  # 20 rows in batches of 8: the last 4 are dropped (drop_last)
    reference = torch.zeros(8, 16, dtype=torch.long, device=torch_xla.device())
    xs.mark_sharding(reference, mesh, INPUT_SPEC)
    expected = torch_xla._XLAC._get_xla_sharding_spec(reference)
    assert expected.startswith("{devices=[4,1,2]")
    for (batch,) in batches:
        assert torch_xla._XLAC._get_xla_sharding_spec(batch) == expected
    torch.testing.assert_close(batches[1][0].cpu(), ids[8:16])
    assert input_sharding(mesh).partition_spec == INPUT_SPEC


def test_collectives_counted_from_compiled_hlo():
    mesh = make_mesh((4, 2))
    a = torch.randn(16, 32, device=torch_xla.device())
    b = torch.randn(32, 64, device=torch_xla.device())
    xs.mark_sharding(a, mesh, ("data", "model"))   # contraction dim split on 'model' ...
    xs.mark_sharding(b, mesh, ("model", None))     # ... so partial sums must be all-reduced
    with compiled_hlo() as modules:
        c = a @ b
        torch_xla.sync()
    counts, nbytes = collectives("".join(modules))
    assert counts == {"all-reduce": 1}
    assert nbytes == {"all-reduce": (16 // 4) * 64 * 4}  # one (4, 64) fp32 block per device
    torch.testing.assert_close(c.cpu(), a.cpu() @ b.cpu())


def test_collectives_parses_async_forms():
    text = ("%ag = (f32[2,8]{1,0}, f32[8,8]{1,0}) all-gather-start(f32[2,8]{1,0} %p), dimensions={0}\n"
            "%d = f32[8,8]{1,0} all-gather-done((f32[2,8]{1,0}, f32[8,8]{1,0}) %ag)\n"
            "%rs = bf16[4]{0} reduce-scatter(bf16[16]{0} %x), dimensions={0}\n")
    assert collectives(text) == ({"all-gather": 1, "reduce-scatter": 1}, {"all-gather": 256, "reduce-scatter": 8})


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
