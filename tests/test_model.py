"""The inference Llama against Hugging Face's LlamaForCausalLM, on the CPU with plain torch."""
import dataclasses

import pytest
import torch
from safetensors.torch import save_file
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from llama_xla_helpers.configs import get_config
from llama_xla_helpers.model import Linear, Llama, ModelArgs, rope_frequencies
from util import hf_model

pytestmark = pytest.mark.fixed_dtype  # no test here reads the default dtype (conftest checks)

ATOL = 1e-4
# Llama 3.1's scaling with a short original context, so it changes the frequencies that
# matter for sequences of a few dozen tokens.
LLAMA31_SCALING = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                       original_max_position_embeddings=32)
VARIANTS = {
    "mha": dict(num_key_value_heads=8),
    "gqa": dict(num_key_value_heads=4),
    "llama3.1": dict(num_key_value_heads=2, rope_theta=500000.0, rope_scaling=LLAMA31_SCALING),
}


def tiny(**overrides):
    """The tiny config with 2 layers and large random weights (so the logits vary)."""
    return get_config("tiny", **{"num_hidden_layers": 2, "initializer_range": 0.2, **overrides})


def tokens(bsz, seqlen, seed=0):
    return torch.randint(0, 256, (bsz, seqlen), generator=torch.Generator().manual_seed(seed))


def full_logits(model, toks):
    return model(toks, torch.arange(toks.shape[1]))


@torch.no_grad()
def hf_logits(hf, toks):
    return hf(toks).logits


@pytest.mark.parametrize("variant", VARIANTS)
def test_full_sequence_matches_hf(variant):
    hf = hf_model(tiny(**VARIANTS[variant]))
    model = Llama.from_hf(hf, max_batch_size=2, max_seq_len=48)
    toks = tokens(2, 40)
    torch.testing.assert_close(full_logits(model, toks), hf_logits(hf, toks), atol=ATOL, rtol=0)


def test_llama3_frequencies_match_hf():
    config = tiny(rope_scaling=LLAMA31_SCALING, rope_theta=500000.0)
    hf_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    ours = rope_frequencies(16, 500000.0, LLAMA31_SCALING)
    torch.testing.assert_close(ours, hf_freq, atol=0, rtol=1e-6)
    assert not torch.allclose(ours, rope_frequencies(16, 500000.0)), "scaling should change frequencies"


def test_llama3_scaling_matters_at_these_lengths():
    """Without the scaling the llama3.1 variant no longer matches HF: the test above is not vacuous."""
    hf = hf_model(tiny(**VARIANTS["llama3.1"]))
    model = Llama.from_hf(hf, max_batch_size=1, max_seq_len=48)
    args = dataclasses.replace(model.args, rope_scaling=None)
    unscaled = Llama.from_state_dict(args, hf.state_dict())
    toks = tokens(1, 40)
    assert (full_logits(unscaled, toks) - hf_logits(hf, toks)).abs().max() > 100 * ATOL


def test_attention_over_the_first_kv_len_slots_is_the_same():
    """kv_len: attention reads only the cache slots in use; the logits are those of the whole cache."""
    model = Llama.from_hf(hf_model(tiny(**VARIANTS["gqa"])), max_batch_size=2, max_seq_len=40)
    toks = tokens(2, 20)
    expected = full_logits(model, toks)
    steps = [model(toks[:, :12], torch.arange(12), kv_len=12)]
    for i in range(12, 20):  # per-row positions, as the serving engine decodes
        steps.append(model(toks[:, i:i + 1], torch.full((2, 1), i), kv_len=16 if i < 16 else 24))
    torch.testing.assert_close(torch.cat(steps, dim=1), expected, atol=ATOL, rtol=0)
    with pytest.raises(ValueError, match=r"kv_len=41 must be in \[1 \(the tokens\), max_seq_len=40\]"):
        model(toks[:, :1], torch.tensor([0]), kv_len=41)


@pytest.mark.parametrize("variant", ["gqa", "llama3.1"])
def test_incremental_decoding_matches_full_forward(variant):
    model = Llama.from_hf(hf_model(tiny(**VARIANTS[variant])), max_batch_size=3, max_seq_len=40)
    toks = tokens(2, 20)  # bsz 2 < max_batch_size 3: uses the first rows of the cache
    expected = full_logits(model, toks)
    k = 12
    steps = [model(toks[:, :k], torch.arange(k))]
    for i in range(k, toks.shape[1]):
        steps.append(model(toks[:, i:i + 1], torch.tensor([i])))
        assert steps[-1].shape == (2, 1, 264)  # every decode step has the same shapes
    torch.testing.assert_close(torch.cat(steps, dim=1), expected, atol=ATOL, rtol=0)


