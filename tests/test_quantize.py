"""Weight-only quantization: error bounds, packing, bytes, GPTQ against round to nearest,
the XLA path against the CPU path, save / load, and bad input."""
import pytest
import torch
import torch.nn.functional as F
import torch_xla
from safetensors.torch import load_file

from llama_xla_helpers.configs import get_config
from llama_xla_helpers.data import load_corpus, train_val_split
from llama_xla_helpers.metrics import param_count
from llama_xla_helpers.model import Llama, ModelArgs
from llama_xla_helpers.quantize import (
    FLOAT_LINEARS, Int4Linear, Int8Linear, dequantize_int4, gptq_int4, load_quantized, pack_int4, quantize,
    quantize_int4, quantize_int8, save_quantized, unpack_int4, weight_bytes,
)
from llama_xla_helpers.generate import Generator
from util import hf_model, teacher_forced_agreement

pytestmark = pytest.mark.fixed_dtype  # no test here reads the default dtype (conftest checks)

SEQ = 64
BLOCK_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def tiny_model(max_batch_size=8, max_seq_len=SEQ, **overrides):
    """The tiny config with 2 layers and random weights of std 0.02 (the training init)."""
    config = get_config("tiny", num_hidden_layers=2, **overrides)
    return Llama.from_hf(hf_model(config), max_batch_size, max_seq_len)


def block_linears(model):
    return [layer.get_submodule(name) for layer in model.layers for name in BLOCK_LINEARS]


@pytest.fixture(scope="module")
def text():
    """(train, held-out) chunks of SEQ byte tokens of the corpus."""
    return train_val_split(load_corpus(), SEQ)


def logits(model, tokens):
    return torch.cat([model(b, torch.arange(b.shape[1])) for b in tokens.split(8)])


# --- the formats ------------------------------------------------------------------------------

def test_int8_error_at_most_half_a_step():
    w = torch.randn(48, 96) * torch.logspace(-3, 1, 48)[:, None]  # rows of very different sizes
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and scale.shape == (48,)
    assert (q.abs().amax(dim=1) == 127).all(), "each row should use the whole int8 range"
    err = (w - q.float() * scale[:, None]).abs()
    assert (err <= scale[:, None] * (0.5 + 1e-5)).all()


def test_int4_pack_unpack_round_trip():
    q = torch.randint(0, 16, (8, 64), dtype=torch.uint8)
    packed = pack_int4(q)
    assert packed.dtype == torch.uint8 and packed.shape == (8, 32)  # half a byte per value
    assert torch.equal(unpack_int4(packed), q)
    assert pack_int4(torch.tensor([[1, 2]], dtype=torch.uint8)).item() == 0x21  # even column in the low nibble


def test_int4_error_at_most_half_a_step():
    w = torch.randn(16, 128) + 3 * torch.randn(16, 4).repeat_interleave(32, dim=1)  # groups off centre
    q, scale, zero = quantize_int4(w, group_size=32)
    assert q.dtype == torch.uint8 and q.max() <= 15 and scale.shape == zero.shape == (16, 4)
    assert ((q == 0).any(dim=1) & (q == 15).any(dim=1)).all(), "min-max should use codes 0 and 15"
    err = (w - dequantize_int4(q, scale, zero)).abs()
    assert (err <= scale.repeat_interleave(32, dim=1) * (0.5 + 1e-5)).all()


# --- the model ------------------------------------------------------------------------------

def test_int8_model_close_to_fp32(text):
    _, val = text
    fp, int8 = tiny_model(), quantize(tiny_model(), "int8")
    assert all(isinstance(m, Int8Linear) for m in block_linears(int8))
    assert isinstance(int8.lm_head, FLOAT_LINEARS)  # full precision unless asked
    ref, out = logits(fp, val[:16]), logits(int8, val[:16])
    # Rounding noise of std (max|w| / 127) / sqrt(12), about 1% of a Gaussian row's std, per
    # Linear; random weights have no outliers to make it worse or structure to make it better.
    assert (out - ref).norm() / ref.norm() < 0.02
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.95  # near-uniform logits: 0.98 measured


def meta_llama(name, dtype=torch.bfloat16):
    with torch.device("meta"):
        return Llama(ModelArgs.from_hf_config(get_config(name), max_batch_size=1, max_seq_len=16)).to(dtype)


def test_weight_bytes_of_llama2_7b():
    """Real Llama 2 7B shapes on the meta device: bytes as stored, scales and zeros included."""
    bf16 = meta_llama("llama2-7b")
    linears = block_linears(bf16)
    n = sum(m.weight.numel() for m in linears)  # quantized weights
    n_out = sum(m.out_features for m in linears)  # one int8 scale per output channel
    total = weight_bytes(bf16)
    assert total == 2 * param_count(get_config("llama2-7b"))

    int8 = weight_bytes(quantize(meta_llama("llama2-7b"), "int8"))
    assert int8 == total - 2 * n + n + 2 * n_out
    assert int8 <= 0.52 * total
    int4 = weight_bytes(quantize(meta_llama("llama2-7b"), "int4", group_size=128))
    assert int4 == total - 2 * n + n // 2 + 2 * 2 * n // 128  # bf16 scale and zero per 128 weights
    assert int4 <= 0.30 * total


