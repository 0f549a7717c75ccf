"""The formulas of llama_xla_helpers.metrics against the numbers the source posts print.

- the Llama 2 post: "High-Performance Llama 2 Training and Inference with PyTorch/XLA on Cloud TPUs",
  PyTorch blog, https://pytorch.org/blog/high-performance-llama-2/
- the LLaMA 65B latency post: "The Path to Achieve Ultra-Low Inference Latency With LLaMA 65B on
  PyTorch/XLA", PyTorch blog, https://pytorch.org/blog/path-achieve-low-inference-latency/
- the FSDP post: "Maximizing Training Throughput Using PyTorch FSDP", PyTorch blog,
  https://pytorch.org/blog/maximizing-training/
"""
import pytest
import torch
import torch_xla
from transformers import LlamaForCausalLM

from llama_xla_helpers.configs import get_config
from llama_xla_helpers.metrics import (
    HBM_BYTES, PEAK_FLOPS, approx_params, compile_seconds, cost_per_1k_tokens, count_compiles, flops_per_token,
    critical_batch, kernel_head_dim, kv_cache_bytes, mfu, min_chips, param_bytes, param_count, plan, roofline,
)

pytestmark = pytest.mark.fixed_dtype  # no test here reads the default dtype (conftest checks)

GiB = 2**30


def hf_count(cfg):
    return sum(p.numel() for p in LlamaForCausalLM(cfg).parameters())


@pytest.mark.parametrize("overrides", [
    {},
    {"num_key_value_heads": 2},                              # GQA
    {"num_key_value_heads": 1, "tie_word_embeddings": True},  # MQA, tied lm_head
])
def test_param_count_matches_hf(overrides):
    cfg = get_config("tiny", **overrides)
    assert param_count(cfg) == hf_count(cfg)


def test_param_count_tiny_by_hand():
    # embed 264*128 + 4 layers * (q,o 2*128*128 + k,v 2*128*4*16 + mlp 3*128*384 + norms 2*128)
    # + final norm 128 + lm_head 264*128
    assert param_count(get_config("tiny")) == 33792 + 4 * 196864 + 128 + 33792 == 855168


def test_param_count_published():
    # Parameter counts of the released checkpoints (Hugging Face safetensors metadata).
    published = {"llama2-7b": 6_738_415_616, "llama2-13b": 13_015_864_320,
                 "llama2-70b": 68_976_648_192, "llama3-8b": 8_030_261_248,
                 "llama3.1-70b": 70_553_706_496}
    assert {name: param_count(get_config(name)) for name in published} == published


def test_flops_per_token_by_hand():
    cfg = get_config("tiny")
    # 6 * (855168 - 264*128 input embedding) + 12 * L4 * H8 * Q16 * T2048
    assert flops_per_token(cfg, 2048) == 6 * 821376 + 12 * 4 * 8 * 16 * 2048 == 17511168
    # Tied embeddings are the output layer, so N is every parameter (nanoGPT).
    tied = get_config("tiny", tie_word_embeddings=True)
    assert flops_per_token(tied, 2048) - 12 * 4 * 8 * 16 * 2048 == 6 * param_count(tied)
    assert mfu(1000, cfg, 2048, peak_flops=17511168 * 1000) == pytest.approx(1.0)


# The FSDP post, Table 1: Llama 2 at 4k sequence length, batch 2 per GPU.
# (size, tokens/s/GPU on A100, MFU on A100, tokens/s/GPU on H100, MFU on H100)
FSDP_TABLE = [
    ("7B", 3700, 0.57, 7500, 0.37),
    ("13B", 1800, 0.51, 3800, 0.35),
    ("34B", 700, 0.47, 1550, 0.32),
    ("70B", 370, 0.50, 800, 0.34),
]
FSDP_CONFIGS = {
    "7B": lambda: get_config("llama2-7b"),
    "13B": lambda: get_config("llama2-13b"),
    # Llama 2 34B was never released; its dims are Code Llama 34B's (70B's width and GQA,
    # 48 layers, MLP 22016).
    "34B": lambda: get_config("llama2-70b", num_hidden_layers=48, intermediate_size=22016),
    "70B": lambda: get_config("llama2-70b"),
}


