import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from llama_xla_helpers.configs import CONFIGS, get_config
from llama_xla_helpers.metrics import param_count
from llama_xla_helpers.model import rope_args

NAMES = ["tiny", "micro", "bench", "llama-7b", "llama-33b", "llama-65b", "llama-175b", "llama2-7b",
         "llama2-13b", "llama2-70b", "llama3-8b", "llama3.1-70b", "llama3.2-1b"]
TIED = {"llama3.2-1b"}  # the output layer is the embedding's weight


def test_names_are_the_contract():
    assert list(CONFIGS) == NAMES


@pytest.mark.parametrize("name", NAMES)
def test_every_config_builds(name):
    cfg = get_config(name)
    assert isinstance(cfg, LlamaConfig)
    assert cfg.head_dim * cfg.num_attention_heads == cfg.hidden_size
    assert cfg.num_attention_heads % cfg.num_key_value_heads == 0
    assert cfg.tie_word_embeddings == (name in TIED)


def test_tiny_exact():
    cfg = get_config("tiny")
    expected = dict(
        vocab_size=264, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
        rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=256, eos_token_id=257, pad_token_id=None,
    )
    assert {k: getattr(cfg, k) for k in expected} == expected
    assert get_config("micro").to_dict() == get_config("tiny", num_hidden_layers=2).to_dict()
    assert cfg.vocab_size % 8 == 0 and cfg.vocab_size >= 258  # bytes + BOS + EOS
    assert cfg.rope_parameters == {"rope_type": "default", "rope_theta": 10000.0}
    assert rope_args(cfg) == dict(rope_theta=10000.0, rope_scaling=None)


def test_bench_is_the_benchmarks_decode_model():
    cfg = get_config("bench")
    assert cfg.to_dict() == get_config("tiny", hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                                       num_key_value_heads=4, intermediate_size=1376, vocab_size=32000,
                                       initializer_range=0.2).to_dict()
    assert param_count(cfg) == 55_976_448  # embeddings and output layer 2 x 16,384,000 + 8 layers of 2,900,992 + norm 512
    assert cfg.intermediate_size % 32 == 0  # int4 groups of 32 (benchmarks/quantize.py)


def test_llama_7b_dims():
    for name, max_pos, eps in [("llama-7b", 2048, 1e-6), ("llama2-7b", 4096, 1e-5)]:
        cfg = get_config(name)
        assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == (32000, 4096, 11008)
        assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (32, 32, 32)
        assert (cfg.max_position_embeddings, cfg.rms_norm_eps) == (max_pos, eps)
        assert rope_args(cfg)["rope_theta"] == 10000.0
        assert (cfg.bos_token_id, cfg.eos_token_id) == (1, 2)


def test_seed_002_table_1_dims():
    # LLaMA 65B latency post, Table 1: dimensions, heads, layers (175B = OPT-175B dims).
    table = {"llama-7b": (4096, 32, 32), "llama-33b": (6656, 52, 60),
             "llama-65b": (8192, 64, 80), "llama-175b": (12288, 96, 96)}
    for name, dims in table.items():
        cfg = get_config(name)
        assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_hidden_layers) == dims
        assert cfg.hidden_size == 128 * cfg.num_attention_heads  # the post's "dim = 128 * n_heads"
        # LLaMA's MLP width: int(8d/3) rounded up to a multiple of 256.
        assert cfg.intermediate_size == (8 * cfg.hidden_size // 3 + 255) // 256 * 256


def test_llama2_70b_gqa():
    cfg = get_config("llama2-70b")
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (8192, 28672, 80)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (64, 8, 128)
    assert (cfg.vocab_size, cfg.max_position_embeddings) == (32000, 4096)


def test_llama3_vocab_and_theta():
    for name in ["llama3-8b", "llama3.1-70b"]:
        cfg = get_config(name)
        assert (cfg.vocab_size, rope_args(cfg)["rope_theta"], cfg.num_key_value_heads) == (128256, 500000.0, 8)
        assert (cfg.bos_token_id, cfg.eos_token_id) == (128000, 128001)
    assert get_config("llama3-8b").intermediate_size == 14336
    assert rope_args(get_config("llama3-8b"))["rope_scaling"] is None


def test_llama31_rope_scaling():
    cfg = get_config("llama3.1-70b")
    assert rope_args(cfg) == dict(rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
    })
    assert cfg.max_position_embeddings == 131072
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads) == (8192, 80, 64)


def test_llama32_1b_published_dims_and_parameter_count():
    """Llama 3.2 1B's config.json, and its 1.24B parameters counted on the meta device (no memory)."""
    cfg = get_config("llama3.2-1b")
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (128256, 2048, 8192, 16)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (32, 8, 64)
    assert (cfg.max_position_embeddings, cfg.rms_norm_eps, cfg.tie_word_embeddings) == (131072, 1e-5, True)
    assert (cfg.bos_token_id, cfg.eos_token_id) == (128000, 128001)
    assert rope_args(cfg) == dict(rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
    })
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    n = sum(p.numel() for p in model.parameters())  # a tied weight counts once
    assert n == param_count(cfg) == 1_235_814_400  # embeddings 262,668,288 + 16 layers of 60,821,504 + norm 2048


def test_overrides():
    cfg = get_config("tiny", num_key_value_heads=8)
    assert cfg.num_key_value_heads == 8
    assert cfg.hidden_size == 128  # the rest untouched
    assert get_config("tiny").num_key_value_heads == 4  # the table is not mutated
    assert get_config("tiny", hidden_size=256).head_dim == 32  # derived fields follow
    cfg = get_config("llama3.1-70b", rope_scaling=None, num_hidden_layers=2)  # Transformers 4 names work
    assert rope_args(cfg) == dict(rope_theta=500000.0, rope_scaling=None) and cfg.num_hidden_layers == 2
    assert rope_args(get_config("tiny", rope_theta=500000.0))["rope_theta"] == 500000.0


def test_returned_configs_are_independent():
    get_config("llama3.1-70b").rope_parameters["factor"] = 1.0
    assert get_config("llama3.1-70b").rope_parameters["factor"] == 8.0


def test_unknown_name():
    with pytest.raises(ValueError, match="llama2-70b") as err:
        get_config("llama2-34b")
    assert "'llama2-34b'" in str(err.value)


def test_unknown_override():
    with pytest.raises(ValueError, match="num_kv_heads"):
        get_config("tiny", num_kv_heads=2)
