"""Blockwise attention equals eager attention (values and gradients, GQA, segments, positions); the TPU
kernel's call is checked by faking the device. Training with it: test_attention_training.py."""
import dataclasses

import pytest
import torch
import torch_xla
from transformers import LlamaForCausalLM

from llama_xla_helpers import attention
from llama_xla_helpers.attention import blockwise_attention, hf_attention, use
from llama_xla_helpers.configs import get_config
from llama_xla_helpers.data import sft_conversations, sft_file, sft_rows, write_jsonl
from llama_xla_helpers.hlo import dot_dtypes
from llama_xla_helpers.mesh import make_mesh
from llama_xla_helpers.model import Llama
from llama_xla_helpers.sharding import batch_spec
from llama_xla_helpers.tokenizer import small_tokenizer, tokenizer_and_config
from llama_xla_helpers.train import TrainConfig, build_model, forward_loss, setup
from util import N

pytestmark = pytest.mark.fixed_dtype  # no test here reads the default dtype (conftest checks)

# Tolerances fixed before measuring: fp32 blockwise sums the softmax in another order than eager.
LOSS_TOL = 1e-5   # absolute, on each of 5 training steps' losses
GRAD_TOL = 1e-4   # of each parameter's largest gradient, on the largest difference


def eager(q, k, v, scale, keep):
    """The reference: the whole (seqlen, kv_len) scores, masked by keep (1 or bsz, seqlen, kv_len), softmaxed."""
    scores = torch.einsum("bqgrd,bkgd->bqgrk", q, k).float() * scale
    probs = scores.masked_fill(~keep[:, :, None, None], float("-inf")).softmax(-1)
    return torch.einsum("bqgrk,bkgd->bqgrd", probs.to(v.dtype), v)


def causal(seqlen, segment_ids=None):
    keep = torch.ones(seqlen, seqlen, dtype=torch.bool).tril()[None]
    return keep if segment_ids is None else keep & (segment_ids[:, :, None] == segment_ids[:, None, :])


def qkv(seqlen, kv_len, device, dtype=torch.float32, bsz=2, g=2, r=3, head_dim=8):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(bsz, seqlen, g, r, head_dim, generator=gen)
    k, v = (torch.randn(bsz, kv_len, g, head_dim, generator=gen) for _ in range(2))
    return [t.to(device, dtype).requires_grad_() for t in (q, k, v)]


SEGMENTS = torch.tensor([[0] * 10 + [1] * 25 + [2] * 5, [0] * 40])
# (2, 12, 40): a prefill section at each row's own slots
SLOTS = torch.arange(40) <= (torch.tensor([[20], [28]]) + torch.arange(12))[..., None]
CASES = {  # name -> (seqlen, kv_len, keyword arguments, the keys each query reads)
    "causal": (40, 40, {}, causal(40)),  # 16-token blocks: 3 x 3, short last ones, 3 pairs above the diagonal skipped
    "segments": (40, 40, {"segment_ids": SEGMENTS}, causal(40, SEGMENTS)),
    "mask": (12, 40, {"mask": SLOTS}, SLOTS),
}


@pytest.mark.parametrize("device", ["cpu", "xla"])
@pytest.mark.parametrize("case", CASES)
def test_blockwise_equals_eager_values_and_gradients(case, device):
    device = torch_xla.device() if device == "xla" else device
    seqlen, kv_len, kwargs, keep = CASES[case]
    q, k, v = qkv(seqlen, kv_len, device)
    out = blockwise_attention(q, k, v, scale=0.3, block=16, **{n: t.to(device) for n, t in kwargs.items()})
    want = eager(q, k, v, 0.3, keep.to(device))
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(device)
    got_grads = torch.autograd.grad(out, (q, k, v), grad_out)
    want_grads = torch.autograd.grad(want, (q, k, v), grad_out)
    torch.testing.assert_close(out.cpu(), want.cpu(), rtol=0, atol=1e-5)
    for got, exp in zip(got_grads, want_grads):
        torch.testing.assert_close(got.cpu(), exp.cpu(), rtol=0, atol=1e-5)


def test_blockwise_in_bf16_multiplies_in_bf16_and_follows_fp32():
    q, k, v = qkv(40, 40, torch_xla.device(), torch.bfloat16)
    out = blockwise_attention(q, k, v, scale=0.3, block=16)
    assert out.dtype == torch.bfloat16
    grads = torch.autograd.grad(out.float().sum(), (q, k, v))
    assert set(dot_dtypes([out, *grads])) == {"bf16"}  # every matmul, forward and backward
    want = eager(*(t.detach().cpu().float() for t in (q, k, v)), 0.3, causal(40))
    torch.testing.assert_close(out.cpu().float(), want, rtol=0, atol=0.05)