def test_gptq_beats_round_to_nearest_on_correlated_inputs():
    gen = torch.Generator().manual_seed(0)
    mix = torch.randn(128, 128, generator=gen) / 128**0.5
    x = torch.randn(2048, 128, generator=gen) @ mix  # covariance mix^T mix, far from identity
    w = 0.05 * torch.randn(64, 128, generator=gen)
    H = 2 * x.T @ x / len(x)

    def output_error(q, scale, zero):
        return (x @ w.T - x @ dequantize_int4(q, scale, zero).T).norm()

    rtn = output_error(*quantize_int4(w, group_size=32))
    for act_order in (False, True):
        q, scale, zero = gptq_int4(w, H, group_size=32, act_order=act_order)
        assert q.dtype == torch.uint8 and q.max() <= 15 and scale.shape == (64, 4)
        assert output_error(q, scale, zero) < 0.9 * rtn


def test_gptq_model_closer_to_fp32_than_round_to_nearest(text):
    """Calibrated on training text, compared on held-out text with the fp32 model's next-token
    distribution. (The held-out loss itself moves by ~1e-4 either way for both schemes on
    models this small: too little to rank them.)"""
    train, val = text
    fp = tiny_model()
    rtn = quantize(tiny_model(), "int4", group_size=32, quantize_lm_head=True)
    gptq = quantize(tiny_model(), "gptq-int4", group_size=32, calibration=train[-32:], quantize_lm_head=True)
    assert all(isinstance(m, Int4Linear) for m in [*block_linears(gptq), gptq.lm_head])

    ref = logits(fp, val[:32]).log_softmax(-1)

    def kl_and_agreement(model):
        out = logits(model, val[:32]).log_softmax(-1)
        kl = F.kl_div(out, ref, log_target=True, reduction="none").sum(-1).mean()
        return kl, (out.argmax(-1) == ref.argmax(-1)).float().mean()

    (kl_rtn, agree_rtn), (kl_gptq, agree_gptq) = kl_and_agreement(rtn), kl_and_agreement(gptq)
    assert kl_gptq < 0.5 * kl_rtn
    assert agree_gptq > agree_rtn


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_model_on_xla_matches_cpu(scheme):
    """Prefill and two decode steps through the KV cache, left padding in row 1."""
    model = quantize(tiny_model(max_batch_size=2, max_seq_len=32), scheme, group_size=32)
    tokens = torch.randint(0, 256, (2, 18), generator=torch.Generator().manual_seed(0))
    pad = torch.tensor([0, 3])

    def run(device):
        toks, p = tokens.to(device), pad.to(device)
        steps = [model(toks[:, :16], torch.arange(16, device=device), p)]
        for i in (16, 17):
            steps.append(model(toks[:, i:i + 1], torch.tensor([i], device=device), p))
        return torch.cat(steps, dim=1)

    cpu = run("cpu")
    torch.testing.assert_close(cpu, model(tokens, torch.arange(18), pad), atol=1e-5, rtol=0)

    model.to(torch_xla.device())
    out = run(torch_xla.device())
    hlo = torch_xla._XLAC._get_xla_tensors_hlo([out]).splitlines()
    params = [l for l in hlo if "parameter(" in l]
    stored = "s8[128,128]" if scheme == "int8" else "u8[64,128]"  # q_proj and o_proj, as stored (int4: in // 2, out)
    assert any(stored in l for l in params), f"no {stored} weight parameter in the graph"
    assert not any("f32[128,128]" in l for l in params), "a float copy of a weight reached the graph"
    if scheme == "int4":  # the codes are stored as the blockwise matmul reads them
        assert not any(" transpose(" in l and ("s8[" in l or "u8[" in l) for l in hlo), "the graph permutes a weight"
    torch.testing.assert_close(out.cpu(), cpu, atol=1e-4, rtol=0)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_a_bf16_model_quantizes_and_decodes_close_to_fp32(scheme):
    """bf16, as a TPU loads a model by default. Quantizing a bf16 model keeps its scales in bf16, and
    decoding compiles nothing after the first call. The same codes run in bf16 (the fp32 quantization's,
    cast) predict the next tokens of the fp32 quantized model's greedy continuation the same on at least
    95% of the generated positions (teacher-forced; weights of std 0.05, see test_generate's bf16 test).
    (Quantizing in bf16 also moves some codes, since the scales round first: a slightly different model.)"""
    hf, g = hf_model(get_config("tiny", num_hidden_layers=2, initializer_range=0.05)), torch.Generator().manual_seed(1)
    rows = [torch.randint(0, 256, (24,), generator=g).tolist() for _ in range(4)]
    quantized_in_bf16 = Generator(quantize(Llama.from_hf(hf, 4, 96, torch.bfloat16), scheme, group_size=32),
                                  buckets=(32,))
    assert quantized_in_bf16.model.layers[0].self_attn.q_proj.scales.dtype == torch.bfloat16
    quantized_in_bf16.generate(rows, 40)
    assert quantized_in_bf16.generate(rows, 40)[1].compiles == 0

    fp32 = Generator(quantize(Llama.from_hf(hf, 4, 96), scheme, group_size=32), buckets=(32,))
    bf16 = Generator(quantize(Llama.from_hf(hf, 4, 96), scheme, group_size=32).to(torch.bfloat16), buckets=(32,))
    tokens, _ = fp32.generate(rows, 40)
    assert len({t for row in tokens for t in row}) > 10, "the model repeats itself: the test proves nothing"
    sequences = torch.tensor([p + t for p, t in zip(rows, tokens)])  # (4, 24 + 40)
    agreement, dots = teacher_forced_agreement(fp32.model, bf16.model, sequences, generated_from=24)
    print(f"{scheme}: top-1 agreement {agreement:.1%}, matmuls {dots}")
    assert agreement >= 0.95 and dots == ({"bf16"} if scheme == "int8" else {"bf16", "f32"})  # int4: see Int4Linear