@pytest.mark.parametrize("size, a100_tps, a100_mfu, h100_tps, h100_mfu", FSDP_TABLE)
def test_fsdp_table_mfu(size, a100_tps, a100_mfu, h100_tps, h100_mfu):
    # The post uses the nanoGPT / PaLM formula but gives neither N nor its rounding; ours
    # (exact N, T=4096) lands within 0.03 of every entry: 7B 0.547/0.350, 13B 0.503/0.335,
    # 34B 0.494/0.345, 70B 0.527/0.360. No single choice of N reproduces all eight.
    cfg = FSDP_CONFIGS[size]()
    assert mfu(a100_tps, cfg, 4096, PEAK_FLOPS["a100"]) == pytest.approx(a100_mfu, abs=0.04)
    assert mfu(h100_tps, cfg, 4096, PEAK_FLOPS["h100"]) == pytest.approx(h100_mfu, abs=0.04)


# The LLaMA 65B latency post, Table 2, batch 1, max_seq_len 256, bf16:
# config -> (Parameter MB, Cache MB, Total GB, min # of TPU v4 chips)
TABLE_2 = {
    "llama-7b": (14_000, 134, 14.128, 1),
    "llama-33b": (66_000, 408, 66.41, 3),
    "llama-65b": (130_000, 671, 130.67, 5),
    "llama-175b": (350_000, 1_208, 351.21, 11),
}
POST_V4_HBM = 32e9  # the post's "32GB" per chip, in decimal bytes (HBM_BYTES has 32 GiB)


@pytest.mark.parametrize("name", TABLE_2)
def test_table_2_parameter_mb(name):
    # The post's column is the nominal size * 2 bytes (7B -> 14,000 MB); its own formula
    # 12 * d**2 * L gives 12,885 / 63,795 / 128,849 / 347,892 MB, 8.0% / 3.3% / 0.9% / 0.6% less.
    post_mb = TABLE_2[name][0]
    assert approx_params(get_config(name)) * 2 / 1e6 == pytest.approx(post_mb, rel=0.09)


@pytest.mark.parametrize("name", TABLE_2)
def test_table_2_cache_mb(name):
    cfg = get_config(name)
    cache = kv_cache_bytes(cfg, batch_size=1, max_seq_len=256)
    # The post's formula: n_layers * 2 * (batch * seq * dim) * 2 bytes (MHA: dim = kv width).
    assert cache == cfg.num_hidden_layers * 2 * (1 * 256 * cfg.hidden_size) * 2
    # 33B is 408.9 MB, which the post truncates to 408.
    assert cache / 1e6 == pytest.approx(TABLE_2[name][1], abs=1)


@pytest.mark.parametrize("name", TABLE_2)
def test_table_2_total_gb(name):
    # plan's total is the exact weights + the cache; the post's is the nominal size * 2 bytes +
    # the cache (and its 7B total, 14.128 GB, is not even its own columns' sum, 14.134).
    cfg = get_config(name)
    p = plan(cfg, "tpu-v4", batch_size=1, max_seq_len=256)
    assert p["total_bytes"] == p["weight_bytes"] + p["cache_bytes"] == param_bytes(cfg) + kv_cache_bytes(cfg, 1, 256)
    assert p["total_bytes"] / 1e9 == pytest.approx(TABLE_2[name][2], rel=0.09)


