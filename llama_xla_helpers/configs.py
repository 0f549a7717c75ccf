"""Named Llama model configs as `transformers.LlamaConfig`.

    cfg = get_config("llama2-70b")                 # published dims
    cfg = get_config("tiny", num_key_value_heads=8)  # any LlamaConfig field can be overridden

Only `tiny` (and `micro`, tiny with 2 layers, for the tests) is small enough to instantiate on a
CPU; the others are for sizing (metrics.plan, metrics.flops_per_token), for meta-device sharding
demos, and (`llama3.2-1b`, the mid-size one) for training on a TPU. `llama-175b` is
the hypothetical model of the LLaMA 65B latency post: "The Path to Achieve Ultra-Low Inference
Latency With LLaMA 65B on PyTorch/XLA", PyTorch blog,
https://pytorch.org/blog/path-achieve-low-inference-latency/
"""
import copy
import inspect

from transformers import LlamaConfig, PretrainedConfig

# The published hyper-parameters (Meta's params.json / the Hugging Face config.json of each
# release). Fields not listed keep LlamaConfig's defaults, which are Llama 1/2's:
# bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, no biases.
# Transformers 5 keeps RoPE's base (theta) and any long-context scaling in `rope_parameters`.
ROPE_10K = dict(rope_type="default", rope_theta=10000.0)

# Byte-level model for CPU runs: 256 byte ids + BOS (256) + EOS (257), padded to 264 so every mesh
# axis up to 8 divides the vocabulary; MLP width 384 so int4 groups of 32, 64 and 128 divide it.
TINY = dict(
    vocab_size=264, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
    num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
    rope_parameters=ROPE_10K, rms_norm_eps=1e-5, tie_word_embeddings=False,
    bos_token_id=256, eos_token_id=257, pad_token_id=None,
)

CONFIGS = {
    "tiny": TINY,
    # tiny with 2 layers: what a check of the machinery trains (the tests), where the layer count is not
    # the point; XLA:CPU compiles its training step in about 70% of tiny's time.
    "micro": dict(TINY, num_hidden_layers=2),
    # The benchmarks' one decode model (benchmarks/decode.py, quantize.py and serve.py): 56M
    # parameters, 16M of them in the output layer, so that a decode step streams its weights from
    # memory, not from the CPU's caches. Random weights, token ids anywhere in the vocabulary.
    # MLP 1376 = 43 x 32: int4 groups of 32 divide it (quantize.py), groups of 128 do not.
    "bench": dict(TINY, vocab_size=32000, hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                  num_attention_heads=8, num_key_value_heads=4, initializer_range=0.2),
    # LLaMA 1 (Touvron et al. 2023, Table 2).
    "llama-7b": dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=2048,
        rope_parameters=ROPE_10K, rms_norm_eps=1e-6,
    ),
    "llama-33b": dict(
        vocab_size=32000, hidden_size=6656, intermediate_size=17920, num_hidden_layers=60,
        num_attention_heads=52, num_key_value_heads=52, max_position_embeddings=2048,
        rope_parameters=ROPE_10K, rms_norm_eps=1e-6,
    ),
    "llama-65b": dict(
        vocab_size=32000, hidden_size=8192, intermediate_size=22016, num_hidden_layers=80,
        num_attention_heads=64, num_key_value_heads=64, max_position_embeddings=2048,
        rope_parameters=ROPE_10K, rms_norm_eps=1e-6,
    ),
    # OPT-175B's dims (d=12288, 96 layers, 96 heads) on the LLaMA code, as in the LLaMA 65B
    # latency post (Table 1). LLaMA sizes its SwiGLU MLP as 8d/3 rounded up to a
    # multiple of 256, which for d=12288 is 32768.
    "llama-175b": dict(
        vocab_size=32000, hidden_size=12288, intermediate_size=32768, num_hidden_layers=96,
        num_attention_heads=96, num_key_value_heads=96, max_position_embeddings=2048,
        rope_parameters=ROPE_10K, rms_norm_eps=1e-6,
    ),
    # Llama 2 (Touvron et al. 2023b): 4k context; 70B uses grouped-query attention.
    "llama2-7b": dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096,
        rope_parameters=ROPE_10K, rms_norm_eps=1e-5,
    ),
    "llama2-13b": dict(
        vocab_size=32000, hidden_size=5120, intermediate_size=13824, num_hidden_layers=40,
        num_attention_heads=40, num_key_value_heads=40, max_position_embeddings=4096,
        rope_parameters=ROPE_10K, rms_norm_eps=1e-5,
    ),
    "llama2-70b": dict(
        vocab_size=32000, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
        num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=4096,
        rope_parameters=ROPE_10K, rms_norm_eps=1e-5,
    ),
    # Llama 3 / 3.1: 128k tiktoken vocabulary, GQA with 8 KV heads, rope_theta 500000.
    "llama3-8b": dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
        rope_parameters=dict(rope_type="default", rope_theta=500000.0),
        rms_norm_eps=1e-5, bos_token_id=128000, eos_token_id=128001,
    ),
    "llama3.1-70b": dict(
        vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
        num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=131072,
        rms_norm_eps=1e-5, bos_token_id=128000, eos_token_id=128001,
        rope_parameters=dict(
            rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
    ),
    # Llama 3.2 1B (meta-llama/Llama-3.2-1B config.json): 1.24B parameters with the output layer tied to
    # the embeddings, 64-wide heads, Llama 3 RoPE scaling to 128k. A mid-size model for a TPU run whose MFU
    # means something (tiny leaves the MXU idle); on a CPU only the planner and meta-device cells build it.
    "llama3.2-1b": dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
        rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=128000, eos_token_id=128001,
        rope_parameters=dict(
            rope_type="llama3", rope_theta=500000.0, factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
    ),
}

# Valid overrides: every keyword LlamaConfig / PretrainedConfig take by name, plus the
# attention backend (a keyword PretrainedConfig pops from **kwargs), plus Transformers 4's
# rope_theta / rope_scaling, which get_config folds into rope_parameters.
CONFIG_FIELDS = (
    set(inspect.signature(LlamaConfig.__init__).parameters)
    | set(inspect.signature(PretrainedConfig.__init__).parameters)
    | {"attn_implementation", "rope_theta", "rope_scaling"}
) - {"self", "kwargs"}


def get_config(name, **overrides):
    """Return the named config as a `LlamaConfig`, with `overrides` replacing its fields."""
    if name not in CONFIGS:
        raise ValueError(f"unknown config {name!r}; known names: {', '.join(CONFIGS)}")
    unknown = sorted(set(overrides) - CONFIG_FIELDS)
    if unknown:
        raise ValueError(
            f"unknown LlamaConfig field(s) {', '.join(map(repr, unknown))} in overrides for "
            f"{name!r}; valid fields include hidden_size, num_hidden_layers, num_key_value_heads"
        )
    fields = {**copy.deepcopy(CONFIGS[name]), **overrides}
    if {"rope_theta", "rope_scaling"} & set(overrides):  # Transformers 4 names, folded into rope_parameters
        rope = dict(fields.pop("rope_parameters"))
        if "rope_scaling" in overrides:
            rope = dict(fields.pop("rope_scaling") or {"rope_type": "default"}, rope_theta=rope["rope_theta"])
        rope["rope_theta"] = fields.pop("rope_theta", rope["rope_theta"])
        fields["rope_parameters"] = rope
    return LlamaConfig(**fields)
