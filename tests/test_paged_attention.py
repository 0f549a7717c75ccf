"""Ragged attention over a paged KV cache: the step's layout, the page writes in both layouts, the
flat path against torch_xla's reference for its TPU kernel, and the kernel's call on a faked TPU."""
import math
import random

import pytest
import torch
import torch_xla
from torch_xla.experimental.custom_kernel import ragged_paged_attention

from llama_xla_helpers import attention
from llama_xla_helpers.attention import (NO_KEY, RaggedBatch, flat_attention, kernel_fits, paged_reference, ragged_attention,
                                         ragged_batch, write_heads, write_pages)
from llama_xla_helpers.kv_pages import pages_for
from llama_xla_helpers.mesh import make_mesh
from llama_xla_helpers.runner import pages_read, ragged_layout

pytestmark = pytest.mark.fixed_dtype  # no test here reads the default dtype (conftest checks)


def random_step(seed, heads=4, kv_heads=2, head_dim=8, page_size=4, num_pages=40, seqs=5, tokens=32,
                dtype=torch.float32):
    """A random ragged step: up to `seqs` sequences, each with keys already in its pages and new
    tokens (a decode, or a prompt chunk) on a flat axis of `tokens`; some start with the first
    sequence's first pages (a cached prefix). Returns q, the pages in the kernel's layout, the
    step's layout for the kernel and for the flat path (host tensors), and the runs."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    free = list(range(1, num_pages))
    rng.shuffle(free)
    runs, left = [], tokens
    for _ in range(rng.randint(1, seqs)):
        n = min(left, rng.choice([1, 1, rng.randint(1, 20)]))
        if n == 0:
            break
        start = rng.randint(0, 24)
        table = [free.pop() for _ in range(pages_for(start + n, page_size))]
        if runs and rng.random() < 0.5:  # a prefix the first sequence holds, before this one's new positions
            shared = min(len(runs[0][0]), start // page_size)
            table[:shared] = runs[0][0][:shared]
        runs.append((table, start, n))
        left -= n
    p = max(len(table) for table, _, _ in runs)
    kernel = ragged_batch(ragged_layout(runs, page_size, tokens, seqs, p))
    flat = ragged_batch(ragged_layout(runs, page_size, tokens, seqs, p, keys=sum(len(t) for t, _, _ in runs) + 3))
    q = torch.randn(tokens, heads, head_dim, dtype=dtype)
    pages = torch.randn(num_pages, page_size, 2 * kv_heads, head_dim, dtype=dtype)
    return q, pages, kernel, flat, runs


def heads_first(pages):
    """The kernel's pages (num_pages, page_size, 2g, head_dim; K of head h at 2h) as the flat path's
    pool (2, g, num_pages, page_size, head_dim): the same keys and values."""
    return pages.unflatten(2, (-1, 2)).permute(3, 2, 0, 1, 4).contiguous()


def to(batch, dev):
    return RaggedBatch(*(None if t is None else t.to(dev) for t in batch))


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("tokens", [4, 32])  # a decode step; a step with prompt chunks
def test_the_flat_path_equals_the_kernels_reference(seed, tokens):
    q, pages, kernel, flat, runs = random_step(seed, tokens=tokens)
    used = int(kernel.cu_q_lens[-1])
    scale = 1 / math.sqrt(q.shape[-1])
    pool = heads_first(pages)
    ours = flat_attention(q, pool, flat, scale)
    # the whole pool as the key axis, read in place (no gather): the same outputs
    whole = ragged_batch(ragged_layout(runs, 4, tokens, 5, kernel.page_indices.shape[1], keys=pages.shape[0],
                                       pool=pages.shape[0]))
    assert whole.key_pages.tolist() == list(range(pages.shape[0]))
    torch.testing.assert_close(flat_attention(q, pool, whole, scale), ours, rtol=1e-5, atol=1e-5)
    ref = ragged_paged_attention(q, pages, kernel.kv_lens, kernel.page_indices, kernel.cu_q_lens, kernel.num_seqs,
                                 sm_scale=scale, use_kernel=False)  # torch_xla's PyTorch reference (needs JAX)
    assert ours.shape == q.shape and ref.shape[0] == used
    torch.testing.assert_close(ours[:used], ref, rtol=1e-5, atol=1e-5)
    # what runs in the kernel's place off a TPU, from the kernel's own arguments
    torch.testing.assert_close(paged_reference(q, pages, *kernel[:4], scale)[:used], ref, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(ours).all()  # padding tokens keep no key, yet stay finite: nothing NaN reaches a page


@pytest.mark.parametrize("seed", range(8))  # 2: chunks only, 6: decodes only, the others both
def test_a_step_split_in_two_equals_one_group(seed):
    """With `decode` set, flat_attention runs every query over the prompt chunks' pages only, then the
    one-token runs' queries over all the step's pages, written over their rows: the same outputs as
    one group over every page, and finite everywhere (the decode queries keep no chunk key)."""
    q, pages, kernel, flat, runs = random_step(seed, tokens=32)
    every, chunks = pages_read(runs, 4)
    split = ragged_batch(ragged_layout(runs, 4, 32, 5, kernel.page_indices.shape[1], keys=len(every) + 3,
                                       chunk=len(chunks) + 2))
    used, scale, pool = int(kernel.cu_q_lens[-1]), 1 / math.sqrt(q.shape[-1]), heads_first(pages)
    ours = flat_attention(q, pool, split, scale)
    torch.testing.assert_close(ours[:used], flat_attention(q, pool, flat, scale)[:used], rtol=1e-5, atol=1e-5)
    assert torch.isfinite(ours).all()


def test_the_flat_path_on_the_xla_device_and_in_bf16():
    q, pages, kernel, flat, runs = random_step(7, tokens=32)
    used, scale, pool = int(kernel.cu_q_lens[-1]), 1 / math.sqrt(q.shape[-1]), heads_first(pages)
    want = flat_attention(q, pool, flat, scale)[:used]
    dev = torch_xla.device()
    on_xla = flat_attention(q.to(dev), pool.to(dev), to(flat, dev), scale)
    torch.testing.assert_close(on_xla.cpu()[:used], want, rtol=1e-5, atol=1e-5)
    bf16 = flat_attention(q.bfloat16(), pool.bfloat16(), flat, scale)[:used]
    torch.testing.assert_close(bf16.float(), want, rtol=0.05, atol=0.05)


def test_the_layout_puts_each_token_in_its_sequences_pages():
    runs = [([3, 9], 5, 1), ([4, 2, 7], 0, 11)]  # a decode at position 5; a prompt chunk of 11
    out = ragged_layout(runs, page_size=4, tokens=16, seqs=3, pages=3)
    assert out["kv_lens"] == [6, 11, 0] and out["cu_q_lens"] == [0, 1, 12, 12] and out["num_seqs"] == [2]
    assert out["page_indices"] == [[3, 9, 0], [4, 2, 7], [0, 0, 0]] and "key_pages" not in out
    assert out["positions"][:12] == [5] + list(range(11))
    assert out["slots"][:3] == [9 * 4 + 1, 4 * 4 + 0, 4 * 4 + 1] and out["slots"][11] == 7 * 4 + 2
    assert out["slots"][12:] == [0] * 4  # padding tokens write page 0, which no request holds
    assert out["token_seq"] == [0] + [1] * 11 + [0] * 4
    # the flat path: the step's pages, each once, with the position of its first key
    flat = ragged_layout(runs, page_size=4, tokens=16, seqs=3, pages=3, keys=8)
    assert flat["key_pages"] == [3, 9, 4, 2, 7, 0, 0, 0] and flat["key_start"] == [0, 4, 0, 4, 8] + [NO_KEY] * 3
    shared = ragged_layout([([3, 9], 5, 1), ([3, 6], 4, 2)], 4, 16, 3, 2, keys=4)  # page 3: a prefix both hold
    assert shared["key_pages"] == [3, 9, 6, 0] and shared["key_start"] == [0, 4, 4, NO_KEY]
    # K = the pool's 10 pages: all of them in order, each at its first key's position, NO_KEY if none reads it
    whole = ragged_layout(runs, page_size=4, tokens=16, seqs=3, pages=3, keys=10, pool=10)
    assert whole["key_pages"] == list(range(10))
    assert whole["key_start"] == [NO_KEY, NO_KEY, 4, 0, 0, NO_KEY, NO_KEY, 8, NO_KEY, 4]
    with pytest.raises(ValueError, match="17 tokens of 2 sequences do not fit a step of 16 tokens"):
        ragged_layout([([1, 2], 0, 8), ([3, 4, 5], 0, 9)], 4, 16, 3, 3)
    with pytest.raises(ValueError, match="do not fit a step of 16 tokens, 3 sequences, 4 pages"):
        ragged_layout(runs, 4, 16, 3, 3, keys=4)
    # split in two: the one-token runs' queries (padded to the sequences), the chunks' pages
    split = ragged_layout(runs, page_size=4, tokens=16, seqs=3, pages=3, keys=8, chunk=4)
    assert split["decode"] == [0, 0, 0] and split["chunk_pages"] == [4, 2, 7, 0]
    assert split["chunk_start"] == [0, 4, 8, NO_KEY] and split["key_pages"] == flat["key_pages"]
    with pytest.raises(ValueError, match="and 2 pages of prompt chunks"):
        ragged_layout(runs, 4, 16, 3, 3, keys=8, chunk=2)


def test_keys_and_values_are_written_interleaved_on_the_head_axis():
    pages = torch.zeros(3, 4, 4, 2)  # 3 pages of 4 positions, 2 KV heads of head_dim 2
    batch = ragged_batch(ragged_layout([([2], 1, 2)], 4, 2, 1, 1))
    k, v = torch.arange(8.).view(2, 2, 2) + 1, -torch.arange(8.).view(2, 2, 2) - 1  # (T=2, g=2, head_dim=2)
    out = write_pages(pages, batch, k, v)  # positions 1 and 2 of the sequence: rows 1 and 2 of page 2
    assert torch.equal(out[2, 1, 0::2], k[0]) and torch.equal(out[2, 1, 1::2], v[0])  # K of head h at 2h, V at 2h + 1
    assert torch.equal(out[2, 2, 0::2], k[1]) and torch.equal(out[2, 2, 1::2], v[1])
    assert out[:2].abs().sum() == 0 and out[2, 0].abs().sum() == 0 and out[2, 3].abs().sum() == 0
    # the flat path's pool, K and V apart, each heads first: the same keys and values at the same places
    pool = write_heads(heads_first(pages), batch, k, v)
    assert torch.equal(pool, heads_first(out)) and torch.equal(pool[0, 1, 2, 1], k[0, 1])
    assert torch.equal(pool[1, 0, 2, 2], v[1, 0])


def test_the_kernels_constraints():
    assert kernel_fits(8, torch.bfloat16) and kernel_fits(1, torch.bfloat16)  # Llama 3 8B; 8 KV heads over 8 chips
    assert kernel_fits(2, torch.float32) and not kernel_fits(3, torch.float32)


@pytest.fixture
def fake_tpu(monkeypatch):
    """attention's TPU paths, and torch_xla's kernel replaced by a recorder returning the reference's
    shape (the kernel itself runs only on a TPU; tests/test_tpu_kernels.py lowers it for one)."""
    import torch_xla.experimental.custom_kernel as ck
    calls = []

    def kernel(q, pages, *meta, **kwargs):
        calls.append((q, pages, meta, kwargs))
        return torch.zeros_like(q)

    monkeypatch.setattr(attention, "on_tpu", lambda: True)
    monkeypatch.setattr(attention, "kernels_execute", lambda: True)
    monkeypatch.setattr(ck, "ragged_paged_attention", kernel)
    return calls


def test_on_a_tpu_the_kernel_gets_the_layout_and_head_dim_64_is_padded_to_128(fake_tpu):
    q, pages, batch, _, _ = random_step(3, heads=8, kv_heads=2, head_dim=128, tokens=8)
    dev = torch_xla.device()
    q, pages, batch = q.to(dev), pages.to(dev), to(batch, dev)
    out = ragged_attention(q, pages, batch, 0.125)
    (kq, kpages, meta, kwargs), = fake_tpu
    assert kq.shape == q.shape and kpages.shape == pages.shape and kwargs == {"sm_scale": 0.125}
    assert all(torch.equal(m.cpu(), t.cpu()) for m, t in zip(meta, batch[:4]))  # the layout as built
    assert all(m.dtype == torch.int32 for m in meta)  # the kernel's JAX side takes int32
    used = int(batch.cu_q_lens[-1].cpu())
    assert out.shape == q.shape and out.cpu()[used:].abs().sum() == 0
    fake_tpu.clear()
    out = ragged_attention(q[:, :, :64].contiguous(), pages, batch, 0.125)  # head_dim 64, pages at the kernel's 128
    (kq, kpages, _, kwargs), = fake_tpu
    assert kq.shape == (8, 8, 128) and kq[..., 64:].cpu().abs().sum() == 0 and kwargs == {"sm_scale": 0.125}
    assert out.shape == (8, 8, 64)


def test_off_a_tpu_the_kernels_path_runs_the_reference_in_its_place_with_head_dim_padded(monkeypatch):
    """The kernel's path (its op, padding and zeroed padding tokens) with `paged_reference` inside,
    as a compiled step on a faked TPU runs it: the flat path's result, at head_dim 16 in pages
    padded to 128."""
    q, pages, batch, flat, _ = random_step(4, heads=8, kv_heads=2, head_dim=16, tokens=32)
    want = flat_attention(q, heads_first(pages), flat, 0.25)
    used = int(batch.cu_q_lens[-1])
    monkeypatch.setattr(attention, "on_tpu", lambda: True)
    dev = torch_xla.device()
    padded = torch.nn.functional.pad(pages, (0, 112)).to(dev)
    out = ragged_attention(q.to(dev), padded, to(batch, dev), 0.25).cpu()
    torch.testing.assert_close(out[:used], want[:used], rtol=1e-5, atol=1e-5)
    assert out[used:].abs().sum() == 0


@pytest.mark.devices
def test_on_a_tensor_parallel_tpu_mesh_each_device_runs_the_kernel_on_its_heads(fake_tpu):
    mesh = make_mesh((1, torch_xla.runtime.global_runtime_device_count()))
    ways = mesh.shape()["model"]
    q, pages, batch, _, _ = random_step(4, heads=4 * ways, kv_heads=2 * ways, head_dim=128, tokens=8)
    dev = torch_xla.device()
    q, pages, batch = q.to(dev), pages.to(dev), to(batch, dev)
    out = ragged_attention(q, pages, batch, 0.125, mesh)
    (kq, kpages, meta, _), = fake_tpu
    assert kq.shape == (8, 4, 128) and kpages.shape[2] == 4  # this device's 4 query heads and 2 KV heads (K and V)
    assert [m.shape for m in meta] == [t.shape for t in batch[:4]]  # the layout whole on every device
    assert out.shape == q.shape


@pytest.mark.devices
def test_per_device_runs_a_function_on_each_devices_heads():
    """The wrapper the kernel runs in on a tensor-parallel mesh, tested with the kernel's reference
    inside: each device attends with its own query and KV heads, and the result equals the unsharded one."""
    import torch_xla.distributed.spmd as xs
    mesh = make_mesh((1, torch_xla.runtime.global_runtime_device_count()))
    ways = mesh.shape()["model"]
    q, pages, batch, _, _ = random_step(5, heads=4 * ways, kv_heads=2 * ways, tokens=32)
    want = paged_reference(q, pages, *batch[:4], 0.3)
    dev = torch_xla.device()
    q, pages = q.to(dev), pages.to(dev)
    xs.mark_sharding(q, mesh, (None, "model", None))
    xs.mark_sharding(pages, mesh, (None, None, "model", None))
    meta = [t.to(dev) for t in batch[:4]]

    def local(q, pages, *tensors):
        assert q.shape[1] == 4 and pages.shape[2] == 4  # this device's heads
        return paged_reference(q, pages, *tensors, 0.3)

    specs = ((None, "model", None), (None, None, "model", None)) + tuple((None,) * t.dim() for t in meta)
    out = attention.per_device(local, mesh, specs, (None, "model", None))(q, pages, *meta)
    torch.testing.assert_close(out.cpu(), want, rtol=1e-5, atol=1e-5)
