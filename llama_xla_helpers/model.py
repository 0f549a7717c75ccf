"""A compact Llama for inference with a fixed-shape KV cache (Llama 1, 2, 3 and 3.1).

    model = Llama.from_hf(hf_model, max_batch_size=4, max_seq_len=512)    # or from_pretrained(dir, ...)
    logits = model(tokens, input_pos=torch.arange(n), pad=pad)            # prefill: slots 0..n-1
    logits = model(next_tokens, input_pos=torch.tensor([n]), pad=pad)     # decode: slot n

Every step has the same shapes whatever the position: the cache is written with
`index_copy_` at the slots in the `input_pos` tensor, and attention reads the whole cache
(max_seq_len keys) under a mask, or only its first `kv_len` slots when the caller knows that
no position beyond them is in use (the serving engine). On XLA that is one compiled graph per
input shape: one per prefill bucket, one for all decode steps (the LLaMA 65B latency post: "The Path to Achieve
Ultra-Low Inference Latency With LLaMA 65B on PyTorch/XLA", PyTorch blog,
https://pytorch.org/blog/path-achieve-low-inference-latency/). A prompt section longer than
`attention.BLOCK` tokens attends in blocks (`attention.blockwise_attention`), so its scores never
exist whole (its bool cache mask, one byte per query and slot for all heads, does). `Generator`
and the engine prefill a long prompt in sections of their largest bucket (512 tokens by default,
not over BLOCK), so a section's (section, kv_len) scores grow with the prompt's length, not its
square, and the eager path serves them.

Batches mix prompt lengths by left-padding: row b has `pad[b]` padding slots, so all rows
write the same slots, and row b's token at slot p has RoPE position p - pad[b], as if it
ran alone. Module and parameter names follow Hugging Face's LlamaForCausalLM without the
"model." prefix, so its weights load without renaming or permutation.
"""
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import LlamaConfig

from . import attention

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # the dtypes by the names the CLIs take

LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass(kw_only=True)
class ModelArgs:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: Optional[int] = None  # dim // n_heads unless given
    vocab_size: int
    intermediate_size: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None  # None or HF's {"rope_type": "llama3", "factor": ...}
    max_batch_size: int = 1
    max_seq_len: int = 2048
    tie_word_embeddings: bool = False

    def __post_init__(self):
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "intermediate_size",
                     "max_batch_size", "max_seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}: "
                             "each key/value head serves the same number of query heads")
        if self.head_dim is None:
            if self.dim % self.n_heads:
                raise ValueError(f"dim={self.dim} is not divisible by n_heads={self.n_heads}; "
                                 "pass head_dim explicitly")
            self.head_dim = self.dim // self.n_heads
        if self.head_dim < 2 or self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even: RoPE rotates pairs of dimensions")
        check_rope_scaling(self.rope_scaling)

    @classmethod
    def from_hf_config(cls, config, max_batch_size, max_seq_len):
        """ModelArgs of a `transformers.LlamaConfig`, with the cache sized for decoding."""
        if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
            raise ValueError("attention_bias / mlp_bias are True in the config; this Llama has no biases")
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act={config.hidden_act!r}; this Llama's feed-forward is SwiGLU ('silu')")
        return cls(
            dim=config.hidden_size, n_layers=config.num_hidden_layers, n_heads=config.num_attention_heads,
            n_kv_heads=config.num_key_value_heads, head_dim=getattr(config, "head_dim", None),
            vocab_size=config.vocab_size, intermediate_size=config.intermediate_size,
            norm_eps=config.rms_norm_eps, **rope_args(config),
            max_batch_size=max_batch_size, max_seq_len=max_seq_len,
            tie_word_embeddings=config.tie_word_embeddings,
        )

    @classmethod
    def from_pretrained(cls, path, max_batch_size, max_seq_len):
        """ModelArgs of a local Hugging Face checkpoint directory's config.json."""
        file = Path(path) / "config.json"
        if not file.is_file():
            raise FileNotFoundError(f"{path} has no config.json: expected a local Hugging Face checkpoint directory")
        return cls.from_hf_config(LlamaConfig.from_json_file(file), max_batch_size, max_seq_len)


