"""Weight-only quantization of the inference Llama: int8, int4 (round to nearest), GPTQ int4.

    model = quantize(Llama.from_hf(hf, max_batch_size=8, max_seq_len=512), "int8")
    model = quantize(model, "int4", group_size=32)
    model = quantize(model, "gptq-int4", group_size=32, calibration=train_chunks[:64])
    save_quantized(model, "tiny-int4.safetensors")
    model = load_quantized(Llama(args), "tiny-int4.safetensors")   # any skeleton, even on "meta"

Every float linear layer (`model.Linear`) of the transformer blocks (q/k/v/o_proj,
gate/up/down_proj) becomes a module that stores the integer weight and its scales as buffers,
named `<layer>.weight`, `<layer>.scales` (and `<layer>.zeros`), and dequantizes on the fly. The embedding, the norms
and lm_head stay as they are (pass quantize_lm_head=True to quantize lm_head too).

Schemes, with w the (out_features, in_features) weight:

- "int8": symmetric, one scale per output channel: w ~ q * scale, q in [-127, 127] (int8).
  Weights are centred on zero, so a zero point would buy nothing at 255 levels.
- "int4": asymmetric, one (scale, zero) per group of `group_size` inputs of each output:
  w ~ q * scale - zero, q in [0, 15], two q per uint8 byte (even column in the low nibble).
  Asymmetric because 4 bits give only 16 levels: min-max spreads all 16 over each group's
  actual range, where symmetric uses 15 (-7..7) over [-max|w|, max|w|] and wastes the part
  of that range a skewed group does not use. It costs one zero per group.
- "gptq-int4": the int4 layout, but the codes come from GPTQ (Frantar et al. 2022) on a
  calibration set: it quantizes the columns one by one and moves each column's rounding
  error onto the columns not yet quantized, weighted by the inverse Hessian of the layer's
  inputs, so the layer's outputs X w^T move least on data like the calibration set.

Scales and zeros are stored in the dtype of the weight they replace (bf16 for a bf16 model);
they are rounded to it before the codes are chosen, so the codes fit the stored values.
Rounding error is at most scale / 2 per weight (plus, in bf16, the zero's own rounding).

How the matmul runs (checked on torch_xla 2.9.0, CPU backend, and in tests/test_quantize.py):

- CPU and other non-XLA devices, plain torch: int8 casts the codes to the activations' dtype,
  runs F.linear and scales the output; int4 dequantizes the weight, then F.linear.
- XLA, int8: `torch.ops.xla.quantized_matmul(x, w_int8, scales)` (the op behind torch_xla's
  `XlaQuantizedLinear`). The HLO takes the weight as an s8 parameter and feeds it straight to
  a mixed dot (f32/bf16 activations x s8 weight); the scales multiply the dot's output.
- XLA, int4: the same op's blockwise form, which reads an s8 weight (in / group, group, out).
  Int4Linear keeps its packed codes in that order, `weight_t` (in // 2, out) u8 (the transpose
  of the file's `weight`, as `model.Linear` keeps its weight): the graph only splits the
  nibbles (and 15, shift by 4, an elementwise op) and reshapes; no permute of the weight runs
  in a forward. It runs dot(s8, activations) per group, then the per-group scales and zeros.
  The codes stay half a byte per weight in memory and on disk. No float copy of a
  weight is a parameter of the graph. The op's own int4 option (`int4_weight=True`) also
  runs on this CPU backend but is not used: it copies the weight to the host on every call
  (`w.cpu()`) and bakes it into the graph as an s4 constant, so every call syncs and the
  compiled graph depends on the weight values. Off XLA, dequantize-then-matmul is the fallback.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch_xla.experimental.xla_quantized_matmul  # noqa: F401 (registers torch.ops.xla.quantized_matmul)
from safetensors.torch import load_file, save_file

from .model import Linear, check_state_dict

SCHEMES = ("int8", "int4", "gptq-int4")
FLOAT_LINEARS = (Linear, nn.Linear)  # not yet quantized; `.weight` is (out_features, in_features)
BLOCK_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
# Linears that read the same input share one Hessian; GPTQ quantizes them stage by stage.
GPTQ_STAGES = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("self_attn.o_proj",),
               ("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",))


# --- int8, symmetric per output channel ---------------------------------------------------

def quantize_int8(w):
    """w (out, in) -> q (out, in) int8 and scale (out,) in w's dtype, with w ~ q * scale[:, None]."""
    scale = (w.float().abs().amax(dim=1) / 127).clamp(min=torch.finfo(w.dtype).tiny).to(w.dtype)
    q = (w.float() / scale.float()[:, None]).round().clamp(-127, 127)  # rounding error <= scale / 2
    return q.to(torch.int8), scale


