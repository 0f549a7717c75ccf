"""Back-of-the-envelope arithmetic: parameters, FLOPs, MFU, memory, chips, cost.

Each function is one formula from a source post, so a notebook can print the post's number
next to ours. Nothing here touches a device except `count_compiles`. The posts:

- the Llama 2 post: "High-Performance Llama 2 Training and Inference with PyTorch/XLA on Cloud
  TPUs", PyTorch blog, https://pytorch.org/blog/high-performance-llama-2/
- the LLaMA 65B latency post: "The Path to Achieve Ultra-Low Inference Latency With LLaMA 65B
  on PyTorch/XLA", PyTorch blog, https://pytorch.org/blog/path-achieve-low-inference-latency/
- the FSDP post: "Maximizing Training Throughput Using PyTorch FSDP", PyTorch blog,
  https://pytorch.org/blog/maximizing-training/

    cfg = get_config("llama2-70b")
    mfu(370, cfg, seq_len=4096, peak_flops=PEAK_FLOPS["a100"])   # ~0.53 (post: 0.50)
    plan(get_config("llama-175b"), "tpu-v4", 1, 256, "int8")["min_chips"]   # 8 = v4-16
"""
import math
from dataclasses import dataclass

# Dense bf16 peak FLOP/s per chip (vendor spec sheets; H100 is the SXM part without sparsity).
PEAK_FLOPS = {
    "tpu-v4": 275e12,
    "tpu-v5e": 197e12,
    "tpu-v5p": 459e12,
    "tpu-v6e": 918e12,
    "a100": 312e12,
    "h100": 989e12,
}

# HBM per chip in bytes. Cloud TPU docs give these in GiB (2**30 bytes). The LLaMA 65B
# latency post writes "32GB" for v4 and its Table 2 divides by 32e9 (decimal GB):
# pass hbm_bytes=32e9 to min_chips to reproduce that table.
GiB = 2**30
HBM_BYTES = {
    "tpu-v4": 32 * GiB,
    "tpu-v5e": 16 * GiB,
    "tpu-v5p": 95 * GiB,
    "tpu-v6e": 32 * GiB,
}

# Published HBM bandwidth per chip in bytes/s (decimal GB/s), from each chip's Cloud TPU page:
# https://cloud.google.com/tpu/docs/v4 ("32 GiB, 1200 GBps"), .../v5e ("16 GB, 819 GBps"),
# .../v5p ("95 GB, 2765 GBps"), .../v6e ("HBM bandwidth per chip 1638 GBps"; older revisions of
# that page say 1600). `doctor` compares a measured copy with these.
HBM_BANDWIDTH = {
    "tpu-v4": 1200e9,
    "tpu-v5e": 819e9,
    "tpu-v5p": 2765e9,
    "tpu-v6e": 1638e9,
}

# Bidirectional inter-chip interconnect (ICI) bandwidth per chip in bytes/s, from the same pages:
# v5e "400 GBps", v5p "1200 GBps", v6e "800 GBps". The v4 page gives no per-chip figure (only
# 24 TB/s of bisection bandwidth per 4,096-chip pod), so v4 has none here.
ICI_BANDWIDTH = {
    "tpu-v5e": 400e9,
    "tpu-v5p": 1200e9,
    "tpu-v6e": 800e9,
}

# Bytes per weight for plan(); weight-only quantization, the KV cache stays bf16.
BYTES_PER_PARAM = {"bf16": 2, "int8": 1, "int4": 0.5}


def _check_positive(**values):
    for name, value in values.items():
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value!r}")


def _lookup(table, key, what):
    if key not in table:
        raise ValueError(f"unknown {what} {key!r}; allowed: {', '.join(table)}")
    return table[key]


def param_count(config):
    """Exact parameter count of HF `LlamaForCausalLM(config)` (Llama has no biases).

    embeddings V*d + per layer [q, o: d*H*hd; k, v: d*KV*hd; SwiGLU gate/up/down: 3*d*I;
    2 RMSNorms: 2*d] + final norm d + lm_head V*d unless tied to the embeddings.
    """
    d, hd, V = config.hidden_size, config.head_dim, config.vocab_size
    attn = 2 * d * config.num_attention_heads * hd + 2 * d * config.num_key_value_heads * hd
    mlp = 3 * d * config.intermediate_size
    layer = attn + mlp + 2 * d
    lm_head = 0 if config.tie_word_embeddings else V * d
    return V * d + config.num_hidden_layers * layer + d + lm_head