def test_left_padding_matches_each_prompt_alone():
    hf = hf_model(tiny(**VARIANTS["llama3.1"]))
    model = Llama.from_hf(hf, max_batch_size=2, max_seq_len=32)
    prompts = [tokens(1, 5, seed=1)[0], tokens(1, 9, seed=2)[0]]
    width = 9
    pad = torch.tensor([width - len(p) for p in prompts])
    junk = tokens(1, width, seed=3)[0]  # padding tokens are arbitrary: they must not matter
    batch = torch.stack([torch.cat([junk[:n], p]) for n, p in zip(pad.tolist(), prompts)])
    nxt = tokens(2, 1, seed=4)

    prefill = model(batch, torch.arange(width), pad)[:, -1]
    decode = model(nxt, torch.tensor([width]), pad)[:, -1]
    for b, prompt in enumerate(prompts):
        alone = Llama.from_hf(hf, max_batch_size=1, max_seq_len=32)
        full = torch.cat([prompt, nxt[b]])[None]
        expected = full_logits(alone, full)[0]  # (len + 1, vocab)
        torch.testing.assert_close(prefill[b], expected[-2], atol=ATOL, rtol=0)
        torch.testing.assert_close(decode[b], expected[-1], atol=ATOL, rtol=0)
        torch.testing.assert_close(prefill[b], hf_logits(hf, prompt[None])[0, -1], atol=ATOL, rtol=0)
        # The cached keys carry RoPE positions 0, 1, ... from slot pad[b] on, as if run alone.
        for layer, alone_layer in zip(model.layers, alone.layers):
            torch.testing.assert_close(layer.self_attn.kv_cache.k_cache[b, pad[b]:width + 1],
                                       alone_layer.self_attn.kv_cache.k_cache[0, :len(prompt) + 1],
                                       atol=ATOL, rtol=0)


@pytest.mark.parametrize("variant", [
    dict(),
    dict(tie_word_embeddings=True),
    dict(rope_scaling=LLAMA31_SCALING, num_key_value_heads=2),
])
@pytest.mark.parametrize("shard", [None, "300KB"])
def test_from_pretrained_round_trip(tmp_path, variant, shard):
    hf = hf_model(tiny(**variant))
    hf.save_pretrained(tmp_path, **({"max_shard_size": shard} if shard else {}))
    assert (tmp_path / "model.safetensors.index.json").is_file() == (shard is not None)
    model = Llama.from_pretrained(tmp_path, max_batch_size=1, max_seq_len=24)
    if variant.get("tie_word_embeddings"):
        assert model.lm_head.weight is model.embed_tokens.weight
    toks = tokens(1, 20)
    torch.testing.assert_close(full_logits(model, toks), hf_logits(hf, toks), atol=ATOL, rtol=0)


def test_state_dict_is_hugging_faces_while_linears_store_the_transpose():
    hf = hf_model(tiny())
    model = Llama.from_hf(hf, max_batch_size=1, max_seq_len=24)
    q = model.layers[0].self_attn.q_proj
    assert isinstance(q, Linear) and q.weight_t.shape == (q.in_features, q.out_features)
    hf_state = {n.removeprefix("model."): t for n, t in hf.state_dict().items()}
    state = model.state_dict()
    assert state.keys() == hf_state.keys()
    assert all(torch.equal(state[n], t) for n, t in hf_state.items())  # (out, in) weights, equal values
    assert torch.equal(q.weight, hf_state["layers.0.self_attn.q_proj.weight"])
    copy = Llama.from_state_dict(model.args, state)  # and it loads back
    toks = tokens(1, 20)
    torch.testing.assert_close(full_logits(copy, toks), full_logits(model, toks), atol=0, rtol=0)


def write_checkpoint(path, hf, state):
    hf.config.to_json_file(path / "config.json")
    save_file({k: v.contiguous() for k, v in state.items()}, path / "model.safetensors")