class Int8Linear(nn.Module):
    xla_path = "torch.ops.xla.quantized_matmul, per-channel (s8 weight in the graph)"

    def __init__(self, weight, scales):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight)  # (out_features, in_features) int8
        self.register_buffer("scales", scales)  # (out_features,)

    def forward(self, x):
        if x.device.type == "xla":
            return torch.ops.xla.quantized_matmul(x, self.weight, self.scales.to(x.dtype))
        return F.linear(x, self.weight.to(x.dtype)) * self.scales.to(x.dtype)


# --- int4, asymmetric per group, two values per byte ----------------------------------------

def int4_params(w, group_size):
    """Min-max scale and zero (out, in // group_size) of each group of w (out, in), fp32."""
    groups = w.float().reshape(w.shape[0], -1, group_size)  # (out, n_groups, group_size)
    lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)
    return ((hi - lo) / 15).clamp(min=torch.finfo(torch.float).tiny), -lo


def int4_codes(w, scale, zero):
    """Codes in [0, 15] (uint8) of w ~ code * scale - zero (broadcast elementwise)."""
    return ((w + zero) / scale).round().clamp(0, 15).to(torch.uint8)


def quantize_int4(w, group_size):
    """w (out, in) -> codes (out, in) uint8, scale and zero (out, in // group_size) in w's dtype."""
    scale, zero = (t.to(w.dtype) for t in int4_params(w, group_size))  # round to storage first
    groups = w.float().reshape(w.shape[0], -1, group_size)
    q = int4_codes(groups, scale.float()[..., None], zero.float()[..., None])
    return q.reshape(w.shape), scale, zero


def dequantize_int4(q, scale, zero):
    """codes (out, in), scale and zero (out, n_groups) -> fp32 (out, in)."""
    groups = q.float().reshape(*scale.shape, -1)  # (out, n_groups, group_size)
    return (groups * scale.float()[..., None] - zero.float()[..., None]).reshape(q.shape)


def pack_int4(q):
    """(out, in) codes in [0, 15] -> (out, in // 2) uint8: column 2i in the low nibble, 2i+1 high."""
    return q[:, ::2] | (q[:, 1::2] << 4)


def unpack_int4(packed):
    """(out, in // 2) uint8 -> (out, in) uint8 codes."""
    return torch.stack([packed & 15, packed >> 4], dim=-1).flatten(-2)


