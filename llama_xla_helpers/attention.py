"""Attention whose memory grows with the sequence, not its square: one function for training and
prefill, and one for the serving engine's ragged steps over a paged KV cache.

    use(model, mesh)                        # a Hugging Face Llama attends with default_implementation()
    blockwise_attention(q, k, v, scale=s)   # FlashAttention-2's algorithm in PyTorch (any device)
    default_implementation()                # "flash" on a TPU, "blockwise" elsewhere
    ragged_attention(q, pages, batch, s)    # a serving step's flat tokens, each over its own request's pages

Eager attention (`sharding.sharded_eager_attention`, Table 2's) builds the (bsz, heads, seqlen,
seqlen) scores and an fp32 softmax of them and keeps both for the backward pass: 32 heads x 8,192²
x 4 bytes = 8.6 GB per sequence for Llama 3 8B's scores alone. The two paths here never hold more
than one block of them:

- "flash": torch_xla's Pallas kernel (`torch_xla.experimental.custom_kernel.flash_attention`),
  TPU only, given Table 2's partition spec for the batch and heads so that each device runs it
  on its own rows and heads. Causal, with segment ids for rows that pack several documents.
- "blockwise": the same algorithm in PyTorch, which XLA compiles to one unrolled loop over
  (query block, key block) pairs: an online softmax over the key blocks (FlashAttention, Dao et
  al. 2022) whose forward saves only the output and the log-sum-exp of each query, and a backward
  that recomputes each block's probabilities from them (FlashAttention-2, Dao 2023). Causal
  blocks above the diagonal are skipped. Without the custom backward, autograd would keep every
  block's probabilities and the memory would not fall.

On a CPU "flash" runs "blockwise". On a TPU the kernel takes only some lengths (`flash_takes`:
128, 256, 512 and multiples of 1,024, from torch_xla 2.9's block sizes); rows of another length
are padded to the next one it takes (`flash_length`), never sent to the loop silently, and
`ran(model)` says which path ran. Only a TPU runs the kernel; tests/test_tpu_kernels.py lowers
every call the package makes for the TPU from the CPU (JAX's own block and layout checks) and
runs JAX's kernel in Pallas's interpret mode against "blockwise".

Serving (the last section): the engine's step puts the tokens of every request it runs (prompt
chunks and decoded tokens) on one flat axis, and each token attends to the keys its own request
has written, which sit in the pages its block table lists (`kv_pages.py`). On a TPU that is
torch_xla's ragged paged attention kernel (vLLM's), wrapped in one custom op that
torch.compile traces (`paged_kernel`). Elsewhere (`flat_attention`) the step gathers the pages of
its sequences once onto one flat key axis and masks each query to its own sequence's keys, in
fixed shapes, from a pool laid out with K and V apart, each heads first (`write_heads`), the
layout XLA:CPU's batched matmuls read without copying it again; a step whose key bucket is the
whole pool reads it in place, with no gather.
"""
import functools
from functools import partial
from typing import NamedTuple

import torch
import torch.nn.functional as F
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr
from torch_xla.distributed.spmd import Mesh
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface
from transformers.models.llama.modeling_llama import repeat_kv

from .sharding import ACTIVATION_SPECS, batch_spec

IMPLEMENTATIONS = ("eager", "blockwise", "flash")
BLOCK = 512            # tokens per query block and per key block (the kernel's default blocks)
FLASH_MIN_BLOCK = 128  # the kernel tiles the sequence in blocks of at least this many tokens (its lanes)


def on_tpu():
    """Whether the TPU paths run: the kernels (tests fake this to take them on the CPU)."""
    return xr.device_type() == "TPU"


def kernels_execute():
    """Whether torch_xla's Pallas kernels can execute here: on a TPU. Elsewhere the ragged kernel's
    op (`paged_kernel`) runs a fixed-shape reference in its place, so the kernel path compiles and
    runs on the CPU too."""
    return xr.device_type() == "TPU"


# torch_xla's flash wrapper turns the mesh it is given into a string and parses it again on every
# call (in the backward always: custom_kernel.fa_custom_backward), and the shardings computed from a
# Mesh are cached per Mesh object, without bound: measured 0.6 ms and about 8 KiB kept per call on 8
# CPU devices, two calls per layer per step. One Mesh per string ends both.
Mesh.from_str = staticmethod(functools.lru_cache(maxsize=None)(Mesh.from_str))