def test_from_pretrained_wrong_shape_names_the_tensor(tmp_path):
    hf = hf_model(tiny())
    state = hf.state_dict()
    state["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(32, 128)
    write_checkpoint(tmp_path, hf, state)
    with pytest.raises(ValueError, match=r"'layers.1.self_attn.k_proj.weight' has shape \(32, 128\), "
                                         r"model expects \(64, 128\)"):
        Llama.from_pretrained(tmp_path, max_batch_size=1, max_seq_len=8)


@pytest.mark.parametrize("change, message", [
    ("drop", r"no tensor 'layers.0.mlp.up_proj.weight' \(model expects shape \(384, 128\)\)"),
    ("extra", r"'layers.9.mlp.up_proj.weight' \(shape \(384, 128\)\) is not in the model"),
])
def test_from_pretrained_missing_or_unexpected_tensor(tmp_path, change, message):
    hf = hf_model(tiny())
    state = hf.state_dict()
    if change == "drop":
        del state["model.layers.0.mlp.up_proj.weight"]
    else:
        state["model.layers.9.mlp.up_proj.weight"] = torch.zeros(384, 128)
    write_checkpoint(tmp_path, hf, state)
    with pytest.raises(ValueError, match=message):
        Llama.from_pretrained(tmp_path, max_batch_size=1, max_seq_len=8)


def test_from_hf_keeps_dtype():
    hf = hf_model(tiny()).to(torch.bfloat16)
    model = Llama.from_hf(hf, max_batch_size=1, max_seq_len=8)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.layers[0].self_attn.kv_cache.k_cache.shape == (1, 8, 4, 16)
    assert model.layers[0].self_attn.kv_cache.k_cache.dtype == torch.bfloat16
    assert full_logits(model, tokens(1, 8)).dtype == torch.float32


ARGS = dict(dim=128, n_layers=2, n_heads=8, n_kv_heads=4, vocab_size=264, intermediate_size=352)


@pytest.mark.parametrize("overrides, message", [
    (dict(n_kv_heads=3), "n_heads=8 is not a multiple of n_kv_heads=3"),
    (dict(dim=100), "dim=100 is not divisible by n_heads=8"),
    (dict(head_dim=15), "head_dim=15 must be even"),
    (dict(max_seq_len=0), "max_seq_len=0 must be >= 1"),
    (dict(rope_scaling=dict(rope_type="yarn", factor=4.0)), "'yarn' is not supported"),
    (dict(rope_scaling=dict(rope_type="llama3", factor=8.0)), "lacks low_freq_factor"),
])
def test_bad_args_raise(overrides, message):
    with pytest.raises(ValueError, match=message):
        Llama(ModelArgs(**{**ARGS, **overrides}))


def test_bad_shapes_raise():
    model = Llama(ModelArgs(**ARGS, max_batch_size=2, max_seq_len=16))
    with pytest.raises(ValueError, match="batch size 3 > max_batch_size=2"):
        model(tokens(3, 4), torch.arange(4))
    with pytest.raises(ValueError, match=r"input_pos has shape \(3,\), expected \(4,\)"):
        model(tokens(2, 4), torch.arange(3))
    with pytest.raises(ValueError, match="20 tokens > max_seq_len=16"):
        model(tokens(1, 20), torch.arange(20))
    with pytest.raises(ValueError, match=r"pad has shape \(3,\), expected \(2,\)"):
        model(tokens(2, 4), torch.arange(4), pad=torch.zeros(3, dtype=torch.long))


@pytest.mark.parametrize("overrides, message", [
    (dict(attention_bias=True), "attention_bias / mlp_bias are True"),
    (dict(mlp_bias=True), "attention_bias / mlp_bias are True"),
    (dict(hidden_act="gelu"), "hidden_act='gelu'; this Llama's feed-forward is SwiGLU"),
    (dict(rope_scaling=dict(LLAMA31_SCALING, low_freq_factor=4.0)), "low_freq_factor=4.0 must be < high_freq_factor=4.0"),
])
def test_configs_this_llama_cannot_run_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        ModelArgs.from_hf_config(tiny(**overrides), max_batch_size=1, max_seq_len=8)


def test_explicit_head_dim_matches_hf():
    """head_dim 32 with 8 heads on hidden 128: q/k/v project to 256, o_proj back to 128."""
    hf = hf_model(tiny(head_dim=32))
    model = Llama.from_hf(hf, max_batch_size=2, max_seq_len=24)
    assert model.args.head_dim == 32 and model.layers[0].self_attn.q_proj.weight.shape == (256, 128)
    toks = tokens(2, 20)
    torch.testing.assert_close(full_logits(model, toks), hf_logits(hf, toks), atol=ATOL, rtol=0)


def test_from_hf_casts_when_told():
    hf = hf_model(tiny())
    bf16 = Llama.from_hf(hf, 1, 16, dtype=torch.bfloat16)
    assert {t.dtype for t in bf16.state_dict().values()} == {torch.bfloat16}
    assert hf.model.embed_tokens.weight.dtype == torch.float32  # the source is not touched


@pytest.mark.devices
def test_bf16_on_xla_follows_fp32():
    """bf16 weights and cache on the XLA device: logits within bf16's tolerance of fp32, and the
    same first greedy choices where fp32's top two are not near a tie."""
    import torch_xla
    hf = hf_model(tiny())
    toks = tokens(2, 24)
    want = full_logits(Llama.from_hf(hf, 2, 32), toks)  # fp32 on the CPU
    model = Llama.from_hf(hf, 2, 32, dtype=torch.bfloat16).to(torch_xla.device())
    model.init_buffers()  # RoPE tables and cache on the device, in bf16
    device = torch_xla.device()
    got = model(toks.to(device), torch.arange(toks.shape[1]).to(device)).cpu()
    assert got.dtype == torch.float32  # logits come out in fp32
    scale = want.abs().max()
    assert (got - want).abs().max() < 0.05 * scale  # bf16 keeps ~3 significant digits per op
    top2 = want.topk(2, dim=-1).values
    clear = (top2[..., 0] - top2[..., 1]) > 0.1 * scale
    assert clear.any() and torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])