class Int4Linear(nn.Module):
    """Packed int4 codes, stored in the order the blockwise matmul reads them: `weight_t`
    (in_features // 2, out_features) uint8, row i holding inputs 2i (low nibble) and 2i + 1.
    As for `model.Linear`, `weight` is the (out, in // 2) view, and state_dict / load_state_dict
    write and read that `weight` (`pack_int4`'s layout), so files keep their format."""
    xla_path = "torch.ops.xla.quantized_matmul, blockwise (u8 packed weight, nibbles split in the graph)"

    def __init__(self, weight, scales, zeros):
        super().__init__()
        self.out_features, self.in_features = weight.shape[0], 2 * weight.shape[1]
        self.group_size = self.in_features // scales.shape[1]
        self.register_buffer("weight_t", weight.t().contiguous())  # (in_features // 2, out_features) uint8
        self.register_buffer("scales", scales)  # (out_features, in_features // group_size)
        self.register_buffer("zeros", zeros)    # (out_features, in_features // group_size)
        self.register_state_dict_post_hook(Linear.save_as_weight)
        self.register_load_state_dict_pre_hook(Linear.load_from_weight)

    @property
    def weight(self):
        return self.weight_t.t()  # (out_features, in_features // 2), a view

    def dequantize(self):
        return dequantize_int4(unpack_int4(self.weight), self.scales, self.zeros)

    def forward(self, x):
        if x.device.type == "xla":
            q = torch.stack([self.weight_t & 15, self.weight_t >> 4], dim=1)  # (in // 2, 2, out): inputs 2i, 2i + 1
            q = q.to(torch.int8).view(-1, self.group_size, self.out_features)  # (n_groups, group_size, out): a reshape
            # In fp32 whatever x's dtype: with a zero point, the block sums of x @ q and of x * zero are both
            # large and nearly cancel; in bf16 each rounds first (bf16 greedy tokens then agreed with fp32's
            # on 93% of positions, 99% this way: tests/test_quantize.py). Decoding is memory-bound: the
            # weight read, int4, is what costs.
            scales, zeros = self.scales.t().float(), self.zeros.t().float()  # (n_groups, out)
            out = torch.ops.xla.quantized_matmul(x.float(), q, scales, zeros, block_size=self.group_size)
            return out.to(x.dtype)
        return F.linear(x, self.dequantize().to(x.dtype))


def int4_linear(q, scale, zero):
    return Int4Linear(pack_int4(q), scale, zero)


# --- GPTQ ------------------------------------------------------------------------------------