def approx_params(config):
    """N = 12 * d**2 * n_layers: the LLaMA 65B latency post's sizing formula.

    4*d**2 for attention plus 8*d**2 for the MLP; ignores embeddings, norms, GQA and the
    real MLP width, so compare it with `param_count` before trusting it.
    """
    return 12 * config.hidden_size**2 * config.num_hidden_layers


def flops_per_token(config, seq_len):
    """Training FLOPs per token: 6*N + 12*L*H*Q*T (PaLM appendix B, nanoGPT estimate_mfu).

    N counts the weights that do a matmul per token: every parameter except an untied
    input embedding table, which is only a lookup (nanoGPT keeps its tied wte in N because
    it is the output layer). L layers, H query heads, Q head_dim, T = seq_len. This is the
    method the FSDP post names for its MFU column.
    """
    _check_positive(seq_len=seq_len)
    lookup_only = 0 if config.tie_word_embeddings else config.vocab_size * config.hidden_size
    n = param_count(config) - lookup_only
    attn = 12 * config.num_hidden_layers * config.num_attention_heads * config.head_dim * seq_len
    return 6 * n + attn


def mfu(tokens_per_sec_per_chip, config, seq_len, peak_flops):
    """Model FLOPs utilization = tokens/s/chip * flops_per_token / peak FLOP/s per chip.

    Model FLOPs ignore recomputation (activation checkpointing), unlike HFU (the FSDP post).
    """
    _check_positive(tokens_per_sec_per_chip=tokens_per_sec_per_chip, peak_flops=peak_flops)
    return tokens_per_sec_per_chip * flops_per_token(config, seq_len) / peak_flops


def param_bytes(config, bytes_per_param=2):
    """Weight memory = param_count * bytes_per_param (2 for bf16), rounded up to whole bytes."""
    _check_positive(bytes_per_param=bytes_per_param)
    return math.ceil(param_count(config) * bytes_per_param)


def kv_cache_bytes(config, batch_size, max_seq_len, bytes_per_value=2, head_dim=None):
    """KV cache = layers * 2 (K and V) * batch * seq * n_kv_heads * head_dim * bytes.

    The LLaMA 65B latency post writes `dim` for n_kv_heads * head_dim, which is
    the same for multi-head attention; with GQA the cache shrinks by heads / kv_heads.
    head_dim: the cache's, if not the config's (a TPU's pages hold `kernel_head_dim`).
    """
    _check_positive(batch_size=batch_size, max_seq_len=max_seq_len, bytes_per_value=bytes_per_value)
    per_token = config.num_key_value_heads * (head_dim or config.head_dim) * bytes_per_value
    return config.num_hidden_layers * 2 * batch_size * max_seq_len * per_token