def test_blockwise_bad_input():
    q, k, v = qkv(12, 40, "cpu")
    with pytest.raises(ValueError, match=r"q has 12 and k 40; pass a mask \(bsz, 12, 40\)"):
        blockwise_attention(q, k, v, scale=0.3)


def test_a_long_prompt_prefills_in_blocks_with_eager_attentions_logits(monkeypatch):
    """The inference model's prefill: sections longer than attention.BLOCK attend in blocks, under its
    cache mask (left padding included), with the logits eager attention gives."""
    torch.manual_seed(0)
    model = Llama.from_hf(LlamaForCausalLM(get_config("tiny")), max_batch_size=2, max_seq_len=64)
    model = model.to(torch_xla.device())
    model.init_buffers()
    tokens = torch.randint(0, 256, (2, 40), device=torch_xla.device())
    pos, pad = torch.arange(40, device=tokens.device), torch.tensor([0, 7], device=tokens.device)
    want = model(tokens, pos, pad).cpu()  # 40 tokens, one block: eager
    calls = []
    monkeypatch.setattr(attention, "BLOCK", 16)
    monkeypatch.setattr(attention, "blockwise_attention", lambda *a, **kw: calls.append(1) or blockwise_attention(*a, **kw))
    got = model(tokens, pos, pad).cpu()
    assert len(calls) == model.args.n_layers
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-4)
    torch.testing.assert_close(got[1, 7:], want[1, 7:], rtol=0, atol=1e-4)  # the padded row's real tokens


def packed_model(implementation, block=8):
    """The tiny model unsharded on the XLA device, attending with `implementation`."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(get_config("tiny")).to(torch_xla.device()).eval()
    use(model, None, implementation, block=block)
    return model


def test_segment_ids_keep_packed_documents_apart():
    """Two documents packed into one row (their positions restart, segment ids 0 and 1) give the
    logits each has alone: the segment ids reach the attention through the model's forward."""
    model = packed_model("blockwise")
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randint(0, 256, (1, 13), generator=gen), torch.randint(0, 256, (1, 19), generator=gen)
    device = torch_xla.device()
    row = torch.cat([a, b], 1).to(device)
    positions = torch.cat([torch.arange(13), torch.arange(19)])[None].to(device)
    segments = torch.tensor([[0] * 13 + [1] * 19], device=device)
    with torch.no_grad():
        packed = model(row, position_ids=positions, segment_ids=segments).logits.cpu()
        alone = [model(t.to(device)).logits.cpu() for t in (a, b)]
    torch.testing.assert_close(packed, torch.cat(alone, 1), rtol=0, atol=1e-4)
    with torch.no_grad():  # without the segment ids the second document reads the first
        unpacked = model(row, position_ids=positions).logits.cpu()
    assert (unpacked[:, 13:] - alone[1]).abs().max() > 1e-2


SMALL = TrainConfig(model="micro", steps=5, batch_size=max(8, N), seq_len=32, eval_batches=2, dtype="fp32")


def test_packed_sft_rows_give_the_unpacked_rows_loss_and_gradients(tmp_path):
    tok = small_tokenizer()
    path = write_jsonl(tmp_path / "chats.jsonl", sft_conversations(12))
    _, config = tokenizer_and_config(get_config("tiny"), tok)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)  # on the CPU: what is checked is the rows, the positions and the attention
    use(model, None, "blockwise", block=64)
    batches = {packed: [torch.stack(list(c)) for c in sft_rows(sft_file(path, tok, 384, tmp_path, packed=packed), 384,
                                                                  val_fraction=0)[0]] for packed in (False, True)}
    assert len(batches[True][0]) < len(batches[False][0]) == 12
    results = {}
    for name, (ids, labels, *packed) in {"rows": batches[False], "packed": batches[True],
                                         "no segments": batches[True][:2] + [None, batches[True][3]],
                                         "no positions": batches[True][:3] + [None]}.items():
        model.zero_grad()
        loss = forward_loss(model, ids, labels, None, *packed) if packed else forward_loss(model, ids, labels)
        loss.backward()
        results[name] = loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}
    loss, grads = results["rows"]
    assert results["packed"][0] == pytest.approx(loss, abs=LOSS_TOL)
    for name, want in grads.items():
        assert (results["packed"][1][name] - want).abs().max() <= GRAD_TOL * want.abs().max(), name
    assert abs(results["no segments"][0] - loss) > 1e-3  # conversations reading the ones before them
    assert results["no positions"][0] == pytest.approx(loss, abs=LOSS_TOL)  # RoPE is relative: offsets cancel
    eager = LlamaForCausalLM(tokenizer_and_config(get_config("tiny"), tok)[1])  # (use() set config's attention)
    ids, labels, segment_ids, position_ids = batches[True]
    with pytest.raises(ValueError, match="packed rows .* need attention that keeps their conversations apart"):
        forward_loss(eager, ids, labels, None, segment_ids, position_ids)


