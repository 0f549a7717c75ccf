"""Tensor-parallel inference on the devices there are: Megatron sharding, the collectives of a
decode step, KV-head replication and the resharding CLI.

The expected collectives come from the Llama 3.1 70B post: Subrata Goswami, "Under the Hood of
Llama 3.1 70B Distributed Inference", Medium, September 2024.
"""
import json
import subprocess
import sys

import pytest
import torch

from llama_xla_helpers.generate import Generator
from llama_xla_helpers.hlo import check_count
from llama_xla_helpers.mesh import make_mesh, mesh_shape
from llama_xla_helpers.model import Linear, Llama
from llama_xla_helpers.parallel import decode_collectives, main, replicate_kv_heads, shard_for_inference
from llama_xla_helpers.quantize import quantize
from llama_xla_helpers.sharding import shard_shape
from test_generate import BUCKETS, LENGTHS, MAX_SEQ_LEN, NEW_TOKENS, VARIANTS, prompts, reference, tiny
from util import N, eight_devices, hf_model, tp_size

TP = tp_size()  # the 'model' axis: up to 8 (tiny's vocabulary, 264, splits up to 8 ways)


def sharded(hf, mesh, max_batch_size, max_seq_len=MAX_SEQ_LEN):
    """The HF model as a sharded inference Llama, KV heads replicated up to the 'model' axis if needed."""
    model = Llama.from_hf(hf, max_batch_size=max_batch_size, max_seq_len=max_seq_len)
    tp = mesh.shape()["model"]
    if model.args.n_kv_heads < tp:
        model = replicate_kv_heads(model, tp // model.args.n_kv_heads)
    return shard_for_inference(model, mesh)


@pytest.mark.devices
@pytest.mark.parametrize("variant", VARIANTS)
def test_tensor_parallel_greedy_matches_hugging_face(variant):
    hf, expected = reference(variant)
    data = N // TP  # devices beyond 8 split the batch
    rows = list(range(len(LENGTHS))) if data == 1 else list(range(1, len(LENGTHS)))  # 5 prompts, or 4
    model = sharded(hf, make_mesh((data, TP)), max_batch_size=len(rows))
    tokens, stats = Generator(model, buckets=BUCKETS).generate([prompts()[r] for r in rows], NEW_TOKENS)
    assert tokens == [expected[r] for r in rows]
    assert stats.compiles <= 2 + 2
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    def out_in(linear):  # a weight's (out, in) shard; model.Linear stores the transpose
        if isinstance(linear, Linear):
            return tuple(shard_shape(linear.weight_t))[::-1]
        return tuple(shard_shape(linear.weight))

    shards = {name: out_in(m) for name, m in [("q", attn.q_proj), ("k", attn.k_proj), ("o", attn.o_proj),
                                               ("up", mlp.up_proj), ("down", mlp.down_proj), ("lm_head", model.lm_head)]}
    shards.update(embed=shard_shape(model.embed_tokens.weight), cache=shard_shape(attn.kv_cache.k_cache))
    kv_heads = max(hf.config.num_key_value_heads, TP)  # replicated up to the 'model' axis
    assert shards == {"embed": (264 // TP, 128), "q": (128 // TP, 128), "k": (kv_heads * 16 // TP, 128),
                      "o": (128, 128 // TP), "up": (384 // TP, 128), "down": (128, 384 // TP),
                      "lm_head": (264 // TP, 128), "cache": (len(rows) // data, MAX_SEQ_LEN, kv_heads // TP, 16)}


@pytest.mark.devices
def test_tied_embeddings_stay_tied_when_sharded():
    hf = hf_model(tiny(tie_word_embeddings=True))
    hf.generation_config.eos_token_id = None
    rows = prompts()[1:3] * (N // TP)  # 2 prompts per 'data' shard
    expected = [hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                            max_new_tokens=16, do_sample=False)[0, len(p):].tolist() for p in rows]
    model = sharded(hf, make_mesh((N // TP, TP)), max_batch_size=len(rows))
    assert model.lm_head.weight is model.embed_tokens.weight  # one tensor, placed once
    assert shard_shape(model.lm_head.weight) == (264 // TP, 128)
    tokens, _ = Generator(model, buckets=BUCKETS).generate(rows, 16)
    assert tokens == expected


@pytest.mark.devices
def test_2d_mesh_splits_batch_and_model():
    hf, expected = reference("gqa")  # 4 KV heads
    data, tp = mesh_shape(N, hf.config)  # (4, 2) on 8 devices, (2, 2) on 4, (4, 4) on 16
    model = sharded(hf, make_mesh((data, tp)), max_batch_size=4)
    assert shard_shape(model.layers[0].self_attn.kv_cache.k_cache) == (4 // data, MAX_SEQ_LEN, 4 // tp, 16)
    tokens, _ = Generator(model, buckets=BUCKETS).generate(prompts()[1:], NEW_TOKENS)
    assert tokens == expected[1:]


@eight_devices
@pytest.mark.parametrize("scheme, group_size, lm_head, row_groups_split", [
    ("int8", None, True, None),
    ("int4", 16, False, True),   # o_proj 8 groups, down_proj 24: split over 8 devices with the inputs
    ("int4", 32, True, False),   # 4 and 12 groups: not a multiple of 8, replicated
])
def test_quantized_tensor_parallel_matches_one_device(scheme, group_size, lm_head, row_groups_split):
    """Codes, scales and zeros are sharded like the weights they replace; greedy tokens do not change."""
    hf = hf_model(tiny(**VARIANTS["mha"]))  # 8 KV heads: the 'model' axis of 8 needs no replication

    def quantized():
        model = Llama.from_hf(hf, max_batch_size=len(LENGTHS), max_seq_len=MAX_SEQ_LEN)
        return quantize(model, scheme, group_size=group_size or 128, quantize_lm_head=lm_head)

    expected, _ = Generator(quantized(), buckets=BUCKETS).generate(prompts(), NEW_TOKENS)  # unsharded
    assert all(len(set(row)) > 10 for row in expected), "the quantized model repeats itself"
    model = shard_for_inference(quantized(), make_mesh((8,), ("model",)))
    tokens, _ = Generator(model, buckets=BUCKETS).generate(prompts(), NEW_TOKENS)
    assert tokens == expected

    state = model.state_dict()
    assert all(t.device.type == "xla" for t in state.values()), "a quantized tensor stayed on the CPU"
    q, o, down = (model.layers[0].get_submodule(n) for n in ("self_attn.q_proj", "self_attn.o_proj", "mlp.down_proj"))
    if scheme == "int8":  # codes (out, in) int8, one scale per output
        assert (shard_shape(q.weight), shard_shape(q.scales)) == ((16, 128), (16,))  # column: split out
        assert (shard_shape(o.weight), shard_shape(o.scales)) == ((128, 16), (128,))  # row: split in
        assert shard_shape(model.lm_head.scales) == (33,)
    else:  # packed codes stored (in // 2, out) uint8, scales and zeros (out, in // group_size)
        assert (shard_shape(q.weight_t), shard_shape(q.zeros)) == ((64, 16), (16, 128 // group_size))
        assert shard_shape(down.weight_t) == (384 // 2 // 8, 128)
        groups = (128 // group_size, 384 // group_size)
        split = tuple(g // 8 for g in groups) if row_groups_split else groups
        assert (shard_shape(o.scales)[1], shard_shape(down.zeros)[1]) == split


@pytest.fixture(scope="module")
def collectives():
    """Collectives of one decode step of a 2-layer MHA model, tensor-parallel over up to 8 devices."""
    if TP == 1:
        pytest.skip("one device: there are no collectives")
    batch = 3 * (N // TP)  # 3 rows per 'data' shard
    model = sharded(hf_model(tiny()), make_mesh((N // TP, TP)), max_batch_size=batch, max_seq_len=64)
    return decode_collectives(model, batch_size=batch)


def test_decode_step_all_reduces_after_row_parallel_layers(collectives):
    counts, _ = collectives
    # The Llama 3.1 70B post: one all-reduce for the vocabulary-parallel embedding, one after each
    # row-parallel layer (o_proj, down_proj) of each of the 2 blocks; the greedy pick over the
    # vocabulary-parallel logits adds all-gathers (the next test says which). Exact on XLA:CPU; a
    # TPU's compiler may combine them (hlo.check_count).
    check_count(counts["all-reduce"], 1 + 2 * 2, "all-reduces of a decode step")
    assert counts["all-reduce"] >= 1 and counts["all-gather"] >= 1


def test_decode_step_gathers_only_each_shards_best_token(collectives):
    # Attention with einsum keeps heads local, and the greedy pick over the vocabulary-parallel
    # logits gathers only each shard's best (value, index): (3 rows, TP shards) of f32 and of s32.
    # Gathering the logits themselves would move (3, 264) f32 = 3168 bytes per device.
    counts, nbytes = collectives
    check_count(counts["all-gather"], 2, "all-gathers of a decode step")
    check_count(nbytes["all-gather"], 3 * TP * (4 + 4), "all-gather bytes of a decode step")


@pytest.mark.parametrize("variant, factor", [("gqa", 2), ("llama3.1", 4)])
def test_replicated_kv_heads_give_identical_outputs(variant, factor):
    hf = hf_model(tiny(**VARIANTS[variant]))
    model = Llama.from_hf(hf, max_batch_size=2, max_seq_len=48)
    wide = replicate_kv_heads(model, factor)
    assert wide.args.n_kv_heads == model.args.n_kv_heads * factor == 8
    assert wide.layers[0].self_attn.kv_cache.k_cache.shape == (2, 48, 8, 16)
    toks = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))
    expected = model(toks, torch.arange(40))
    torch.testing.assert_close(wide(toks, torch.arange(40)), expected, atol=1e-6, rtol=0)
    state = replicate_kv_heads(hf.state_dict(), factor, head_dim=16)  # the state-dict form
    assert state["model.layers.0.self_attn.v_proj.weight"].shape == (8 * 16, 128)
    torch.testing.assert_close(Llama.from_state_dict(wide.args, state)(toks, torch.arange(40)), expected,
                               atol=1e-6, rtol=0)


def test_replicate_kv_heads_bad_arguments():
    model = Llama.from_hf(hf_model(tiny(layers=1, num_key_value_heads=2)), max_batch_size=1, max_seq_len=8)
    with pytest.raises(ValueError, match="factor=3 gives 6 KV heads, which do not divide n_heads=8"):
        replicate_kv_heads(model, 3)
    with pytest.raises(ValueError, match="factor=0 must be an int >= 1"):
        replicate_kv_heads(model, 0)
    with pytest.raises(ValueError, match="needs head_dim"):
        replicate_kv_heads(model.state_dict(), 2)


@eight_devices
@pytest.mark.parametrize("overrides, shape, axes, message", [
    (dict(num_key_value_heads=2), (8,), ("model",),
     r"n_kv_heads=2 < the 'model' axis of size 8.*replicate_kv_heads\(model, factor=4\)"),
    (dict(vocab_size=260, num_key_value_heads=8), (8,), ("model",),
     r"vocab_size=260 is not divisible by the 'model' axis of size 8; .* one of \[1, 2, 4\]"),
    (dict(intermediate_size=350), (2, 4), ("data", "model"),
     r"intermediate_size=350 is not divisible by the 'model' axis of size 4; .* one of \[1, 2\]"),
    (dict(), (8,), ("data",), r"mesh has no axis 'model'"),
])
def test_shard_for_inference_checks_first(overrides, shape, axes, message):
    model = Llama.from_hf(hf_model(tiny(layers=1, **overrides)), max_batch_size=2, max_seq_len=8)
    with pytest.raises(ValueError, match=message):
        shard_for_inference(model, make_mesh(shape, axes))
    assert model.embed_tokens.weight.device.type == "cpu"  # nothing moved


@eight_devices
def test_shard_for_inference_checks_batch_against_data_axis():
    model = Llama.from_hf(hf_model(tiny(layers=1)), max_batch_size=3, max_seq_len=8)
    with pytest.raises(ValueError, match="max_batch_size=3 is not divisible by the 'data' axis of size 2"):
        shard_for_inference(model, make_mesh((2, 4), ("data", "model")))


@pytest.mark.child_process
def test_reshard_cli_round_trip(tmp_path):
    hf = hf_model(tiny(layers=1, **VARIANTS["llama3.1"]))
    src, dst = tmp_path / "src", tmp_path / "dst"
    hf.save_pretrained(src, max_shard_size="300KB")  # sharded: an index and several files
    (src / "tokenizer_config.json").write_text("{}")
    cli = [sys.executable, "-m", "llama_xla_helpers.parallel", "reshard", str(src), str(dst), "--factor", "4"]
    subprocess.run(cli, check=True, capture_output=True)

    assert json.loads((dst / "config.json").read_text())["num_key_value_heads"] == 8
    assert (dst / "tokenizer_config.json").is_file() and (dst / "model.safetensors").is_file()
    original = Llama.from_pretrained(src, max_batch_size=1, max_seq_len=24)
    wide = Llama.from_pretrained(dst, max_batch_size=1, max_seq_len=24)
    assert wide.args.n_kv_heads == 8
    toks = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(wide(toks, torch.arange(20)), original(toks, torch.arange(20)), atol=1e-6, rtol=0)

    with pytest.raises(SystemExit):  # never overwrites: dst is not empty now
        main(["reshard", str(src), str(dst), "--factor", "4"])
    with pytest.raises(SystemExit):  # 2 * 3 KV heads do not divide 8 query heads
        main(["reshard", str(src), str(tmp_path / "other"), "--factor", "3"])
    assert not (tmp_path / "other").exists()