def kernel_head_dim(head_dim):
    """The head_dim of the serving engine's pages on a TPU: a multiple of 128, the ragged paged
    attention kernel's lanes (64 -> 128, as vLLM pads it). The padding is zeros, so scores and
    outputs are the unpadded ones; the cache's bytes grow by the same factor (Llama 3.2 1B's double)."""
    return -(-head_dim // 128) * 128


def min_chips(total_bytes, hbm_bytes, power_of_two=True):
    """Smallest chip count whose HBM holds total_bytes.

    ceil(total_bytes / hbm_bytes), rounded up to a power of two by default because TPU
    slices and even mesh axes come in powers of two (v4-16 = 8 chips: a v4-N name counts
    TensorCores, 2 per chip). power_of_two=False gives the bare ceiling, which is what
    Table 2 of the LLaMA 65B latency post lists (3, 5, 11 chips).
    Ignores activations and XLA scratch space, so it is a lower bound.
    """
    _check_positive(total_bytes=total_bytes, hbm_bytes=hbm_bytes)
    chips = math.ceil(total_bytes / hbm_bytes)
    return 1 << (chips - 1).bit_length() if power_of_two else chips


def plan(config, chip, batch_size, max_seq_len, quantization="bf16"):
    """Serving memory plan: weights + bf16 KV cache, and the chips that hold them (LLaMA 65B latency post).

    quantization is "bf16" (2 bytes/param), "int8" (1) or "int4" (0.5), weight-only. The cache is
    counted as the engine's pages hold it on a TPU, head_dim padded to 128 (`kernel_head_dim`).
    """
    hbm = _lookup(HBM_BYTES, chip, "chip")
    weights = param_bytes(config, _lookup(BYTES_PER_PARAM, quantization, "quantization"))
    cache = kv_cache_bytes(config, batch_size, max_seq_len, head_dim=kernel_head_dim(config.head_dim))
    return {
        "chip": chip,
        "quantization": quantization,
        "weight_bytes": weights,
        "cache_bytes": cache,
        "total_bytes": weights + cache,
        "hbm_bytes_per_chip": hbm,
        "min_chips": min_chips(weights + cache, hbm),
    }


def cost_per_1k_tokens(tokens_per_sec_per_chip, price_per_chip_hour):
    """Dollars per 1,000 generated tokens = price per chip-hour / (tokens/s/chip * 3600) * 1000.

    The Llama 2 post quotes $0.0036 per 1,000 tokens for 70B int8 on v5e.
    """
    _check_positive(tokens_per_sec_per_chip=tokens_per_sec_per_chip,
                    price_per_chip_hour=price_per_chip_hour)
    return price_per_chip_hour / (tokens_per_sec_per_chip * 3600) * 1000


def count_compiles():
    """Number of XLA graph compilations so far in this process (0 before the first one).

    Call it before and after a step: a difference > 0 on a warm step means a recompile.
    """
    import torch_xla.debug.metrics as met

    data = met.metric_data("CompileTime")
    return data[0] if data else 0


def compile_seconds():
    """Seconds spent compiling XLA graphs so far in this process; take the difference of two calls
    to get the time spent compiling between them."""
    import torch_xla.debug.metrics as met

    data = met.metric_data("CompileTime")  # (count, total nanoseconds, samples)
    return data[1] / 1e9 if data else 0.0


def roofline(chip, flops=0, hbm_bytes=0, ici_bytes=0):
    """Lower bounds in seconds on a step that, per chip, does `flops`, moves `hbm_bytes` through
    HBM and `ici_bytes` over ICI, each at the chip's published peak. The step takes at least the
    largest of them; overlapping (XLA's async collectives) can hide the others, never beat it."""
    times = {"compute": flops / _lookup(PEAK_FLOPS, chip, "chip"),
             "memory": hbm_bytes / _lookup(HBM_BANDWIDTH, chip, "chip with a published HBM bandwidth")}
    if ici_bytes:
        times["ici"] = ici_bytes / _lookup(ICI_BANDWIDTH, chip, "chip with a published ICI bandwidth")
    return times


def critical_batch(chip, bytes_per_param=2):
    """The batch (rows per decode step, or tokens per chip in a training matmul) above which a
    matmul over the weights is compute-bound rather than HBM-bound on `chip`.

    Each weight is read once (bytes_per_param) and does 2 FLOPs per row: arithmetic intensity
    2 * batch / bytes_per_param FLOPs per byte, against the chip's peak FLOP/s / HBM bytes/s.
    """
    hbm = _lookup(HBM_BANDWIDTH, chip, "chip with a published HBM bandwidth")
    return PEAK_FLOPS[chip] / hbm * bytes_per_param / 2


# ---------------------------------------------------------------------------------------------
# Training memory plan: parameters, gradients, optimizer state and activations per chip.

TRAIN_DTYPE_BYTES = {"fp32": 4, "bf16": 2}  # parameter dtypes, by the names train.py takes
OPTIMIZERS = ("adamw", "adafactor")         # optim.AdamW, optim.Adafactor
ATTENTIONS = ("eager", "blockwise", "flash")  # attention.py's: Table 2's eager, the blockwise loop, the TPU kernel


class _MeshShape:
    """What `sharding.param_spec` and `sharding.axis_size` read of a torch_xla Mesh (its axis names
    and their sizes), without devices: a plan for a v5p-512 runs on a laptop."""

    def __init__(self, shape, axis_names=("data", "model")):
        self.axis_names = tuple(axis_names)
        self._sizes = dict(zip(self.axis_names, shape))

    def shape(self):
        return dict(self._sizes)

    def size(self):
        return math.prod(self._sizes.values())


_PARAM_SHAPES = {}  # config JSON -> [(name, shape)]


def _param_shapes(config):
    """[(name, shape)] of LlamaForCausalLM(config)'s parameters, built on the meta device (no memory);
    a tied lm_head is the embedding's tensor and appears once, under the embedding's name."""
    key = config.to_json_string()
    if key not in _PARAM_SHAPES:
        import torch
        from transformers import LlamaForCausalLM

        with torch.device("meta"):
            model = LlamaForCausalLM(config)
        _PARAM_SHAPES[key] = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    return _PARAM_SHAPES[key]


def _shard_elements(shape, spec, mesh):
    """Elements per device of a tensor of `shape` split by `spec` (a partition spec) on `mesh`,
    each dimension rounded up as `sharding.shard_shape` reads it from XLA."""
    from .sharding import axis_size

    return math.prod(-(-n // (1 if axes is None else axis_size(mesh, axes))) for n, axes in zip(shape, spec))


def _int_at_least_1(**values):
    for name, (value, what) in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r} must be an int >= 1 ({what})")


@dataclass(frozen=True)
class TrainingPlan:
    """Bytes per chip of one training step (see `plan_training`) and, per TPU generation in
    HBM_BYTES, whether they fit in its HBM."""
    mesh_shape: tuple
    strategy: str
    batch: int
    seq_len: int
    dtype: str
    optimizer: str
    remat: bool
    attention: str
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    gathered_bytes: int  # weights gathered for one layer's matmuls, and their gradients before the reduction
    total_bytes: int
    fits: dict  # chip -> total_bytes <= HBM_BYTES[chip]

    def hbm_fraction(self, chip):
        """total_bytes as a fraction of `chip`'s HBM."""
        return self.total_bytes / _lookup(HBM_BYTES, chip, "chip")


def activation_bytes(config, batch, seq_len, dtype="bf16", remat=False, attention="eager", data=1, model=1,
                     block=None):
    """Peak bytes per chip of a training step's activations: what the forward pass saves for the
    backward pass, plus the backward pass's largest transient gradients, for HF's LlamaForCausalLM
    trained as train.py does (norms, softmax, logits and loss in fp32; the rest in `dtype`).

    data / model: how many ways the batch and Table 2's last dims (hidden, heads, MLP width, vocab)
    are split per chip (`plan_training` passes the mesh's; 1 and 1: one chip). Saved per decoder
    layer, with b = batch / data sequences, s = seq_len, p = bytes of `dtype`, X' = ceil(X / model):
      2 RMSNorms, each: its input in fp32, the normalized value and the output (x weight):
                                                           2 * (4 + 2p) * b s d'
      q after RoPE, k and v repeated to the query heads (GQA), attention output:
                                                           4 * p * b s H' hd
      eager: the softmax output, fp32 (a bf16 copy too for bf16):   (4 [+ p]) * b H' s^2
      flash (torch_xla's kernel saves q, k and v repeated, the output and each row's max and
      sum, fp32): no s x s matrix:                                  2 * 4 * b H' s
      blockwise (attention.py: k and v not repeated, G' = KV heads per chip; one fp32 log-sum-exp
      per row): 2 * p * b s H' hd + 2 * p * b s G' hd + 4 * b H' s in place of the q, k, v, output line
      SwiGLU: gate, silu(gate), up, their product:         4 * p * b s I'
      the norms' 1/rms per token, fp32:                    2 * 4 * b s
    After the layers: the final norm (4 + 2p) b s d' + 4 b s, and the fp32 log-softmax of the
    logits (cross-entropy's saved output) 4 b s V'.
    Transients of the backward pass, of which the peak holds the largest, after the saved tensors
    of the layers still to go: at the loss, the gradients of the log-probabilities and of the fp32
    logits, 8 b s V' (for bf16 the logits' bf16 gradient comes once those two are freed); in a layer,
    eager attention's gradients of the softmax output and of the scores, 2 * 4 * b H' s^2 (blockwise:
    one block pair's scores, probabilities and their gradient in fp32 and the scores' gradient,
    (12 + p) * b H' B^2 for blocks of B = min(block, s) tokens, block defaulting to attention.BLOCK;
    flash: none, the kernel's blocks live in the TPU core's VMEM), or the MLP's of gate, up and
    their product, 3 p b s I', whichever is larger. These are eager PyTorch's
    tensors; XLA may fuse some away (the loss's) or keep more (its schedule decides what is live).
    remat=False: L * layer + max(tail + loss transients, layer transients).
    remat=True (gradient checkpointing per decoder layer): each layer's input, L * p * b s d', plus
    the larger of the tail with its transients and one layer recomputed with its transients.
    Not counted: the int64 token ids, the causal mask (XLA builds it inside the fusions that read it),
    RoPE's cos and sin (s * hd each), and XLA's own scratch (collective buffers, layout copies); for
    flash, torch_xla 2.9's backward transients (each row's max, sum and dO.O broadcast to 128 lanes,
    fp32: 3 * 512 * b H' s bytes) and the padding of a length the kernel does not take
    (`attention.flash_length`: 192 runs at 256).
    """
    _int_at_least_1(batch=(batch, "sequences per step, over all data shards"), seq_len=(seq_len, "tokens per sequence"),
                    data=(data, "ways the batch is split"), model=(model, "ways Table 2 splits the last dims"))
    p = _lookup(TRAIN_DTYPE_BYTES, dtype, "dtype")
    _lookup(dict.fromkeys(ATTENTIONS), attention, "attention")
    if batch % data:
        raise ValueError(f"batch={batch} is not divisible by the 'data' axis of size {data}; use a multiple of {data}")
    split = lambda n: -(-n // model)
    b, s = batch // data, seq_len
    d, H, hd = split(config.hidden_size), split(config.num_attention_heads), config.head_dim
    mlp, vocab = b * s * split(config.intermediate_size), b * s * split(config.vocab_size)
    hidden, heads = b * s * d, b * s * H * hd
    scores = b * H * s * s
    norms = 2 * (4 + 2 * p) * hidden + 2 * 4 * b * s
    if attention == "eager":
        attn = 4 * p * heads + (4 if p == 4 else 4 + p) * scores
        attn_transient = 2 * 4 * scores
    elif attention == "flash":
        attn = 4 * p * heads + 2 * 4 * b * H * s
        attn_transient = 0
    else:
        from .attention import BLOCK
        B = min(block or BLOCK, s)
        attn = 2 * p * heads + 2 * p * b * s * split(config.num_key_value_heads) * hd + 4 * b * H * s
        attn_transient = (12 + p) * b * H * B * B
    layer = norms + attn + 4 * p * mlp
    layer_transient = max(attn_transient, 3 * p * mlp)
    tail = (4 + 2 * p) * hidden + 4 * b * s + 4 * vocab
    tail_transient = 8 * vocab
    L = config.num_hidden_layers
    if not remat:
        return L * layer + max(tail + tail_transient, layer_transient)
    inputs = L * p * hidden
    recomputed = layer - (4 * hidden if p == 4 else 0)  # in fp32 the first norm's input is the saved input
    return inputs + max(tail + tail_transient, recomputed + layer_transient)


def plan_training(config, mesh_shape, strategy, batch, seq_len, dtype="bf16", optimizer="adamw", remat=False, *,
                  attention="eager", master_weights=True, block=None, lora=None):
    """Training memory plan per chip: parameters, gradients, optimizer state and activations, their
    total, and whether it fits in the HBM of each TPU generation in HBM_BYTES (a TrainingPlan).

    config: a LlamaConfig (configs.get_config); mesh_shape: (data, model) chips; strategy: "2d"
    (Tables 1 and 2 of the Llama 2 post) or "fsdp" (sharding.param_spec); batch: global sequences
    per step; dtype: the parameters', "bf16" or "fp32"; optimizer: "adamw" or "adafactor"
    (llama_xla_helpers.optim); remat: gradient checkpointing per decoder layer (TrainConfig's
    gradient_checkpointing); attention: attention.py's implementation, "eager" (Table 2's s x s
    scores), "blockwise" (the loop a CPU trains with; block: its tokens per block, default
    attention.BLOCK) or "flash" (torch_xla's kernel, what a TPU trains with; MaxText's and
    torchprime's published runs use such kernels); master_weights: the optimizers' fp32 copy of
    bf16 parameters (on by default, as in optim); lora: a lora.LoraConfig, for LoRA fine-tuning.

    Parameters: each tensor's shard, split as sharding.param_spec splits it on this mesh (rounded
    up per dim as shard_shape reads it). Gradients: one per parameter, its dtype and split.
    Optimizer state, fp32: AdamW two moments per parameter; Adafactor per 2-D weight a row and a
    column vector (the weight's spec without its last, or its first, dim), per 1-D weight a full
    second moment; for bf16 parameters the fp32 master copy (parameter's split); a 0-d step per
    tensor. Under "2d" the moments of a norm weight (replicated) are split over 'model' like the
    hidden dim of the activations its gradient is reduced from: XLA propagates that split to the
    state the first step creates (measured: tests/test_plan_training.py); its master copy is not.
    Activations: `activation_bytes`, the batch split over 'data' and, under "2d", Table 2's last dims
    over 'model'. Gathered: the weights XLA all-gathers for one layer's matmuls (the whole layer
    under FSDP; split over 'model' under 2D, whose Table 1 puts the hidden dim on 'data', which the
    batch holds) and their gradients before the reduce-scatter, for the larger of a decoder layer
    and the lm_head; the XLA schedule may hold more than one layer's (prefetch).
    total = parameters + gradients + optimizer state + activations + gathered.

    LoRA (`lora.add`): every weight frozen, in `dtype` (the targets in int8 with lora.int8: a byte
    per weight and a scale per row); gradients and optimizer state for the adapters only, A
    (rank, in) with spec (None, in's) and B (out, rank) with (out's, None). Activations as for full
    training (the adapters' rank-r ones are small); gathered: a layer's weights without gradients.
    """
    from . import sharding

    if not (isinstance(mesh_shape, (tuple, list)) and len(mesh_shape) == 2 and
            all(isinstance(k, int) and not isinstance(k, bool) and k >= 1 for k in mesh_shape)):
        raise ValueError(f"mesh_shape={mesh_shape!r} must be two ints >= 1, (data, model) chips, e.g. (4, 2)")
    if strategy not in sharding.STRATEGIES:
        raise ValueError(f"strategy={strategy!r} is not one of {', '.join(sharding.STRATEGIES)}")
    for name, value, allowed in (("dtype", dtype, TRAIN_DTYPE_BYTES), ("optimizer", optimizer, OPTIMIZERS),
                                 ("attention", attention, ATTENTIONS)):
        if value not in allowed:
            raise ValueError(f"{name}={value!r} is not one of {', '.join(allowed)}")
    _int_at_least_1(batch=(batch, "global sequences per step"), seq_len=(seq_len, "tokens per sequence"))
    data, model = mesh_shape
    if batch % data:
        raise ValueError(f"batch={batch} is not divisible by the 'data' axis of size {data}; use a multiple of "
                         f"{data} (e.g. {data * max(1, batch // data)})")
    mesh = _MeshShape(mesh_shape)
    if strategy == "2d":  # what shard_activations checks before annotating Table 2
        for what, size in [("hidden_size", config.hidden_size), ("num_attention_heads", config.num_attention_heads),
                           ("num_key_value_heads * head_dim", config.num_key_value_heads * config.head_dim),
                           ("intermediate_size", config.intermediate_size), ("vocab_size", config.vocab_size)]:
            if size % model:
                raise ValueError(f"{what}={size} is not divisible by mesh axis 'model' of size {model}, which "
                                 f"splits it in Table 2; use a mesh whose 'model' axis has size "
                                 f"{sharding.sizes_that_fit(size, mesh)}")
    p = TRAIN_DTYPE_BYTES[dtype]

    def optimizer_state(shape, spec, n):  # fp32 bytes per chip of one trained tensor's state
        if optimizer == "adamw":
            moments = 2 * (n if len(shape) > 1 or strategy != "2d" else _shard_elements(shape, ("model",), mesh))
        elif len(shape) >= 2:  # Adafactor: row and column second moments
            moments = (_shard_elements(shape[:-1], spec[:-1], mesh) +
                       _shard_elements(shape[:-2] + shape[-1:], spec[:-2] + spec[-1:], mesh))
        else:
            moments = _shard_elements(shape, ("model",) if strategy == "2d" else spec, mesh)
        master = n if master_weights and p != 4 else 0
        return 4 * (moments + master) + 4  # + the 0-d fp32 step

    params = grads = state = frozen = 0  # frozen: LoRA's base bytes per chip
    for name, shape in _param_shapes(config):
        spec = sharding.param_spec(name, shape, mesh, strategy)
        sharding.check_divisible(name, shape, spec, mesh)  # shard_params' check: a ValueError naming the fix
        n = _shard_elements(shape, spec, mesh)
        target = lora is not None and len(shape) == 2 and name.rsplit(".", 2)[-2] in lora.targets
        if lora is None:
            params, grads, state = params + n * p, grads + n * p, state + optimizer_state(shape, spec, n)
        elif target and lora.int8:  # int8 codes, and a scale per row in dtype
            frozen += n + _shard_elements(shape[:1], spec[:1], mesh) * p
        else:
            frozen += n * p
        if target:  # the adapters A (rank, in) and B (out, rank)
            for a_shape, a_spec in (((lora.rank, shape[1]), (None, spec[1])), ((shape[0], lora.rank), (spec[0], None))):
                k = _shard_elements(a_shape, a_spec, mesh)
                params, grads, state = params + k * p, grads + k * p, state + optimizer_state(a_shape, a_spec, k)
    params += frozen
    acts = activation_bytes(config, batch, seq_len, dtype, remat, attention, data=data,
                            model=model if strategy == "2d" else 1, block=block)
    # Gathered weights: XLA all-gathers a weight over the axes its matmul cannot use (FSDP: every axis; 2D:
    # 'data', Table 1's hidden split, which the batch holds), and reduces its gradient back: one decoder
    # layer's weights, or the lm_head's if larger, whole (FSDP) or split over 'model' (2D), and their gradient.
    shapes = dict(_param_shapes(config))
    layer = sum(math.prod(v) for n, v in shapes.items() if n.startswith("model.layers.0.") and len(v) > 1)
    head = math.prod(shapes.get("lm_head.weight", shapes["model.embed_tokens.weight"]))
    gathers = data > 1 if strategy == "2d" else data * model > 1  # one chip, or 2D without 'data': nothing to gather
    copies = 2 if lora is None else 1  # the weights, and (unless frozen) their gradients
    gathered = copies * p * -(-max(layer, head) // (model if strategy == "2d" else 1)) if gathers else 0
    total = params + grads + state + acts + gathered
    return TrainingPlan(tuple(mesh_shape), strategy, batch, seq_len, dtype, optimizer, remat, attention,
                        params, grads, state, acts, gathered, total,
                        {chip: total <= hbm for chip, hbm in HBM_BYTES.items()})


def training_table(plans, labels=None, chips=("tpu-v5e", "tpu-v6e", "tpu-v5p")):
    """A text table of TrainingPlans (a notebook prints it): GiB per chip of each part and the
    total, then per chip generation the share of its HBM the total takes ("OOM" above 100%)."""
    from .plots import table

    rows = []
    for i, plan in enumerate(plans):
        row = dict(run=labels[i] if labels else i, mesh=f"{plan.mesh_shape[0]}x{plan.mesh_shape[1]}",
                   strategy=plan.strategy, batch=plan.batch, seq=plan.seq_len,
                   remat="yes" if plan.remat else "no", params=plan.param_bytes, grads=plan.grad_bytes,
                   optimizer=plan.optimizer_bytes, activations=plan.activation_bytes, gathered=plan.gathered_bytes,
                   total=plan.total_bytes)
        row.update({k: f"{v / GiB:.1f}" for k, v in row.items() if k in ("params", "grads", "optimizer",
                                                                          "activations", "gathered", "total")})
        for chip in chips:
            used = plan.hbm_fraction(chip)
            row[chip.replace("tpu-", "")] = f"{used:.0%}" if used <= 1 else f"OOM {used:.0%}"
        rows.append(row)
    return table(rows)


# Published Llama 3 training configurations on TPU slices, as the files cited say them (repository,
# path @ commit, as stored in the index the planner's author read), to print beside plan_training's
# figures for the same shape: `published_training()`. Both projects shard parameters over every chip
# (FSDP) and split the batch the same way, so the plan uses strategy "fsdp" on (chips, 1). What they
# run and the plan models differ: see "differs" of each entry.
_TP = "AI-Hypercomputer/torchprime"
_TP_DEFAULT = (f"{_TP}: torchprime/torch_xla_models/README.md@1d2842b5 ('The default config trains Llama 3.0 8B "
               f"sharded over 4 chips and is tested for v6e'; 'For v5e add data.block_size=1024 to prevent OOM'); "
               f"configs/default.yaml@023aad12 (ici_mesh.fsdp: 4, torch_dtype: bfloat16); configs/task/basic.yaml"
               f"@023aad12 (global_batch_size: 4, optimizer adafactor); configs/data/wikitext.yaml@023aad12 "
               f"(block_size: 8192); configs/model/llama-3-8b.yaml@1504a885 (remat: llama, attention_kernel: "
               f"flash_attention); configs/model/remat/llama.yaml (activation_checkpoint_layers: LlamaDecoderLayer), "
               f"read in the fork weirayao/torchprime@b0bd47e3")
_TP_RECIPES = (f"{_TP}: torchprime/torch_xla_models/README.md@1d2842b5, 'Llama 3.0 8B on v6e-256' (global batch 1024, "
               f"sequence length 8192, ici_mesh.fsdp=256, model/remat=llama-scan, splash_attention, task=basic: "
               f"adafactor) and 'Llama 3.1 70B on v6e-256' (global batch 512, sequence length 8192, fsdp 256, "
               f"model/remat=llama-scan-offload, splash_attention)")
_MT = ("AI-Hypercomputer/maxtext: benchmarks/maxtext_trillium_model_configs.py@02df1543 (trillium = v6e), "
       "{name}: per_device_batch_size {b}, ici_fsdp_parallelism -1 (every chip), remat_policy 'full', "
       "max_target_length 8192, attention 'flash'{extra}; MaxText/configs/base.yml@000e9355 defaults: weight_dtype "
       "float32, dtype (activations) bfloat16, opt_type adamw (a different, older commit than the config)")
_FLASH_TP = ("flash/splash attention (the plan: attention='flash'); torchprime's own Llama, not HF's; whether its "
             "Adafactor keeps fp32 master weights is not in these files (the plan's 'no master' column drops them)")
PUBLISHED_TRAINING = [
    dict(run="torchprime default, Llama 3 8B", model="llama3-8b", chip="tpu-v6e", chips=4, per_device_batch=1,
         seq_len=8192, remat=True, optimizer="adafactor", dtype="bf16", attention="flash",
         outcome="runs (tested for v6e)", source=_TP_DEFAULT, differs=_FLASH_TP),
    dict(run="torchprime default on v5e", model="llama3-8b", chip="tpu-v5e", chips=4, per_device_batch=1,
         seq_len=8192, remat=True, optimizer="adafactor", dtype="bf16", attention="flash",
         outcome="OOM (README: add data.block_size=1024)", source=_TP_DEFAULT, differs=_FLASH_TP),
    dict(run="torchprime default on v5e, block 1024", model="llama3-8b", chip="tpu-v5e", chips=4, per_device_batch=1,
         seq_len=1024, remat=True, optimizer="adafactor", dtype="bf16", attention="flash",
         outcome="runs (README's fix for v5e)", source=_TP_DEFAULT, differs=_FLASH_TP),
    dict(run="torchprime recipe, Llama 3 8B, v6e-256", model="llama3-8b", chip="tpu-v6e", chips=256,
         per_device_batch=4, seq_len=8192, remat=True, optimizer="adafactor", dtype="bf16", attention="flash",
         outcome="published recipe", source=_TP_RECIPES, differs=_FLASH_TP + "; scan over the layers"),
    dict(run="torchprime recipe, Llama 3.1 70B, v6e-256", model="llama3.1-70b", chip="tpu-v6e", chips=256,
         per_device_batch=2, seq_len=8192, remat=True, optimizer="adafactor", dtype="bf16", attention="flash",
         outcome="published recipe, with host offload", source=_TP_RECIPES,
         differs=_FLASH_TP + "; llama-scan-offload moves tensors to host memory, which the plan keeps in HBM"),
    dict(run="MaxText llama3-8b-8192 (v6e)", model="llama3-8b", chip="tpu-v6e", chips=256, per_device_batch=8,
         seq_len=8192, remat=True, optimizer="adamw", dtype="fp32", attention="flash",
         outcome="published benchmark config", source=_MT.format(name="llama3-8b-8192", b=8, extra=""),
         differs="the slice size is not in the file (planned at 256 chips; only the parameter, gradient and "
                 "optimizer shares depend on it); JAX/Flax model; fp32 weights with bf16 activations, which the "
                 "plan cannot express (planned all fp32: its activations count double); flash attention"),
    dict(run="MaxText llama3-70b-8192 (v6e)", model="llama3.1-70b", chip="tpu-v6e", chips=256, per_device_batch=2,
         seq_len=8192, remat=True, optimizer="adamw", dtype="fp32", attention="flash",
         outcome="published benchmark config, optimizer state on host",
         source=_MT.format(name="llama3-70b-8192", b=2, extra=", optimizer_memory_host_offload True"),
         differs="as the 8B entry; Llama 3 70B has Llama 3.1 70B's dims (only RoPE scaling and context differ); "
                 "its optimizer state lives in host memory, which the plan counts in HBM"),
]


def published_training(entries=None):
    """One row per PUBLISHED_TRAINING entry: their shape and outcome beside plan_training's total per
    chip for it (GiB, with and without fp32 master weights) and the share of the chip's HBM it takes."""
    from .configs import get_config

    rows = []
    for e in entries or PUBLISHED_TRAINING:
        kwargs = dict(config=get_config(e["model"]), mesh_shape=(e["chips"], 1), strategy="fsdp",
                      batch=e["per_device_batch"] * e["chips"], seq_len=e["seq_len"], dtype=e["dtype"],
                      optimizer=e["optimizer"], remat=e["remat"], attention=e["attention"])
        plan, bare = plan_training(**kwargs), plan_training(**kwargs, master_weights=False)
        rows.append(dict(run=e["run"], chip=f"{e['chip'].replace('tpu-', '')} x{e['chips']}",
                         batch_per_chip=e["per_device_batch"], seq=e["seq_len"], outcome=e["outcome"],
                         plan_GiB=f"{plan.total_bytes / GiB:.1f}", no_master_GiB=f"{bare.total_bytes / GiB:.1f}",
                         plan_HBM=f"{plan.hbm_fraction(e['chip']):.0%}", plan=plan))
    return rows