def rope_args(config):
    """rope_theta and rope_scaling of a LlamaConfig. Transformers 5 keeps both in
    `config.rope_parameters` ({"rope_type": "default" | "llama3", "rope_theta": ..., factors});
    Transformers 4 had `config.rope_theta` and `config.rope_scaling`."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if "rope_theta" not in params:  # Transformers 4
        params = dict(config.rope_scaling or {}, rope_theta=config.rope_theta)
    theta = params.pop("rope_theta")
    if params.get("rope_type", params.get("type", "default")) == "default":
        return dict(rope_theta=theta, rope_scaling=None)
    return dict(rope_theta=theta, rope_scaling=params)


def check_rope_scaling(scaling):
    if scaling is None:
        return
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type != "llama3":
        raise ValueError(f"rope_scaling type {rope_type!r} is not supported; use None or 'llama3'")
    missing = [k for k in LLAMA3_ROPE_KEYS if k not in scaling]
    if missing:
        raise ValueError(f"rope_scaling {scaling} lacks {', '.join(missing)}")
    if scaling["low_freq_factor"] >= scaling["high_freq_factor"]:
        raise ValueError(f"rope_scaling low_freq_factor={scaling['low_freq_factor']} must be < "
                         f"high_freq_factor={scaling['high_freq_factor']}")


# --- RoPE -------------------------------------------------------------------------------

def rope_frequencies(head_dim, theta, scaling=None):
    """The (head_dim // 2,) rotation frequencies, with Llama 3.1's long-context scaling if given."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)
    if scaling is None:
        return inv_freq
    factor, low, high, old_len = (scaling[k] for k in LLAMA3_ROPE_KEYS)
    wavelen = 2 * math.pi / inv_freq
    # Wavelengths shorter than old_len / high keep their frequency, those longer than
    # old_len / low are slowed down by `factor`, and the band in between interpolates.
    smooth = ((old_len / wavelen - low) / (high - low)).clamp(0, 1)
    return (1 - smooth) * inv_freq / factor + smooth * inv_freq


def rope_tables(args):
    """cos and sin of every position's rotation angles, each (max_seq_len, head_dim), fp32.

    Hugging Face's layout: dimension i and i + head_dim / 2 form a rotated pair (Meta's
    checkpoints pair neighbours; the HF conversion permuted the q/k weights to match).
    """
    inv_freq = rope_frequencies(args.head_dim, args.rope_theta, args.rope_scaling)
    angles = torch.outer(torch.arange(args.max_seq_len, dtype=torch.float), inv_freq)  # (max_seq_len, head_dim // 2)
    angles = torch.cat([angles, angles], dim=-1)  # (max_seq_len, head_dim)
    return angles.cos(), angles.sin()


def apply_rope(x, cos, sin):
    """Rotate x (bsz, seqlen, heads, head_dim) by angles cos/sin (bsz, seqlen, head_dim)."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * cos[:, :, None] + rotated * sin[:, :, None]


def attention_mask(input_pos, pad, max_seq_len):
    """Which cache slots each query may read: (bsz, 1, seqlen, max_seq_len) bool.

    input_pos: (seqlen,) slots shared by every row, or (bsz, seqlen) one row's each (the
    serving engine's slots sit at different positions).
    """
    slots = torch.arange(max_seq_len, device=input_pos.device)  # (max_seq_len,)
    causal = slots <= input_pos[..., None]  # ([bsz,] seqlen, max_seq_len)
    not_pad = (slots[None, :] >= pad[:, None])[:, None]  # (bsz, 1, max_seq_len)
    itself = slots == input_pos[..., None]  # ([bsz,] seqlen, max_seq_len)
    # A padding query has no real key to read; letting it read itself keeps its softmax
    # finite, so no NaN ever reaches the cache. Real queries never read padding slots.
    return ((causal & not_pad) | itself)[:, None]


# --- Modules ------------------------------------------------------------------------------

class KVCache(nn.Module):
    def __init__(self, args, dtype, device):
        super().__init__()
        shape = (args.max_batch_size, args.max_seq_len, args.n_kv_heads, args.head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def update(self, input_pos, k, v):
        """Write k, v (bsz, seqlen, n_kv_heads, head_dim) at slots input_pos, (seqlen,) or
        (bsz, seqlen); return this batch's cache."""
        bsz = k.shape[0]
        k_cache, v_cache = self.k_cache, self.v_cache  # (bsz, max_seq_len, n_kv_heads, head_dim)
        if bsz < k_cache.shape[0]:  # only then a view: written through one, XLA copies the whole cache (measured)
            k_cache, v_cache = k_cache[:bsz], v_cache[:bsz]
        if input_pos.dim() == 1:  # the same slots in every row
            k_cache.index_copy_(1, input_pos, k)
            v_cache.index_copy_(1, input_pos, v)
        else:  # each row at its own slots: a scatter
            rows = torch.arange(bsz, device=k.device)[:, None]  # (bsz, 1)
            k_cache.index_put_((rows, input_pos), k)
            v_cache.index_put_((rows, input_pos), v)
        return k_cache, v_cache


class Linear(nn.Module):
    """A bias-free nn.Linear whose weight is stored transposed, (in_features, out_features),
    so the forward is `x @ weight_t`.

    Chosen for the XLA CPU backend, where F.linear on nn.Linear's (out_features, in_features)
    weight lowers to a transpose of the weight feeding the dot (an earlier decode benchmark ran
    slower with it; the committed one does not compare the two); on a TPU, XLA picks the layout
    either way. The stored layout stays behind the module: `weight` is the (out, in) view, and
    `state_dict` / `load_state_dict` read and write nn.Linear's (out, in) `weight`, so Hugging
    Face checkpoints load unchanged and `parallel.param_spec` names (out, in) dims.
    """

    def __init__(self, in_features, out_features):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        bound = 1 / math.sqrt(in_features)  # nn.Linear's default initialization
        self.weight_t = nn.Parameter(torch.empty(in_features, out_features).uniform_(-bound, bound))
        self.register_state_dict_post_hook(Linear.save_as_weight)
        self.register_load_state_dict_pre_hook(Linear.load_from_weight)

    def extra_repr(self):
        return f"in_features={self.in_features}, out_features={self.out_features}"

    @property
    def weight(self):
        return self.weight_t.t()  # (out_features, in_features), a view

    def forward(self, x):
        return x @ self.weight_t  # (..., in_features) @ (in_features, out_features)

    @staticmethod
    def save_as_weight(module, state_dict, prefix, local_metadata):
        state_dict[prefix + "weight"] = state_dict.pop(prefix + "weight_t").t()

    @staticmethod
    def load_from_weight(module, state_dict, prefix, *args):
        if prefix + "weight" in state_dict:
            state_dict[prefix + "weight_t"] = state_dict.pop(prefix + "weight").t()


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x32 = x.float()
        return self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x)