def test_the_plan_counts_the_cache_as_a_tpus_pages_hold_it():
    """The ragged kernel's pages hold head_dim 64 at 128: Llama 3.2 1B's cache counts double;
    head_dim 128 (Llama 2 and 3 8B and up) is unchanged."""
    small, large = get_config("llama3.2-1b"), get_config("llama3-8b")
    assert [kernel_head_dim(d) for d in (16, 64, 128, 192)] == [128, 128, 128, 256]
    assert plan(small, "tpu-v5e", 8, 2048)["cache_bytes"] == 2 * kv_cache_bytes(small, 8, 2048) == \
        kv_cache_bytes(small, 8, 2048, head_dim=128)
    assert plan(large, "tpu-v5e", 8, 2048)["cache_bytes"] == kv_cache_bytes(large, 8, 2048)


def test_table_2_min_chips():
    # From the post's formulas (N = 12 d^2 L, cache formula) at 32e9 bytes per chip.
    totals = {name: approx_params(get_config(name)) * 2
              + kv_cache_bytes(get_config(name), 1, 256) for name in TABLE_2}
    chips = {name: min_chips(total, POST_V4_HBM, power_of_two=False) for name, total in totals.items()}
    assert chips == {name: row[3] for name, row in TABLE_2.items()}
    # Real slices come in powers of two.
    assert [min_chips(t, POST_V4_HBM) for t in totals.values()] == [1, 4, 8, 16]


def test_int8_puts_175b_on_v4_16():
    # The LLaMA 65B latency post: "with BF16 weights, a 175B parameter model would consume about 351GB ...
    # require a v4-32 ... quantizing the weights to INT8 ... run on a smaller v4-16".
    # A v4-N slice has N TensorCores, 2 per chip.
    cfg = get_config("llama-175b")
    bf16 = plan(cfg, "tpu-v4", batch_size=1, max_seq_len=256)
    int8 = plan(cfg, "tpu-v4", batch_size=1, max_seq_len=256, quantization="int8")
    assert bf16["total_bytes"] / 1e9 == pytest.approx(351, abs=1)
    assert 2 * bf16["min_chips"] == 32
    assert 2 * int8["min_chips"] == 16
    assert int8["cache_bytes"] == bf16["cache_bytes"]  # the KV cache stays bf16


def test_plan_fields():
    cfg = get_config("llama2-70b")
    row = plan(cfg, "tpu-v5e", batch_size=8, max_seq_len=2048, quantization="int4")
    assert row["weight_bytes"] == param_count(cfg) // 2 == param_bytes(cfg, 0.5)
    assert row["cache_bytes"] == 80 * 2 * 8 * 2048 * 8 * 128 * 2
    assert row["total_bytes"] == row["weight_bytes"] + row["cache_bytes"]
    assert row["hbm_bytes_per_chip"] == 16 * GiB
    assert row["min_chips"] == 4  # 39.9 GB over 16 GiB chips: 3, rounded up to 4


def test_kv_cache_gqa():
    # GQA caches n_kv_heads * head_dim per token, not hidden_size: 8x less for 70B.
    gqa = get_config("llama2-70b")
    mha = get_config("llama2-70b", num_key_value_heads=64)
    assert kv_cache_bytes(gqa, 1, 4096) == 80 * 2 * 1 * 4096 * 8 * 128 * 2 == 5 * GiB // 4
    assert kv_cache_bytes(mha, 1, 4096) == 8 * kv_cache_bytes(gqa, 1, 4096)


def test_min_chips_rounding():
    assert [min_chips(n * GiB, 16 * GiB) for n in (1, 16, 17, 48, 49)] == [1, 1, 2, 4, 4]
    assert min_chips(49 * GiB, 16 * GiB, power_of_two=False) == 4


def test_param_bytes():
    cfg = get_config("llama2-7b")
    assert param_bytes(cfg) == 2 * 6_738_415_616
    assert param_bytes(cfg, 1) == 6_738_415_616


def test_cost_per_1k_tokens():
    # 1,000 tokens/s/chip is 3.6e6 tokens per chip-hour; at $3.60 that is $0.001 per 1k.
    assert cost_per_1k_tokens(1000, 3.60) == pytest.approx(0.001)
    assert cost_per_1k_tokens(50, 0.72) == pytest.approx(0.004)  # 0.72 / 180,000 * 1000
    # The Llama 2 post quotes $0.0036 per 1,000 tokens for Llama 2 70B int8 on v5e, priced at the
    # 3-year commitment in us-west4, but prints neither that price nor the throughput used
    # (both are in figures). For example $0.54/chip-hour at 42 tokens/s/chip (the post's
    # headline 70B throughput) gives 0.0036; the post does not say those are its inputs.