def default_implementation():
    """What training and prefill run when not told: the kernel on a TPU, the blockwise loop elsewhere."""
    return "flash" if on_tpu() else "blockwise"


def _blocks(n, block):
    return [slice(i, min(i + block, n)) for i in range(0, n, block)]


def _scores(q, k, scale, keep):
    """Masked scores of a query block against a key block, fp32: (bsz, Bq, g, r, Bk)."""
    scores = torch.einsum("bqgrd,bkgd->bqgrk", q, k).float() * scale
    return scores.masked_fill(~keep, float("-inf"))


def _keep(i, j, mask, segment_ids, device):
    """Which keys of block j each query of block i reads: (1 or bsz, Bq, 1, 1, Bk) bool. From `mask`
    if given, else causal over the row and, with segment ids, inside the query's segment."""
    if mask is not None:
        keep = mask[:, i, j]  # (bsz, Bq, Bk)
    else:
        pos = torch.arange(i.start, i.stop, device=device)
        keep = (torch.arange(j.start, j.stop, device=device) <= pos[:, None])[None]  # (1, Bq, Bk)
        if segment_ids is not None:
            keep = keep & (segment_ids[:, i, None] == segment_ids[:, None, j])  # (bsz, Bq, Bk)
    return keep[:, :, None, None]


def _after(t, last):
    """t, made to wait for `last` (the previous block's result) by a dependency that changes nothing:
    t + 0 * (an element of last). XLA compiles the Python loops below unrolled, and without it its
    scheduler may compute many blocks' scores at once (they depend on q and k only) and hold them
    all. Measured on XLA:CPU (benchmarks/attention.py), 2,048 tokens in blocks of 512: the training
    step's scratch memory per device 513 MiB without it, 233 MiB with the next block waiting for
    dq only, 208 MiB waiting for dq, dk and dv. (Optimization barriers do not do it there: XLA:CPU
    drops them.)"""
    return t + (0.0 * last.flatten()[0]).to(t.dtype)


def _pairs(s, t, block, causal_skip):
    """The (query block, key block) pairs to compute; with causal_skip (queries and keys both at
    0 ... s-1) those above the diagonal, which read nothing, are left out."""
    return [(i, [j for j in _blocks(t, block) if not (causal_skip and j.start >= i.stop)])
            for i in _blocks(s, block)]


