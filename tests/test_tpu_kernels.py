"""The TPU's own kernels, proven on the CPU. torch_xla 2.9's Pallas kernels execute only on a TPU,
but JAX lowers them for one from here, and lowering runs the kernels' block, shape and layout
checks; Pallas's interpret mode executes the flash kernel here; and the serving step on the
kernel's path compiles with the kernel's op running a reference in its place.

- Lowering: every kernel call the package makes, with the arguments it builds, goes through
  torch_xla's own wrappers (their padding and block choices) with only `trace_pallas` switched
  to lower for the TPU (`lower_for_tpu`). The custom calls are built lazily and never executed.
- Interpret mode: `attention.flash_attention` (its padding, segment ids and GQA repeat) with
  JAX's kernel in torch_xla's place, run by the Pallas interpreter: values and gradients equal
  `blockwise_attention`'s.
- The compiled serving step on the kernel's path gives the flat path's tokens.
Needs JAX (the `scan` extra, which `make` installs)."""
import argparse
import functools
import itertools
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch_xla
import torch_xla.experimental.custom_kernel as ck
import torch_xla.experimental.pallas_kernels.ragged_paged_attention_v2 as rpa
from jax.experimental import pallas as pl
from jax.experimental.pallas.ops.tpu import flash_attention as jax_flash

from llama_xla_helpers import attention, doctor
from llama_xla_helpers.attention import (blockwise_attention, flash_length, flash_takes, hf_attention, ragged_attention,
                                         ragged_batch)
from llama_xla_helpers.configs import get_config
from llama_xla_helpers.kv_pages import page_size_for, pages_for
from llama_xla_helpers.mesh import make_mesh
from llama_xla_helpers.metrics import count_compiles, kernel_head_dim
from llama_xla_helpers.runner import ragged_layout
from llama_xla_helpers.train import build_model, forward_loss
from util import N, tp_size


def tpu_trace_pallas(kernel, *args, static_argnums=None, static_argnames=None, use_cache=False, **kwargs):
    """torch_xla's trace_pallas, lowering for the TPU instead of this machine's platform."""
    jax_args = [ck.to_jax_shape_dtype_struct(a) if torch.is_tensor(a) else a for a in args]
    traced = jax.jit(kernel, static_argnums=static_argnums, static_argnames=static_argnames).trace(*jax_args, **kwargs)
    payload = ck._extract_backend_config(traced.lower(lowering_platforms=("tpu",)).compiler_ir())
    return payload, [a for a in args if torch.is_tensor(a)]


@pytest.fixture
def lowered(monkeypatch):
    """The package's TPU paths, with torch_xla's kernels lowered for the TPU and built lazily: a
    kernel whose checks fail raises here, as it would at the first step on a TPU."""
    monkeypatch.setattr(ck, "trace_pallas", tpu_trace_pallas)
    monkeypatch.setattr(attention, "on_tpu", lambda: True)
    monkeypatch.setattr(attention, "kernels_execute", lambda: True)