class Attention(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.q_proj = Linear(args.dim, args.n_heads * args.head_dim)
        self.k_proj = Linear(args.dim, args.n_kv_heads * args.head_dim)
        self.v_proj = Linear(args.dim, args.n_kv_heads * args.head_dim)
        self.o_proj = Linear(args.n_heads * args.head_dim, args.dim)
        self.kv_cache = None  # set by Llama.init_buffers

    def forward(self, x, input_pos, cos, sin, mask):
        bsz, seqlen, _ = x.shape
        q = self.q_proj(x).view(bsz, seqlen, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if mask is None:  # the serving engine's paged cache (`Llama.ragged`): each token reads its own request's pages
            y = self.kv_cache.attend(q[0], k[0], v[0], scale=1 / math.sqrt(self.head_dim))  # (T, n_heads, head_dim)
            return self.o_proj(y.reshape(bsz, seqlen, -1))

        k, v = self.kv_cache.update(input_pos, k, v)  # (bsz, max_seq_len, n_kv_heads, head_dim)
        kv_len = mask.shape[-1]  # attention reads the first kv_len cache slots, the only ones in use
        k, v = k[:, :kv_len], v[:, :kv_len]  # (bsz, kv_len, n_kv_heads, head_dim)
        # GQA: kv head g serves query heads g * n_rep ... g * n_rep + n_rep - 1, so the query heads
        # are grouped (n_kv_heads, n_rep) and read the cache as it is, never repeated n_rep times.
        q = q.view(bsz, seqlen, self.n_kv_heads, self.n_heads // self.n_kv_heads, self.head_dim)

        if seqlen > attention.BLOCK:  # a long prompt section: in blocks, never the whole (seqlen, kv_len) scores
            y = attention.blockwise_attention(q, k, v, scale=1 / math.sqrt(self.head_dim), mask=mask[:, 0])
        else:  # einsum, not matmul: matmul flattens (bsz, heads) and makes GSPMD gather the head-sharded cache
            scores = torch.einsum("bqgrd,bkgd->bgrqk", q, k) / math.sqrt(self.head_dim)  # (bsz, g, r, seqlen, kv_len)
            scores = scores.masked_fill(~mask[:, :, None], float("-inf"))  # mask: (bsz, 1, 1, seqlen, kv_len)
            probs = F.softmax(scores.float(), dim=-1).type_as(q)
            y = torch.einsum("bgrqk,bkgd->bqgrd", probs, v)  # (bsz, seqlen, g, r, head_dim)
        return self.o_proj(y.reshape(bsz, seqlen, -1))  # y: (bsz, seqlen, n_heads * head_dim)


class FeedForward(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.gate_proj = Linear(args.dim, args.intermediate_size)
        self.up_proj = Linear(args.dim, args.intermediate_size)
        self.down_proj = Linear(args.intermediate_size, args.dim)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TransformerBlock(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.input_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.self_attn = Attention(args)
        self.post_attention_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.mlp = FeedForward(args)

    def forward(self, x, input_pos, cos, sin, mask):
        h = x + self.self_attn(self.input_layernorm(x), input_pos, cos, sin, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class Llama(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        if args.tie_word_embeddings:  # the embedding's (vocab_size, dim) weight, as nn.Linear stores it
            self.lm_head = nn.Linear(args.dim, args.vocab_size, bias=False)
            self.lm_head.weight = self.embed_tokens.weight
        else:
            self.lm_head = Linear(args.dim, args.vocab_size)
        self.init_buffers()

    def init_buffers(self):
        """(Re)create the RoPE tables and zeroed KV caches on the weights' device and dtype.

        They are non-persistent (not in state_dict). Zeroing is never needed between
        batches: masking gives stale cache entries a weight of exactly 0.
        """
        weight = self.embed_tokens.weight
        cos, sin = rope_tables(self.args)
        self.register_buffer("rope_cos", cos.to(weight.device, weight.dtype), persistent=False)
        self.register_buffer("rope_sin", sin.to(weight.device, weight.dtype), persistent=False)
        for layer in self.layers:
            layer.self_attn.kv_cache = KVCache(self.args, weight.dtype, weight.device)

    @torch.no_grad()
    def forward(self, tokens, input_pos, pad=None, kv_len=None, last_only=False):
        """Logits (bsz, seqlen, vocab_size) fp32 for tokens (bsz, seqlen) written at cache slots
        input_pos (seqlen,) or, per row, (bsz, seqlen); pad (bsz,) counts each row's
        left-padding slots (None: no padding). kv_len (a Python int, default max_seq_len): attention
        reads only the first kv_len cache slots, so a step costs what the live context needs; every
        input_pos must be below it (one compiled graph per kv_len). last_only: the logits of the
        last position only, (bsz, 1, vocab_size): the LM head runs once per row, not per token."""
        bsz, seqlen = tokens.shape
        kv_len = self.args.max_seq_len if kv_len is None else kv_len
        self.check_shapes(tokens, input_pos, pad, kv_len)
        if pad is None:
            pad = torch.zeros(bsz, dtype=torch.long, device=tokens.device)
        pos = (input_pos - pad[:, None]).clamp(min=0)  # (bsz, seqlen) RoPE positions
        cos, sin = self.rope_cos[pos], self.rope_sin[pos]  # (bsz, seqlen, head_dim)
        mask = attention_mask(input_pos, pad, kv_len)  # (bsz, 1, seqlen, kv_len)

        x = self.embed_tokens(tokens)  # (bsz, seqlen, dim)
        for layer in self.layers:
            x = layer(x, input_pos, cos, sin, mask)
        x = x[:, -1:] if last_only else x  # (bsz, 1 or seqlen, dim)
        return self.lm_head(self.norm(x)).float()  # (bsz, 1 or seqlen, vocab_size)

    @torch.no_grad()
    def ragged(self, tokens, positions, logits_at=None):
        """A serving step: logits (n, vocab_size) fp32 for tokens (T,) of several requests on one
        flat axis, at positions (T,) of their own sequences, through the paged caches the engine's
        runner puts in place of the layers' KV caches (`runner.PagedCache`: each token writes its
        key and value into its request's pages and attends to them). logits_at (n,): the tokens
        whose logits are wanted (each request's last); None: every token's."""
        cos, sin = self.rope_cos[positions][None], self.rope_sin[positions][None]  # (1, T, head_dim)
        x = self.embed_tokens(tokens)[None]  # (1, T, dim)
        for layer in self.layers:
            x = layer(x, positions, cos, sin, None)
        x = x[0] if logits_at is None else x[0, logits_at]  # (n, dim)
        return self.lm_head(self.norm(x)).float()  # (n, vocab_size)

    def check_shapes(self, tokens, input_pos, pad, kv_len):
        """Shape checks only (never values: reading a device tensor would cut the XLA graph)."""
        bsz, seqlen = tokens.shape
        if bsz > self.args.max_batch_size:
            raise ValueError(f"batch size {bsz} > max_batch_size={self.args.max_batch_size}; "
                             "build the model with a larger max_batch_size")
        if input_pos.shape not in ((seqlen,), (bsz, seqlen)):
            raise ValueError(f"input_pos has shape {tuple(input_pos.shape)}, expected ({seqlen},) or "
                             f"({bsz}, {seqlen}) for tokens of shape {tuple(tokens.shape)}")
        if seqlen > self.args.max_seq_len:
            raise ValueError(f"{seqlen} tokens > max_seq_len={self.args.max_seq_len}")
        if not seqlen <= kv_len <= self.args.max_seq_len:
            raise ValueError(f"kv_len={kv_len} must be in [{seqlen} (the tokens), max_seq_len={self.args.max_seq_len}]")
        if pad is not None and pad.shape != (bsz,):
            raise ValueError(f"pad has shape {tuple(pad.shape)}, expected ({bsz},)")

    @classmethod
    def from_hf(cls, hf_model, max_batch_size, max_seq_len, dtype=None):
        """A copy of a `transformers.LlamaForCausalLM` (same weights and device; its dtype unless `dtype`)."""
        args = ModelArgs.from_hf_config(hf_model.config, max_batch_size, max_seq_len)
        state = {name: t.detach().to(dtype, copy=True) for name, t in hf_model.state_dict().items()}
        return cls.from_state_dict(args, state)

    @classmethod
    def from_pretrained(cls, path, max_batch_size, max_seq_len, dtype=None):
        """Load a local Hugging Face checkpoint directory (config.json + *.safetensors), in the
        saved dtype unless `dtype` (a torch dtype, or "fp32" / "bf16" as `runtime.default_dtype()` says).

        The whole model passes through host memory; on a pod, `parallel.load_for_inference`
        reads only each host's blocks instead.
        """
        path = Path(path)
        args = ModelArgs.from_pretrained(path, max_batch_size, max_seq_len)
        dtype = DTYPES.get(dtype, dtype)
        state = {}
        for file in safetensors_files(path):
            state.update({name: t.to(dtype or t.dtype) for name, t in load_file(file).items()})
        return cls.from_state_dict(args, state)

    @classmethod
    def from_state_dict(cls, args, hf_state):
        """Build on the meta device, then adopt the tensors of a Hugging Face state dict."""
        state = {name.removeprefix("model."): t for name, t in hf_state.items()
                 if not name.endswith("rotary_emb.inv_freq")}  # old checkpoints saved this buffer
        if args.tie_word_embeddings:  # saved once, as embed_tokens
            state["lm_head.weight"] = state.get("embed_tokens.weight")
        with torch.device("meta"):
            model = cls(args)
        check_state_dict(model, state)
        model.load_state_dict(state, assign=True)
        if args.tie_word_embeddings:  # assign=True replaced each parameter separately
            model.lm_head.weight = model.embed_tokens.weight
        model.init_buffers()
        return model.eval()


def safetensors_files(path):
    index = path / "model.safetensors.index.json"
    if index.is_file():  # sharded: the index maps each tensor to its file
        return sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {path}")
    return files


def check_state_dict(model, state):
    """ValueError naming the first tensor the model lacks, doesn't expect, or gets in the wrong shape."""
    expected = {name: t.shape for name, t in model.state_dict().items()}
    for name, shape in expected.items():
        if state.get(name) is None:
            raise ValueError(f"checkpoint has no tensor {name!r} (model expects shape {tuple(shape)})")
        if state[name].shape != shape:
            raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(state[name].shape)}, "
                             f"model expects {tuple(shape)}")
    for name, t in state.items():
        if name not in expected:
            raise ValueError(f"checkpoint tensor {name!r} (shape {tuple(t.shape)}) is not in the model")