def test_chip_tables():
    assert PEAK_FLOPS == {"tpu-v4": 275e12, "tpu-v5e": 197e12, "tpu-v5p": 459e12,
                          "tpu-v6e": 918e12, "a100": 312e12, "h100": 989e12}
    assert HBM_BYTES == {"tpu-v4": 32 * GiB, "tpu-v5e": 16 * GiB,
                         "tpu-v5p": 95 * GiB, "tpu-v6e": 32 * GiB}


TINY = get_config("tiny")


@pytest.mark.parametrize("call, names", [
    (lambda: plan(TINY, "tpu-v3", 1, 128), ["'tpu-v3'", "tpu-v4", "tpu-v6e"]),
    (lambda: plan(TINY, "tpu-v4", 1, 128, quantization="fp8"), ["'fp8'", "bf16", "int8", "int4"]),
    (lambda: plan(TINY, "tpu-v4", 0, 128), ["batch_size", "0"]),
    (lambda: kv_cache_bytes(TINY, 1, -5), ["max_seq_len", "-5"]),
    (lambda: min_chips(10, 0), ["hbm_bytes"]),
    (lambda: flops_per_token(TINY, 0), ["seq_len"]),
    (lambda: mfu(-1, TINY, 128, PEAK_FLOPS["tpu-v4"]), ["tokens_per_sec_per_chip"]),
    (lambda: mfu(100, TINY, 128, 0), ["peak_flops"]),
    (lambda: param_bytes(TINY, 0), ["bytes_per_param"]),
    (lambda: cost_per_1k_tokens(0, 1.0), ["tokens_per_sec_per_chip"]),
])
def test_bad_input_raises(call, names):
    with pytest.raises(ValueError) as err:
        call()
    for name in names:
        assert name in str(err.value)


def test_roofline_and_critical_batch():
    # 70B int8 on 16 v5e chips, batch 1: every weight read once per token from 16 chips' HBM.
    weights = param_bytes(get_config("llama2-70b"), 1) / 16
    t = roofline("tpu-v5e", flops=2 * param_count(get_config("llama2-70b")) / 16, hbm_bytes=weights)
    assert t["memory"] == pytest.approx(weights / 819e9) and t["memory"] > 100 * t["compute"]
    assert roofline("tpu-v5p", ici_bytes=1200e9)["ici"] == pytest.approx(1.0)
    # at the critical batch a bf16 matmul's FLOPs take as long as reading its weights
    b = critical_batch("tpu-v6e")
    n = 1e9
    t = roofline("tpu-v6e", flops=2 * n * b, hbm_bytes=2 * n)
    assert t["compute"] == pytest.approx(t["memory"]) and critical_batch("tpu-v6e", 1) == pytest.approx(b / 2)
    with pytest.raises(ValueError, match="unknown chip with a published ICI bandwidth 'tpu-v4'"):
        roofline("tpu-v4", ici_bytes=1)
    with pytest.raises(ValueError, match="unknown chip with a published HBM bandwidth 'a100'"):
        roofline("a100")


def test_compile_count_and_seconds_grow_with_a_new_graph_only():
    x = torch.arange(7.0, device=torch_xla.device())  # a length no other test compiles
    torch_xla.sync()
    count, seconds = count_compiles(), compile_seconds()
    (x * 3 + 1).sum().item()
    assert count_compiles() == count + 1 and compile_seconds() > seconds
    count, seconds = count_compiles(), compile_seconds()
    (x * 3 + 1).sum().item()  # the same graph: XLA runs what it compiled
    assert count_compiles() == count and compile_seconds() == seconds