class BlockwiseAttention(torch.autograd.Function):
    """Forward: an online softmax over key blocks, saving the output and the log-sum-exp only.
    Backward: FlashAttention-2's, each block's probabilities recomputed from the log-sum-exp."""

    @staticmethod
    def forward(ctx, q, k, v, mask, segment_ids, scale, block):
        outs, lses = [], []
        last = torch.zeros((), device=q.device)  # the previous block's result, which the next one waits for
        for i, js in _pairs(q.shape[1], k.shape[1], block, mask is None):
            m = torch.full(q[:, i].shape[:-1], float("-inf"), device=q.device)  # (bsz, Bq, g, r) running max
            l = torch.zeros_like(m)                                             # running sum of exp
            acc = torch.zeros(q[:, i].shape, device=q.device)                   # (bsz, Bq, g, r, head_dim)
            for j in js:
                s = _scores(_after(q[:, i], last), k[:, j], scale, _keep(i, j, mask, segment_ids, q.device))
                m_new = torch.maximum(m, s.amax(-1))
                m_safe = m_new.masked_fill(m_new == float("-inf"), 0.0)  # a query that has read no key yet
                p = torch.exp(s - m_safe[..., None])                     # (bsz, Bq, g, r, Bk)
                alpha = torch.exp(m - m_safe)                            # rescales what the earlier blocks summed
                l = l * alpha + p.sum(-1)
                acc = acc * alpha[..., None] + torch.einsum("bqgrk,bkgd->bqgrd", p.to(v.dtype), v[:, j]).float()
                m, last = m_new, acc
            outs.append((acc / l[..., None]).to(q.dtype))
            lses.append(m + torch.log(l))
        out, lse = torch.cat(outs, 1), torch.cat(lses, 1)  # (bsz, seqlen, g, r, head_dim), (bsz, seqlen, g, r)
        ctx.save_for_backward(q, k, v, out, lse, mask, segment_ids)
        ctx.scale, ctx.block = scale, block
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, mask, segment_ids = ctx.saved_tensors
        dout = dout.to(q.dtype)
        delta = (dout.float() * out.float()).sum(-1)  # (bsz, seqlen, g, r): rowsum(dO * O)
        dq = []
        dk, dv = {}, {}  # key block start -> (bsz, Bk, g, head_dim) fp32, summed over the query blocks
        last = torch.zeros((), device=q.device)
        for i, js in _pairs(q.shape[1], k.shape[1], ctx.block, mask is None):
            dq_i = torch.zeros(q[:, i].shape, device=q.device)
            for j in js:
                q_i, dout_i = _after(q[:, i], last), _after(dout[:, i], last)
                s = _scores(q_i, k[:, j], ctx.scale, _keep(i, j, mask, segment_ids, q.device))
                p = torch.exp(s - lse[:, i, ..., None])  # (bsz, Bq, g, r, Bk); masked keys: exp(-inf) = 0
                dv_j = torch.einsum("bqgrk,bqgrd->bkgd", p.to(q.dtype), dout_i).float()
                dp = torch.einsum("bqgrd,bkgd->bqgrk", dout_i, v[:, j]).float()
                ds = (p * (dp - delta[:, i, ..., None]) * ctx.scale).to(q.dtype)
                dq_i = dq_i + torch.einsum("bqgrk,bkgd->bqgrd", ds, k[:, j]).float()
                dk_j = torch.einsum("bqgrk,bqgrd->bkgd", ds, q[:, i]).float()
                dk[j.start] = dk[j.start] + dk_j if j.start in dk else dk_j
                dv[j.start] = dv[j.start] + dv_j if j.start in dv else dv_j
                last = dq_i.flatten()[0] + dk[j.start].flatten()[0] + dv[j.start].flatten()[0]  # all of this pair
            dq.append(dq_i)
        starts = sorted(dk)  # every key block: the last query block reads them all
        return (torch.cat(dq, 1).to(q.dtype), torch.cat([dk[j] for j in starts], 1).to(k.dtype),
                torch.cat([dv[j] for j in starts], 1).to(v.dtype), None, None, None, None)


def blockwise_attention(q, k, v, *, scale, segment_ids=None, mask=None, block=BLOCK):
    """Attention in blocks of `block` queries and keys: (bsz, seqlen, g, r, head_dim), memory linear in seqlen.

    q: (bsz, seqlen, g, r, head_dim), g KV heads with r query heads each (GQA, never repeated);
    k, v: (bsz, kv_len, g, head_dim). Without a mask, causal over the row (kv_len = seqlen; blocks
    above the diagonal are skipped) and, with segment_ids (bsz, seqlen), only inside each query's
    segment: documents packed into one row. mask: (bsz, seqlen, kv_len) bool, which keys each
    query reads (the inference model's cache slots); every block is computed, and the mask (one
    byte per score, for all heads) is the one square left."""
    if mask is None and k.shape[1] != q.shape[1]:
        raise ValueError(f"causal attention over the row needs as many keys as queries, but q has {q.shape[1]} "
                         f"and k {k.shape[1]}; pass a mask (bsz, {q.shape[1]}, {k.shape[1]}) of the keys each reads")
    return BlockwiseAttention.apply(q, k, v, mask, segment_ids, scale, block)


def flash_takes(seq_len):
    """Whether torch_xla 2.9's flash kernel takes rows of seq_len tokens, forward and backward: each
    of its blocks (`FlashAttention.DEFAULT_BLOCK_SIZES`, cut to the length) must divide the length
    (JAX's block check) and be a whole number of 128-token lanes. So 128, 256, 512 and multiples of
    1,024: at 384, 768 or 1,536 the backward raises at step 1; at 192 the forward cannot be built."""
    from torch_xla.experimental.custom_kernel import FlashAttention
    blocks = [min(b, seq_len) for name, b in FlashAttention.DEFAULT_BLOCK_SIZES.items() if name != "block_b"]
    return all(b % FLASH_MIN_BLOCK == 0 and seq_len % b == 0 for b in blocks)