def gptq_int4(w, H, group_size, act_order=False, damp=0.01, block_size=128):
    """GPTQ of w (out, in) given H = 2 X^T X / n (in, in) of the layer's inputs X (n, in).

    Returns codes (out, in) uint8, scale and zero (out, in // group_size) in w's dtype.
    act_order quantizes the columns with the largest H diagonal (most input energy) first;
    its group parameters then come from the original weight (the groups stay contiguous).
    """
    dtype, (out, k) = w.dtype, w.shape
    w, H = w.float().clone(), H.float().clone()
    dead = H.diagonal() == 0  # inputs that were always zero: nothing to preserve
    H[dead, dead] = 1
    w[:, dead] = 0
    # Rounded to their storage dtype; refit group by group below unless act_order.
    scale, zero = (t.to(dtype).float() for t in int4_params(w, group_size))
    perm = torch.argsort(H.diagonal(), descending=True) if act_order else torch.arange(k)
    w, H = w[:, perm], H[perm][:, perm]
    H.diagonal().add_(damp * H.diagonal().mean())  # dampening keeps the Cholesky stable
    U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)  # H^-1 = U^T U
    q = torch.zeros(out, k, dtype=torch.uint8)
    block_size = max(block_size // group_size, 1) * group_size  # whole groups per block
    for i1 in range(0, k, block_size):
        i2 = min(i1 + block_size, k)
        err = torch.zeros(out, i2 - i1)
        for j in range(i1, i2):
            col = perm[j].item()
            g = col // group_size
            if not act_order and col % group_size == 0:  # a group starts: fit it to the updated weights
                s, z = int4_params(w[:, j:j + group_size], group_size)  # (out, 1) each
                scale[:, g], zero[:, g] = s[:, 0].to(dtype).float(), z[:, 0].to(dtype).float()
            q[:, j] = int4_codes(w[:, j], scale[:, g], zero[:, g])
            err[:, j - i1] = (w[:, j] - (q[:, j] * scale[:, g] - zero[:, g])) / U[j, j]
            w[:, j + 1:i2] -= err[:, j - i1, None] * U[j, j + 1:i2]  # compensate inside the block
        w[:, i2:] -= err @ U[i1:i2, i2:]  # then the rest, in one matmul
    return q[:, torch.argsort(perm)], scale.to(dtype), zero.to(dtype)


def input_hessian(linear, run):
    """H = 2 X^T X / n over the n input rows `linear` sees while `run()` runs."""
    H, n = torch.zeros(linear.in_features, linear.in_features), 0

    def hook(module, args):
        nonlocal H, n
        x = args[0].reshape(-1, linear.in_features).float()
        H += 2 * x.T @ x
        n += x.shape[0]

    handle = linear.register_forward_pre_hook(hook)
    try:
        run()
    finally:
        handle.remove()
    return H / n


def block_inputs(model, batches):
    """The arguments the first transformer block gets for each calibration batch."""
    inputs = []
    handle = model.layers[0].register_forward_pre_hook(lambda module, args: inputs.append(args))
    try:
        for tokens in batches:
            model(tokens, torch.arange(tokens.shape[1], device=tokens.device))
    finally:
        handle.remove()
    return inputs


def gptq(model, calibration, group_size, act_order, damp, quantize_lm_head):
    """Quantize the model block by block; each block is calibrated on the outputs of the
    blocks before it as already quantized, so later layers absorb earlier layers' error."""
    inputs = block_inputs(model, calibration_batches(model, calibration))
    for layer in model.layers:
        for stage in GPTQ_STAGES:
            linears = {n: layer.get_submodule(n) for n in stage}
            linears = {n: m for n, m in linears.items() if isinstance(m, FLOAT_LINEARS)}  # not yet quantized
            if linears:
                H = input_hessian(next(iter(linears.values())), lambda: [layer(*args) for args in inputs])
            for name, linear in linears.items():
                q, scale, zero = gptq_int4(linear.weight, H, group_size, act_order, damp)
                set_module(layer, name, int4_linear(q, scale, zero))
        inputs = [(layer(*args), *args[1:]) for args in inputs]
    if quantize_lm_head and isinstance(model.lm_head, FLOAT_LINEARS):
        H = input_hessian(model.lm_head, lambda: [model.lm_head(model.norm(args[0])) for args in inputs])
        model.lm_head = int4_linear(*gptq_int4(model.lm_head.weight, H, group_size, act_order, damp))


def calibration_batches(model, calibration):
    """A (n, seqlen) token tensor or a list of them, as batches of at most max_batch_size rows."""
    tensors = [calibration] if torch.is_tensor(calibration) else list(calibration)
    return [b for t in tensors for b in t.split(model.args.max_batch_size)]


# --- the model -------------------------------------------------------------------------------

def set_module(root, name, module):
    owner, _, leaf = name.rpartition(".")
    setattr(root.get_submodule(owner) if owner else root, leaf, module)


def targets(model, quantize_lm_head):
    """{name: float linear layer} that the schemes quantize."""
    names = [f"layers.{i}.{n}" for i in range(len(model.layers)) for n in BLOCK_LINEARS]
    names += ["lm_head"] * quantize_lm_head
    modules = {n: model.get_submodule(n) for n in names}
    return {n: m for n, m in modules.items() if isinstance(m, FLOAT_LINEARS)}


def check_args(model, linears, scheme, group_size, calibration):
    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; known schemes: {', '.join(SCHEMES)}")
    if scheme == "int8":
        return
    if not isinstance(group_size, int) or group_size < 2 or group_size % 2:
        raise ValueError(f"group_size={group_size!r} must be an even integer >= 2 (usually 32, 64 or 128)")
    for name, linear in linears.items():
        k = linear.in_features
        if k % group_size:
            fits = [str(s) for s in (16, 32, 64, 128, 256) if k % s == 0] or ["none of 16..256"]
            raise ValueError(f"group_size={group_size} does not divide {name}.in_features={k}; "
                             f"group sizes that fit it: {', '.join(fits)}")
    if scheme == "gptq-int4":
        check_calibration(model, calibration)


def check_calibration(model, calibration):
    if calibration is None or (not torch.is_tensor(calibration) and len(calibration) == 0):
        raise ValueError("scheme 'gptq-int4' needs calibration data: a (n, seqlen) tensor of token "
                         "ids (or a list of them), e.g. chunks of training text")
    for t in [calibration] if torch.is_tensor(calibration) else calibration:
        max_seq_len = model.args.max_seq_len
        if t.dim() != 2 or t.dtype.is_floating_point or not 0 < t.shape[1] <= max_seq_len:
            raise ValueError(f"calibration batch of shape {tuple(t.shape)} and dtype {t.dtype}: expected "
                             f"integer token ids (n, seqlen) with 0 < seqlen <= max_seq_len={max_seq_len}")


@torch.no_grad()
def quantize(model, scheme, group_size=128, calibration=None, quantize_lm_head=False, act_order=False,
             damp=0.01):
    """Replace the model's block Linears (and lm_head if asked) by weight-only quantized ones.

    scheme: "int8" (per output channel; group_size is ignored), "int4" (groups of
    group_size inputs, round to nearest) or "gptq-int4" (needs calibration: token ids
    (n, seqlen) or a list of such batches; act_order and damp, the fraction of the mean
    Hessian diagonal added to it, are GPTQ's options). Layers already quantized are left
    alone. Checks everything before it changes a weight. Returns the model, changed in place.
    Run it on the CPU (GPTQ's column loop is host code), then move the model to its device.
    """
    linears = targets(model, quantize_lm_head)
    check_args(model, linears, scheme, group_size, calibration)
    if scheme == "gptq-int4":
        gptq(model, calibration, group_size, act_order, damp, quantize_lm_head)
        return model
    for name, linear in linears.items():
        if scheme == "int8":
            set_module(model, name, Int8Linear(*quantize_int8(linear.weight)))
        else:
            set_module(model, name, int4_linear(*quantize_int4(linear.weight, group_size)))
    return model


def weight_bytes(model):
    """Bytes of every stored weight: integer codes, scales, zeros and unquantized tensors
    (the KV cache and RoPE tables are not weights; a tied weight counts once)."""
    tensors = {id(t): t for t in model.state_dict(keep_vars=True).values()}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def save_quantized(model, path):
    """Write the model's weights as stored (int8 / packed uint8 codes, scales, zeros) to safetensors."""
    state = {name: t.detach().cpu().contiguous() for name, t in model.state_dict().items()}
    if model.lm_head.weight is model.embed_tokens.weight:  # tied: stored once, as the embedding
        del state["lm_head.weight"]
    save_file(state, path)


def load_quantized(model, path):
    """Load a `save_quantized` file into an unquantized `Llama` of the same shape (its weights,
    possibly on "meta", are replaced): each Linear stored as int8 / uint8 becomes Int8Linear /
    Int4Linear. ValueError names the first tensor that does not fit. Returns the model."""
    state = load_file(path)
    stored = {name: stored_linear(state, name) for name, module in model.named_modules()
              if isinstance(module, FLOAT_LINEARS) and f"{name}.scales" in state}
    for name, quantized in stored.items():
        expected = model.get_submodule(name)
        if (quantized.out_features, quantized.in_features) != (expected.out_features, expected.in_features):
            raise ValueError(f"checkpoint layer {name!r} is out x in = {quantized.out_features} x "
                             f"{quantized.in_features}, the model expects {expected.out_features} x "
                             f"{expected.in_features}")
    for name, quantized in stored.items():
        set_module(model, name, quantized)
    tied = model.args.tie_word_embeddings and isinstance(model.lm_head, FLOAT_LINEARS)
    if tied:  # saved once, as embed_tokens
        state["lm_head.weight"] = state.get("embed_tokens.weight")
    check_state_dict(model, state)
    model.load_state_dict(state, assign=True)
    if tied:
        model.lm_head.weight = model.embed_tokens.weight
    model.init_buffers()
    return model.eval()


def stored_linear(state, name):
    weight, scales = state[f"{name}.weight"], state[f"{name}.scales"]
    if weight.dtype == torch.int8:
        return Int8Linear(weight, scales)
    return Int4Linear(weight, scales, state[f"{name}.zeros"])