def mesh_2d():
    model = 2 if N % 2 == 0 else 1
    return make_mesh((N // model, model))


# --- Flash attention in training ---------------------------------------------------------------

def test_the_flash_gate_admits_exactly_the_lengths_torch_xlas_blocks_divide():
    takes = [n for n in range(128, 8193, 128) if flash_takes(n)]
    assert takes == [128, 256, 512] + list(range(1024, 8193, 1024))
    assert not flash_takes(64) and not flash_takes(192)
    assert [flash_length(n) for n in (64, 128, 192, 384, 640, 768, 1024, 1536, 2560, 8000)] == \
        [128, 128, 256, 512, 1024, 1024, 1024, 2048, 3072, 8192]


LENGTHS = (128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 4096, 8192)
HEADS = {"gqa-128": (8, 2, 128), "mha-64": (4, 4, 64)}  # (query heads, KV heads, head_dim)


@pytest.mark.parametrize("seq_len", LENGTHS)
def test_flash_lowers_for_the_tpu_forward_and_backward(lowered, seq_len):
    """What hf_attention hands torch_xla's kernel at every length people train at (192, 384, 768
    and 1,536 padded up), packed and not, GQA and not, head_dim 64 and 128, fp32 and bf16, on Table
    2's partition spec: the forward and both backward kernels lower. (bc9b8b6 raised at 384, 768 and
    1,536, and packed at 768; at 192 it ran the blockwise loop instead, saying flash.)"""
    mesh, dev = mesh_2d(), torch_xla.device()
    bsz = mesh.shape()["data"]
    for (heads, kv_heads, head_dim), packed, dtype in itertools.product(
            HEADS.values(), (False, True), (torch.float32, torch.bfloat16)):
        q, k, v = (torch.zeros(bsz, h, seq_len, head_dim, dtype=dtype, device=dev, requires_grad=True)
                   for h in (heads, kv_heads, kv_heads))
        ids = torch.zeros(bsz, seq_len, dtype=torch.long, device=dev) if packed else None
        layer = torch.nn.Module()
        out, _ = hf_attention(layer, q, k, v, None, head_dim ** -0.5, implementation="flash", mesh=mesh,
                              segment_ids=ids)
        assert out.shape == (bsz, seq_len, heads, head_dim)
        out.float().sum().backward()
        assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape
        assert layer.attention_ran == attention.flash_path(seq_len)
    assert attention.flash_path(768) == "flash (768 padded to 1024)" and attention.flash_path(512) == "flash"


@pytest.mark.parametrize("seq_len,packed", [(192, False), (768, True)])
def test_a_llama_on_a_tpu_trains_through_the_kernel_and_says_so(lowered, seq_len, packed):
    """The model train() builds, through forward_loss and loss.backward(): every layer's kernel
    lowers, and attention.ran reports the padding (notebooks 03b and 09 train at 192)."""
    mesh = mesh_2d()
    model = build_model(get_config("tiny"), mesh, "2d", dtype=torch.float32, attention="flash")
    dev, bsz = torch_xla.device(), mesh.shape()["data"]
    ids = torch.zeros(bsz, seq_len, dtype=torch.long, device=dev)
    packed = dict(segment_ids=(torch.arange(seq_len, device=dev) // 100).expand(bsz, -1),
                  position_ids=(torch.arange(seq_len, device=dev) % 100).expand(bsz, -1)) if packed else {}
    forward_loss(model, ids, **packed).backward()
    assert attention.ran(model) == attention.flash_path(seq_len) != "flash"
    for p in model.parameters():
        p.grad = None


def test_one_mesh_per_mesh_string_so_torch_xlas_sharding_cache_stops_growing(lowered):
    """torch_xla's flash wrapper parses its mesh from a string on every call; with one Mesh per
    string its per-Mesh sharding cache gets no new entries from the second call on."""
    from torch_xla.distributed.spmd import Mesh
    mesh, dev = mesh_2d(), torch_xla.device()
    assert Mesh.from_str(str(mesh)) is Mesh.from_str(str(mesh))

    def call():
        q = torch.zeros(mesh.shape()["data"], 4, 128, 64, device=dev, requires_grad=True)
        hf_attention(None, q, q, q, None, 0.125, implementation="flash", mesh=mesh)[0].sum().backward()

    call()
    before = Mesh.get_op_sharding.cache_info().currsize
    call()
    assert Mesh.get_op_sharding.cache_info().currsize == before


def jax_flash_blocks(seq_len):
    """torch_xla's block sizes for rows of seq_len, as JAX's BlockSizes (what its wrapper passes)."""
    cut = {k: min(b, seq_len) for k, b in ck.FlashAttention.DEFAULT_BLOCK_SIZES.items() if k != "block_b"}
    return jax_flash.BlockSizes(block_b=1, **cut)


class InterpretedFlash(torch.autograd.Function):
    """JAX's TPU flash kernel, executed by the Pallas interpreter on the CPU, with torch_xla's blocks."""

    @staticmethod
    def forward(ctx, q, k, v, segment_ids, scale):
        ids = None if segment_ids is None else jnp.asarray(segment_ids.numpy())

        def f(q, k, v):
            return jax_flash.flash_attention(q, k, v, segment_ids=None if ids is None else jax_flash.SegmentIds(ids, ids),
                                             causal=True, sm_scale=scale, block_sizes=jax_flash_blocks(q.shape[2]))
        out, ctx.vjp = jax.vjp(f, *(jnp.asarray(t.detach().numpy()) for t in (q, k, v)))
        return torch.from_numpy(np.array(out))

    @staticmethod
    def backward(ctx, dout):
        return (*(torch.from_numpy(np.array(g)) for g in ctx.vjp(jnp.asarray(dout.numpy()))), None, None)


@pytest.fixture
def interpreted(monkeypatch):
    """torch_xla's flash kernel replaced by JAX's, interpreted (pallas_call(..., interpret=True))."""
    def kernel(q, k, v, causal, q_segment_ids, kv_segment_ids, sm_scale, partition_spec, mesh):
        assert causal and q_segment_ids is kv_segment_ids and partition_spec is None and mesh is None
        return InterpretedFlash.apply(q, k, v, q_segment_ids, sm_scale)

    monkeypatch.setattr(ck, "flash_attention", kernel)
    monkeypatch.setattr(pl, "pallas_call", functools.partial(pl.pallas_call, interpret=True))
    monkeypatch.setattr(attention, "on_tpu", lambda: True)


@pytest.mark.parametrize("seq_len,packed", [(256, False), (192, True)])
def test_flash_interpreted_equals_blockwise_values_and_gradients(interpreted, seq_len, packed):
    """The kernel's own arithmetic, with the package's padding (192 runs at 256), segment ids and
    GQA: the output and the gradients of q, k and v equal the blockwise loop's."""
    g = torch.Generator().manual_seed(seq_len)
    q, k, v = (torch.randn(2, h, seq_len, 128, generator=g, requires_grad=True) for h in (4, 2, 2))
    ids = (torch.arange(seq_len) * 3 // seq_len).expand(2, -1) if packed else None  # three documents a row
    scale, dout = 128 ** -0.5, torch.randn(2, seq_len, 4, 128, generator=g)
    out, _ = hf_attention(None, q, k, v, None, scale, implementation="flash", segment_ids=ids)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    want = blockwise_attention(q.transpose(1, 2).unflatten(2, (2, 2)), k.transpose(1, 2), v.transpose(1, 2),
                               scale=scale, segment_ids=ids, block=128).flatten(2, 3)
    for got, expected in zip((out, *grads), (want, *torch.autograd.grad(want, (q, k, v), dout))):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


# --- Ragged paged attention in serving ------------------------------------------------------------

GENERATIONS = {"v4": (4, "TPU v4"), "v5e": (5, "TPU v5"), "v5p": (5, "TPU v5p"), "v6e": (6, "TPU v6")}
# (query heads, KV heads, head_dim, dtype) per device: Llama 3 8B, Llama 3.2 1B (head_dim 64), tiny
SERVED = {"llama3-8b": (32, 8, 128, torch.bfloat16), "llama3.2-1b": (32, 8, 64, torch.bfloat16),
          "tiny": (8, 4, 16, torch.float32)}


MAX_LENS = (256, 512, 1024, 2048, 8192, 131072)  # every page size page_size_for gives (test_kv_pages)


@pytest.mark.parametrize("generation", GENERATIONS)
def test_the_ragged_kernel_lowers_for_each_generation_model_and_page_size(lowered, monkeypatch, generation):
    """The serving step's call (`ragged_attention` with `ragged_layout`'s arguments and the pages
    the runner allocates, head_dim padded to 128) lowers for the TPU for the page sizes
    `page_size_for` gives up to 131,072 tokens (16, 32, 64, 128, 256, and 16 again past 8,192): a
    decode step and a mixed prefill step. (bc9b8b6 sent head_dim 64 to the gather path; the
    kernel's own check rejects it unpadded.)"""
    version, name = GENERATIONS[generation]
    monkeypatch.setattr(rpa, "get_tpu_version", lambda: version)
    monkeypatch.setattr(rpa, "get_device_name", lambda num_devices=None: name)
    jax.clear_caches()  # the kernel is a jax.jit: its block sizes, chosen per generation, would come from the cache
    dev = torch_xla.device()
    for (heads, kv_heads, head_dim, dtype), max_len in itertools.product(SERVED.values(), MAX_LENS):
        ps = page_size_for(max_len)
        pages = torch.zeros(64, ps, 2 * kv_heads, kernel_head_dim(head_dim), dtype=dtype, device=dev)
        for tokens, runs in ((4, [(5, 1), (ps + 1, 1)]), (64, [(0, 40), (3, 1)])):  # (start, n): decode; mixed
            tables = [list(range(1 + 8 * i, 1 + 8 * i + pages_for(start + n, ps))) for i, (start, n) in enumerate(runs)]
            layout = ragged_layout([(t, *r) for t, r in zip(tables, runs)], ps, tokens, 4, pages_for(max_len, ps))
            q = torch.zeros(tokens, heads, head_dim, dtype=dtype, device=dev)
            out = ragged_attention(q, pages, ragged_batch(layout, lambda t: t.to(dev)), head_dim ** -0.5)
            assert out.shape == q.shape


def test_the_ragged_kernel_lowers_on_a_tensor_parallel_mesh(lowered, monkeypatch):
    """On a 'model' axis each device's call takes its own heads (the manual-sharding region)."""
    monkeypatch.setattr(rpa, "get_tpu_version", lambda: 6)
    monkeypatch.setattr(rpa, "get_device_name", lambda num_devices=None: "TPU v6")
    ways = tp_size(8)
    mesh, dev = make_mesh((N // ways, ways)), torch_xla.device()
    pages = torch.zeros(32, 128, 2 * 8, 128, dtype=torch.bfloat16, device=dev)
    layout = ragged_layout([([1, 2], 100, 40)], 128, 64, 4, 16)
    q = torch.zeros(64, 32, 128, dtype=torch.bfloat16, device=dev)
    assert ragged_attention(q, pages, ragged_batch(layout, lambda t: t.to(dev)), 128 ** -0.5, mesh).shape == q.shape


def test_a_lazy_step_asks_torch_xla_to_keep_the_ragged_kernels_lowering(lowered, monkeypatch):
    """torch_xla's ragged wrapper lowers the kernel with JAX at every call unless trace_pallas is told
    use_cache (its flash wrapper does); the package's op tells it, and puts trace_pallas back."""
    asked = []

    def trace(*args, use_cache=False, **kwargs):
        asked.append(use_cache)
        return tpu_trace_pallas(*args, **kwargs)

    monkeypatch.setattr(ck, "trace_pallas", trace)
    monkeypatch.setattr(rpa, "get_tpu_version", lambda: 6)
    dev = torch_xla.device()
    pages = torch.zeros(8, 16, 8, 128, device=dev)
    layout = ragged_layout([([1], 3, 1)], 16, 4, 4, 2)
    for _ in range(2):
        ragged_attention(torch.zeros(4, 8, 128, device=dev), pages, ragged_batch(layout, lambda t: t.to(dev)), 0.1)
    assert asked == [True, True] and ck.trace_pallas is trace


@pytest.mark.parametrize("mesh_shape", [None, (N // tp_size(4), tp_size(4))], ids=["unsharded", "tensor-parallel"])
def test_the_compiled_step_on_the_kernels_path_gives_the_flat_paths_tokens(monkeypatch, mesh_shape):
    """On a faked TPU the runner takes the kernel's path: pages padded to head_dim 128, the kernel's
    op (`attention.paged_kernel`, its reference inside here) in a step compiled with
    torch.compile(fullgraph=True), on each device's heads on a tensor-parallel mesh. Its tokens are
    the flat path's (Generator's alone), and nothing compiles after warm-up."""
    from test_engine import engine, expected, prompts, run
    want = expected()[:5]  # Generator's, on the CPU's paths
    monkeypatch.setattr(attention, "on_tpu", lambda: True)
    eng = engine(mesh_shape, compile=True, slots=4 if mesh_shape is None else max(4, mesh_shape[0]))
    assert eng.runner.kernel and eng.runner.pages[0].shape[-1] == 128
    compiles = count_compiles()
    reqs = run(eng, [eng.submit(p, 10 + i) for i, p in enumerate(prompts()[:5])])
    assert [r.tokens for r in reqs] == list(want)
    assert count_compiles() == compiles


# --- The doctor on a TPU -------------------------------------------------------------------------

def test_the_doctor_on_a_tpu_needs_jax_and_runs_both_kernels(monkeypatch):
    """On a (faked) TPU the doctor's kernel check fails without JAX, naming it; with it, it runs flash
    forward and backward at --seq-len against the blockwise loop (torch's SDPA in the kernel's place
    here) and a compiled engine step on the ragged kernel's path (its reference here), its tokens
    checked teacher-forced (a TPU's bf16 programs round differently), and says which path each ran."""
    args = argparse.Namespace(seq_len=192, dtype=None)
    assert doctor.check_kernels(args).startswith("training at seq_len 192 attends blockwise, serving with the flat")
    monkeypatch.setattr(attention, "on_tpu", lambda: True)
    with monkeypatch.context() as m:
        m.setitem(sys.modules, "jax", None)
        with pytest.raises(doctor.CheckFailed, match="JAX is not installed"):
            doctor.check_kernels(args)

    def kernel(q, k, v, causal, q_segment_ids, kv_segment_ids, sm_scale, partition_spec, mesh):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=sm_scale)

    monkeypatch.setattr(ck, "flash_attention", kernel)
    assert doctor.check_kernels(args) == ("training at seq_len 192: flash (192 padded to 256); serving: the ragged "
                                          "paged attention kernel (compiled step, head_dim 16 padded to 128) gives "
                                          "the model's greedy tokens")