def flash_length(seq_len):
    """The length the flash kernel runs rows of seq_len tokens at: the first one it takes (192 -> 256,
    768 -> 1,024, 1,536 -> 2,048)."""
    n = -(-seq_len // FLASH_MIN_BLOCK) * FLASH_MIN_BLOCK
    while not flash_takes(n):
        n += FLASH_MIN_BLOCK
    return n


def flash_attention(query, key, value, scale, segment_ids=None, mesh=None):
    """torch_xla's Pallas flash attention (TPU only), causal: (bsz, seqlen, heads, head_dim).

    query (bsz, heads, seqlen, head_dim), key / value (bsz, kv_heads, seqlen, head_dim) as Hugging
    Face hands them; the kernel wants as many KV heads as query heads, so they are repeated. Under
    SPMD each device runs it on the batch and heads Table 2 gives it (`partition_spec`).

    A length the kernel does not take is zero-padded at the end to `flash_length` and the output cut
    back. Causal attention keeps every real query from reading the padding (it comes after them),
    and the padding's own rows are cut, so their gradients are zero: the result is the unpadded
    one. With segment ids the padding gets a segment of its own (-1) as well."""
    from torch_xla.experimental.custom_kernel import flash_attention as kernel
    n_rep = query.shape[1] // key.shape[1]
    key, value = repeat_kv(key, n_rep), repeat_kv(value, n_rep)  # (bsz, heads, seqlen, head_dim)
    seq_len = query.shape[2]
    pad = flash_length(seq_len) - seq_len
    if pad:
        query, key, value = (F.pad(t, (0, 0, 0, pad)) for t in (query, key, value))
    spec = None if mesh is None else batch_spec(ACTIVATION_SPECS["attn_weights"], mesh)
    if segment_ids is not None:  # the loader's are int64; the kernel's JAX side takes int32 ids
        segment_ids = F.pad(segment_ids.to(torch.int32), (0, pad), value=-1)
    out = kernel(query, key, value, causal=True, q_segment_ids=segment_ids, kv_segment_ids=segment_ids,
                 sm_scale=scale, partition_spec=spec, mesh=mesh)
    return out[:, :, :seq_len].transpose(1, 2)


def flash_path(seq_len):
    """How flash runs rows of seq_len tokens: "flash", or "flash (192 padded to 256)"."""
    n = flash_length(seq_len)
    return "flash" if n == seq_len else f"flash ({seq_len} padded to {n})"


def hf_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, *, implementation, mesh=None,
                 block=BLOCK, segment_ids=None, **kwargs):
    """A Hugging Face attention function (`AttentionInterface`) running "blockwise" or "flash".

    query (bsz, heads, seqlen, head_dim), key / value (bsz, kv_heads, seqlen, head_dim); returns
    ((bsz, seqlen, heads, head_dim), None): no attention weights exist to return. Causal over the
    row; `segment_ids` (bsz, seqlen), passed to the model's forward, keep packed documents apart.
    The attention_mask is None (`use` registers no mask): rows carry no padding in training.
    The path that ran is kept on the module (`ran`)."""
    if dropout:
        raise ValueError(f"attention dropout={dropout} is not supported by {implementation!r} attention; "
                         f"set the config's attention_dropout to 0 (Llama's default)")
    flash = implementation == "flash" and on_tpu()
    if module is not None:
        module.attention_ran = flash_path(query.shape[2]) if flash else "blockwise"
    if flash:
        return flash_attention(query, key, value, scaling, segment_ids, mesh), None
    q = query.transpose(1, 2).unflatten(2, (key.shape[1], -1))  # (bsz, seqlen, g, r, head_dim)
    out = blockwise_attention(q, key.transpose(1, 2), value.transpose(1, 2), scale=scaling, segment_ids=segment_ids,
                              block=block)
    return out.flatten(2, 3), None  # (bsz, seqlen, heads, head_dim)


def ran(model):
    """What a Hugging Face model's attention ran as in its last forward: "flash", "flash (192 padded
    to 256)", "blockwise", or `implementation(model)` if `use` did not set it (eager)."""
    paths = sorted({m.attention_ran for m in model.modules() if hasattr(m, "attention_ran")})
    return ", ".join(paths) or implementation(model)


