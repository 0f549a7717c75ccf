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


def kv_cache_bytes(config, batch_size, max_seq_len, bytes_per_value=2):
    """KV cache = layers * 2 (K and V) * batch * seq * n_kv_heads * head_dim * bytes.

    The LLaMA 65B latency post writes `dim` for n_kv_heads * head_dim, which is
    the same for multi-head attention; with GQA the cache shrinks by heads / kv_heads.
    """
    _check_positive(batch_size=batch_size, max_seq_len=max_seq_len, bytes_per_value=bytes_per_value)
    per_token = config.num_key_value_heads * config.head_dim * bytes_per_value
    return config.num_hidden_layers * 2 * batch_size * max_seq_len * per_token


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

    quantization is "bf16" (2 bytes/param), "int8" (1) or "int4" (0.5), weight-only.
    """
    hbm = _lookup(HBM_BYTES, chip, "chip")
    weights = param_bytes(config, _lookup(BYTES_PER_PARAM, quantization, "quantization"))
    cache = kv_cache_bytes(config, batch_size, max_seq_len)
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