@pytest.mark.parametrize("scheme,tied,lm_head", [
    ("int8", False, True), ("int4", False, False), ("int4", True, False),
])
def test_save_load_round_trip(tmp_path, scheme, tied, lm_head):
    model = quantize(tiny_model(tie_word_embeddings=tied), scheme, group_size=32, quantize_lm_head=lm_head)
    path = tmp_path / "quantized.safetensors"
    save_quantized(model, path)

    stored = load_file(path)
    dtype = torch.int8 if scheme == "int8" else torch.uint8
    for prefix in (f"layers.{i}.{name}" for i in range(2) for name in BLOCK_LINEARS):
        assert stored[f"{prefix}.weight"].dtype == dtype and f"{prefix}.scales" in stored
    assert ("lm_head.weight" in stored) != tied  # a tied weight is stored once, as embed_tokens
    assert tied or (stored["lm_head.weight"].dtype == dtype) == lm_head
    assert sum(t.numel() * t.element_size() for t in stored.values()) == weight_bytes(model)

    with torch.device("meta"):
        skeleton = Llama(model.args)
    loaded = load_quantized(skeleton, path)
    assert type(loaded.layers[1].mlp.down_proj) is type(model.layers[1].mlp.down_proj)
    assert (loaded.lm_head.weight is loaded.embed_tokens.weight) == tied
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    assert torch.equal(loaded(tokens, torch.arange(24)), model(tokens, torch.arange(24)))


def test_load_into_a_different_shape_names_the_tensor(tmp_path):
    path = tmp_path / "quantized.safetensors"
    save_quantized(quantize(tiny_model(), "int8"), path)
    with torch.device("meta"):
        config = get_config("tiny", num_hidden_layers=2, intermediate_size=512)
        wider = Llama(ModelArgs.from_hf_config(config, max_batch_size=8, max_seq_len=SEQ))
    with pytest.raises(ValueError, match="'layers.0.mlp.gate_proj' is out x in = 384 x 128, the model expects 512"):
        load_quantized(wider, path)


@pytest.mark.parametrize("scheme,kwargs,message", [
    ("int3", {}, "unknown scheme 'int3'; known schemes: int8, int4, gptq-int4"),
    ("int4", {"group_size": 0}, "group_size=0 must be an even integer"),
    ("int4", {"group_size": 48}, "group_size=48 does not divide layers.0.self_attn.q_proj.in_features=128; "
                                 "group sizes that fit it: 16, 32, 64, 128"),
    ("gptq-int4", {"group_size": 32}, "scheme 'gptq-int4' needs calibration data"),
    ("gptq-int4", {"group_size": 32, "calibration": []}, "scheme 'gptq-int4' needs calibration data"),
    ("gptq-int4", {"group_size": 32, "calibration": torch.rand(4, 16)}, "expected integer token ids"),
    ("gptq-int4", {"group_size": 32, "calibration": torch.zeros(4, 65, dtype=torch.long)}, "max_seq_len=64"),
])
def test_bad_input_raises_before_any_weight_changes(scheme, kwargs, message):
    model = tiny_model()
    before = {name: t.clone() for name, t in model.state_dict().items()}
    with pytest.raises(ValueError, match=message.replace(".", r"\.").replace("(", r"\(")):
        quantize(model, scheme, **kwargs)
    assert all(isinstance(m, FLOAT_LINEARS) for m in block_linears(model))
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