def implementation(model):
    """What a Hugging Face model attends with: "blockwise" or "flash" if `use` set it, else "eager"."""
    return {name: key[0] for key, name in _NAMES.items()}.get(model.config._attn_implementation, "eager")


def no_mask(*args, **kwargs):
    """The mask function registered beside `hf_attention`: none, so no (bsz, 1, seqlen, seqlen) mask is built."""
    return None


_NAMES = {}  # (implementation, str(mesh), block) -> the name its attention function is registered under


def use(model, mesh=None, implementation=None, block=None):
    """Make a Hugging Face Llama attend with `implementation` (default `default_implementation()`),
    in blocks of `block` tokens (default BLOCK) where it runs "blockwise".

    "eager" leaves the model's attention as it is (Table 2's, from `sharding.shard_activations`,
    or Hugging Face's). Registered under one name per (implementation, mesh): the registry is
    process-wide. Returns the implementation."""
    implementation = implementation or default_implementation()
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"attention implementation {implementation!r} is not one of {', '.join(IMPLEMENTATIONS)}")
    if implementation == "eager":
        return implementation
    block = block or BLOCK
    key = (implementation, str(mesh), block)
    name = _NAMES.setdefault(key, f"llama_xla_attention_{len(_NAMES)}")  # no "flash": Transformers reads that
    AttentionInterface.register(name, partial(hf_attention, implementation=implementation, mesh=mesh, block=block))
    AttentionMaskInterface.register(name, no_mask)
    model.set_attn_implementation(name)
    return implementation


# --- Serving: ragged attention over a paged KV cache --------------------------------------------

NO_KEY = 1 << 30  # the first position of a padding page on the flat key axis: after every query's position


class RaggedBatch(NamedTuple):
    """A serving step's tokens on one flat axis of T (device tensors: `ragged_batch`), from S
    sequences at most (unused ones have no queries and kv length 0), each with room for P pages
    in its block table. The first four are the kernel's arguments; the rest lay out the flat
    path's keys: the K distinct pages the step reads (a prefix shared by several sequences once),
    and, in a step split in two (`flat_attention`), its D decode queries and the C pages of its
    prompt chunks' sequences. The flat keys are None on the kernel's path, the split's in one group."""
    kv_lens: torch.Tensor  # (S,) each sequence's keys once this step has written its tokens
    page_indices: torch.Tensor  # (S, P) its block table (0 past its pages)
    cu_q_lens: torch.Tensor  # (S + 1,) where its queries start on the flat axis (and end)
    num_seqs: torch.Tensor  # (1,) sequences in use
    positions: torch.Tensor  # (T,) each token's position in its sequence (padding: 0)
    slots: torch.Tensor  # (T,) where its key and value go: page * page_size + position % page_size (padding: page 0)
    token_seq: torch.Tensor = None  # (T,) each token's sequence (padding: 0)
    key_pages: torch.Tensor = None  # (K,) the pages the step reads (padding: page 0), or the whole pool in order
    key_start: torch.Tensor = None  # (K,) the position of each one's first key in the sequences that hold it (NO_KEY: none)
    decode: torch.Tensor = None  # (D,) the flat index of each query of a one-token run (padding: 0)
    chunk_pages: torch.Tensor = None  # (C,) the pages of the sequences with more than one query (padding: page 0)
    chunk_start: torch.Tensor = None  # (C,) as key_start


def ragged_batch(layout, put=lambda t: t):
    """A RaggedBatch of host lists (`runner.ragged_layout`), each a tensor passed through `put`:
    int32 for the kernel's four arguments (its JAX side takes int32), int64 for the rest (the
    indices torch_xla's gathers and index_copy take)."""
    kernel = RaggedBatch._fields[:4]
    return RaggedBatch(**{k: put(torch.tensor(v, dtype=torch.int32 if k in kernel else torch.long))
                          for k, v in layout.items()})