class KernelCall:
    """Stands in for torch_xla's Pallas kernel, which only a TPU runs: records its arguments."""

    def __init__(self):
        self.calls = []

    def __call__(self, q, k, v, causal=False, q_segment_ids=None, kv_segment_ids=None, sm_scale=1.0, *, ab=None,
                 partition_spec=None, mesh=None):
        self.calls.append(dict(q=tuple(q.shape), k=tuple(k.shape), v=tuple(v.shape), causal=causal,
                               q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, sm_scale=sm_scale,
                               partition_spec=partition_spec, mesh=mesh))
        return torch.zeros_like(q)


@pytest.fixture
def fake_tpu(monkeypatch):
    import torch_xla.experimental.custom_kernel as custom_kernel
    kernel = KernelCall()
    monkeypatch.setattr(custom_kernel, "flash_attention", kernel)
    monkeypatch.setattr(attention, "on_tpu", lambda: True)
    return kernel


def test_flash_on_a_tpu_calls_the_kernel_with_table_2s_partition_spec(fake_tpu):
    mesh = make_mesh()
    query, key, value = (torch.randn(2, heads, 256, 16) for heads in (4, 2, 2))  # (bsz, heads, seqlen, head_dim)
    segments = torch.arange(256).repeat(2, 1) // 100  # int64, as the loader gives them: 3 documents a row
    out, weights = hf_attention(None, query, key, value, None, 0.25, implementation="flash", mesh=mesh,
                                segment_ids=segments)
    assert out.shape == (2, 256, 4, 16) and weights is None  # (bsz, seqlen, heads, head_dim)
    [call] = fake_tpu.calls
    assert call["q"] == call["k"] == call["v"] == (2, 4, 256, 16)  # KV heads repeated to the query heads
    assert call["causal"] and call["sm_scale"] == 0.25 and call["mesh"] is mesh
    for ids in (call["q_segment_ids"], call["kv_segment_ids"]):
        assert ids.dtype == torch.int32 and torch.equal(ids, segments.int())
    assert call["partition_spec"] == batch_spec(("data", "model", None, None), mesh)  # Table 2's batch and heads


def test_flash_pads_a_length_the_kernel_does_not_take_and_says_so(fake_tpu, monkeypatch):
    """100 and 192 tokens run the kernel at 128 and 256 (never the blockwise loop), the padding a
    segment of its own, the output cut back; the layer records the path. (Whether the kernel takes
    a length, and that padding changes nothing: tests/test_tpu_kernels.py.)"""
    for n, padded in ((100, 128), (192, 256)):
        query, key, value = (torch.randn(1, heads, n, 16) for heads in (4, 2, 2))
        layer = torch.nn.Module()
        out, _ = hf_attention(layer, query, key, value, None, 0.25, implementation="flash",
                              segment_ids=torch.zeros(1, n, dtype=torch.long))
        call = fake_tpu.calls.pop()
        assert call["q"] == (1, 4, padded, 16) and out.shape == (1, n, 4, 16)
        assert call["q_segment_ids"][0, n:].eq(-1).all() and call["q_segment_ids"][0, :n].eq(0).all()
        assert layer.attention_ran == f"flash ({n} padded to {padded})"
    monkeypatch.setattr(attention, "on_tpu", lambda: False)
    assert attention.default_implementation() == "blockwise"
    layer = torch.nn.Module()
    hf_attention(layer, *(torch.randn(1, h, 128, 16) for h in (4, 2, 2)), None, 0.25, implementation="flash")
    assert not fake_tpu.calls and layer.attention_ran == "blockwise"  # a CPU never calls the kernel


def test_a_model_on_a_faked_tpu_calls_the_kernel_in_every_layer(fake_tpu):
    mesh = make_mesh()
    model = build_model(get_config("tiny"), mesh, "2d", dtype=torch.float32, attention="flash")
    ids = torch.zeros(N, 128, dtype=torch.long, device=torch_xla.device())
    forward_loss(model, ids)
    assert len(fake_tpu.calls) == model.config.num_hidden_layers
    assert all(c["partition_spec"] == batch_spec(("data", "model", None, None), mesh) for c in fake_tpu.calls)
    assert attention.default_implementation() == "flash" and attention.ran(model) == "flash"


def test_use_bad_input():
    with pytest.raises(ValueError, match="attention implementation 'sdpa' is not one of eager, blockwise, flash"):
        use(None, None, "sdpa")
    with pytest.raises(ValueError, match="attention=.*not one of"):
        setup(dataclasses.replace(SMALL, attention="flash2"))
    with pytest.raises(ValueError, match=r"scan_layers with flash attention \(the TPU's default\).*--attention blockwise"):
        setup(dataclasses.replace(SMALL, attention="flash", scan_layers=True))  # torch_xla's kernel cannot be scanned