def write_pages(pages, batch, k, v):
    """pages (num_pages, page_size, 2 * g, head_dim), the kernel's layout, with this step's keys and
    values k, v (T, g, head_dim, or less: zero-padded to the pages') written at `batch.slots`,
    interleaved on the head axis as the kernel reads them (K of head h at 2h, V at 2h + 1). Out of
    place: the runner donates `pages`, so XLA writes in place.

    A step of one token writes a second row, zeros into slot 0 (page 0, the padding's): XLA turns a
    one-row write into a dynamic-update-slice guarded by a bounds check, which copies the whole
    pool first (measured: a 97-page pool's step 4x a 10-page one's, tests/test_engine.py)."""
    kv = torch.stack([k, v], dim=2).flatten(1, 2)  # (T, 2 * g, head_dim): k0, v0, k1, v1, ...
    kv = F.pad(kv, (0, pages.shape[3] - kv.shape[2]))  # the kernel's pages: zeros up to its head_dim
    slots = batch.slots  # (T,)
    if kv.shape[0] == 1:
        kv, slots = torch.cat([kv, torch.zeros_like(kv)]), torch.cat([slots, torch.zeros_like(slots)])
    return pages.flatten(0, 1).index_copy(0, slots, kv).view(pages.shape)


def write_heads(pool, batch, k, v):
    """pool (2, g, num_pages, page_size, head_dim), the flat path's layout (K and V apart, each heads
    first), with this step's k, v (T, g, head_dim) written at `batch.slots`: one index_copy on the
    pool seen as rows of head_dim, 2g rows per token (so never the one-row write `write_pages`
    avoids). Out of place, donated: XLA writes in place."""
    _, g, num_pages, page_size, _ = pool.shape
    kv = torch.stack([k, v]).transpose(1, 2)  # (2, g, T, head_dim)
    rows = torch.arange(2 * g, device=k.device)[:, None] * (num_pages * page_size) + batch.slots  # (2g, T)
    return pool.flatten(0, 3).index_copy(0, rows.flatten(), kv.flatten(0, 2)).view(pool.shape)


def keys_attention(q, pool, pages, start, batch, seq, pos, scale):
    """q (Q, heads, head_dim), queries of sequences `seq` (Q,) at positions `pos` (Q,), over the keys of
    `pages` (K,) gathered from pool (2, g, num_pages, page_size, head_dim) onto one axis, each page's
    first key at position `start` (K,): each query reads those in its own sequence's block table
    (`batch.page_indices`) at positions up to its own. -> (Q, heads, head_dim). K = num_pages: the
    pages are the whole pool in order (`runner.ragged_layout`), read in place, with no gather (a
    step over most of the pool would copy most of it: measured on the CPU, one layer of the
    serving benchmark's model over its 97 pages, about a quarter of the attention's time). A query
    that keeps no key gets a finite average, never NaN (a NaN there would reach a page through the
    next layer)."""
    g, page_size = pool.shape[1], pool.shape[3]
    kv = (pool if pages.shape[0] == pool.shape[2] else pool[:, :, pages]).flatten(2, 3)  # (2, g, L, head_dim)
    k, v = kv[0], kv[1]  # (g, L, head_dim), L = K * page_size
    held = (batch.page_indices[:, :, None] == pages).any(dim=1)  # (S, K): the pages of each block table
    key_pos = (start[:, None] + torch.arange(page_size, device=q.device)).flatten()  # (L,)
    keep = held[seq].repeat_interleave(page_size, dim=1) & (key_pos <= pos[:, None])  # (Q, L)
    qg = q.unflatten(1, (g, -1))  # (Q, g, r, head_dim): query heads g * r .. g * r + r - 1 read KV head g
    scores = torch.einsum("tgrd,gld->gtrl", qg, k).float() * scale  # (g, Q, r, L)
    probs = scores.masked_fill(~keep[:, None], torch.finfo(scores.dtype).min).softmax(dim=-1).to(v.dtype)
    return torch.einsum("gtrl,gld->tgrd", probs, v).flatten(1, 2)  # (Q, heads, head_dim)


def flat_attention(q, pool, batch, scale):
    """Ragged attention in fixed shapes, off a TPU: (T, heads, head_dim). The step's pages are
    gathered once onto one flat key axis (`batch.key_pages`, K pages: its cost follows the step's
    keys, not its longest block table times its tokens), and each query reads the keys of the
    pages in its own sequence's block table, at positions up to its own (`keys_attention`).
    pool: (2, g, num_pages, page_size, head_dim) (`write_heads`), so the gathered keys are (g, L,
    head_dim), the batched dot's operand, and nothing is laid out again; a step whose K is the
    whole pool reads it where it is.

    Every query scores every key of the step, T x K x page_size, so a step with a long prompt chunk
    beside many decoding requests is split in two (`batch.decode` set): all T queries over the
    chunks' C pages only (the decode queries among them keep no key there), then the D decode
    queries over the K pages, written over their rows: T x C + D x K keys instead of T x K."""
    if batch.decode is None:
        return keys_attention(q, pool, batch.key_pages, batch.key_start, batch, batch.token_seq, batch.positions, scale)
    out = keys_attention(q, pool, batch.chunk_pages, batch.chunk_start, batch, batch.token_seq, batch.positions, scale)
    d = batch.decode  # (D,)
    decoded = keys_attention(q[d], pool, batch.key_pages, batch.key_start, batch, batch.token_seq[d],
                             batch.positions[d], scale)  # (D, heads, head_dim)
    return out.index_copy(0, d, decoded)


def kernel_fits(n_kv_heads, dtype):
    """Whether torch_xla 2.9's ragged paged attention kernel takes a device's n_kv_heads: the K and
    V heads together, counted in 32-bit words, 1, 2, 4, 8 or a multiple of 8 (what Mosaic tiles
    whole; `get_min_heads_per_blk`). Any head_dim: the pages pad it to the kernel's lanes
    (`metrics.kernel_head_dim`)."""
    words, rest = divmod(2 * n_kv_heads, 32 // torch.finfo(dtype).bits)  # 1 value per word in fp32, 2 in bf16
    return rest == 0 and (words in (1, 2, 4, 8) or words % 8 == 0)


@torch.library.custom_op("llama_xla::ragged_paged_attention", mutates_args=())
def paged_kernel(q: torch.Tensor, pages: torch.Tensor, kv_lens: torch.Tensor, page_indices: torch.Tensor,
                 cu_q_lens: torch.Tensor, num_seqs: torch.Tensor, scale: float, mesh: str) -> torch.Tensor:
    """torch_xla's ragged paged attention kernel as one op that torch.compile traces (its Python
    wrapper cannot be: `requires_jax` calls into the runtime, and so does manual sharding):
    (T, heads, head_dim). mesh: str(Mesh), or "" for none. On a mesh with a 'model' axis each
    device runs it on its own query heads and their KV heads, as vLLM's TPU backend does. Where
    the kernel cannot execute (a CPU) `paged_reference` runs in its place."""
    from torch_xla.experimental.custom_kernel import ragged_paged_attention
    kernel = partial(cached_payload(ragged_paged_attention), sm_scale=scale) if kernels_execute() else \
        partial(paged_reference, scale=scale)
    meta = (kv_lens, page_indices, cu_q_lens, num_seqs)
    mesh = Mesh.from_str(mesh) if mesh else None
    if mesh is not None and mesh.shape().get("model", 1) > 1:
        specs = ((None, "model", None), (None, None, "model", None)) + tuple((None,) * t.dim() for t in meta)
        kernel = per_device(kernel, mesh, specs, (None, "model", None))
    return kernel(q, pages, *meta)


def cached_payload(wrapper):
    """torch_xla's kernel wrapper `wrapper`, its JAX lowering kept per shape. Its ragged wrapper calls
    trace_pallas without use_cache, so a lazy step (compile=False) would lower the kernel with JAX
    again in every layer at every step; a compiled step runs the wrapper once per shape anyway."""
    def run(*args, **kwargs):
        import torch_xla.experimental.custom_kernel as ck
        trace = ck.trace_pallas
        ck.trace_pallas = partial(trace, use_cache=True)
        try:
            return wrapper(*args, **kwargs)
        finally:
            ck.trace_pallas = trace
    return run


@paged_kernel.register_fake
def _(q, pages, kv_lens, page_indices, cu_q_lens, num_seqs, scale, mesh):
    return torch.empty_like(q)


def paged_reference(q, pages, kv_lens, page_indices, cu_q_lens, num_seqs, scale):
    """What the ragged kernel computes, from its own arguments, in fixed shapes: (T, heads, head_dim).
    Each token gathers its sequence's block table from `pages` in the kernel's layout (P x page_size
    keys) and reads those at positions up to its own. (torch_xla's reference,
    `ragged_paged_attention(use_kernel=False)`, reads the lengths on the host, so a compiled step
    would keep the first step's layout.)"""
    t = torch.arange(q.shape[0], device=q.device)  # (T,)
    seq = (t[:, None] >= cu_q_lens[None, 1:]).sum(-1).clamp(max=kv_lens.shape[0] - 1)  # (T,) its sequence
    pos = (kv_lens[seq] - cu_q_lens[seq + 1] + t).clamp(min=0)  # (T,) its position there (padding: anything)
    g = pages.shape[2] // 2
    kv = pages[page_indices[seq]].flatten(1, 2)  # (T, L, 2 * g, head_dim), L = P * page_size
    k, v = kv[:, :, 0::2], kv[:, :, 1::2]  # (T, L, g, head_dim)
    scores = torch.einsum("tgrd,tlgd->tgrl", q.unflatten(1, (g, -1)), k).float() * scale  # (T, g, r, L)
    keep = torch.arange(k.shape[1], device=q.device) <= pos[:, None]  # (T, L)
    probs = scores.masked_fill(~keep[:, None, None], float("-inf")).softmax(dim=-1).to(v.dtype)
    return torch.einsum("tgrl,tlgd->tgrd", probs, v).flatten(1, 2)  # (T, heads, head_dim)


def kernel_attention(q, pages, batch, scale, mesh=""):
    """The ragged kernel (`paged_kernel`): (T, heads, head_dim). mesh: str(Mesh), or "" for none (a
    string: dynamo cannot trace str(mesh) inside a compiled step). q's head_dim is zero-padded to the
    pages' (`metrics.kernel_head_dim`) and the output cut back; the padding tokens past the step's last
    sequence get zeros (the kernel leaves their rows unwritten)."""
    head_dim = q.shape[2]
    q = F.pad(q, (0, pages.shape[3] - head_dim))
    out = paged_kernel(q, pages, batch.kv_lens, batch.page_indices, batch.cu_q_lens, batch.num_seqs, scale, mesh)
    real = torch.arange(q.shape[0], device=q.device) < batch.cu_q_lens[-1]
    return torch.where(real[:, None, None], out[..., :head_dim], 0)


def per_device(fn, mesh, in_specs, out_spec):
    """fn run by each device on its own shard of each tensor argument (partition specs in_specs),
    its result assembled as out_spec says: JAX's shard_map, with torch_xla's manual sharding."""
    def run(*args):
        local = [xs.enable_manual_sharding(a, spec, mesh=mesh).global_tensor for a, spec in zip(args, in_specs)]
        out = fn(*local)
        full = tuple(n * (mesh.shape()[axis] if axis else 1) for n, axis in zip(out.shape, out_spec))
        return xs.disable_manual_sharding(out, out_spec, full, mesh=mesh).global_tensor
    return run


def uses_kernel(n_kv_heads, dtype, mesh=None):
    """Whether a serving step runs the ragged kernel (else the flat path): on a TPU, where the kernel
    takes each device's KV heads (n_kv_heads over the mesh's 'model' axis)."""
    ways = 1 if mesh is None else mesh.shape().get("model", 1)
    return on_tpu() and kernel_fits(n_kv_heads // ways, dtype)


def ragged_attention(q, pages, batch, scale, mesh=None):
    """A serving step's attention: q (T, heads, head_dim) for the step's flat tokens, each reading
    its own sequence's keys and values in `pages` as `batch` (a RaggedBatch) lays out. The layout
    says the path (the runner allocates the one `uses_kernel` picks): the kernel's (num_pages,
    page_size, 2 * g, head_dim) goes to the ragged kernel (its PyTorch reference where kernels do
    not execute), the flat path's (2, g, num_pages, page_size, head_dim) to `flat_attention`. Both
    compute the same thing (tests compare them, and lower the kernel for the TPU)."""
    if pages.dim() == 5:
        return flat_attention(q, pages, batch, scale)
    return kernel_attention(q, pages, batch, scale, "" if mesh is None else str(mesh))
